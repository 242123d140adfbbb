"""Runs the Python suite (unittest) and says what was skipped and why.

usage: _run.py [--module NAME] [--only WORD] [--exclude WORD] [--require-server]

--module keeps the tests of module NAME (test_ops: tests/python/test_ops.py) only; ctest runs
each module as its own test (python_client.NAME), so the modules run in parallel.
--only / --exclude keep or drop tests whose id contains WORD (e.g. "torch").
Exit status: 1 when a test failed or errored, or when --require-server is given and a test
was skipped because no server binary was found (the build has one: a missing server is a
failure, not a skip); 77 (ctest SKIP_RETURN_CODE) when any selected test was skipped, or none
was selected; 0 when every selected test ran and passed. Skip reasons are always printed.
"""
import argparse
import sys
import unittest
from pathlib import Path


def flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flatten(t)
        else:
            yield t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module")
    ap.add_argument("--only")
    ap.add_argument("--exclude")
    ap.add_argument("--require-server", action="store_true")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    loader = unittest.TestLoader()
    everything = loader.discover(str(here), top_level_dir=str(here))
    selected = []
    for t in flatten(everything):
        tid = t.id()
        # A module that fails to import is "unittest.loader._FailedTest.<module>": it belongs
        # to its module's run (and fails it), never drops out of it.
        module = tid.rsplit(".", 1)[-1] if tid.startswith("unittest.loader.") else tid.split(".")[0]
        if args.module and module != args.module:
            continue
        if args.only and args.only not in tid:
            continue
        if args.exclude and args.exclude in tid:
            continue
        selected.append(t)
    if not selected:
        print(f"SKIPPED: no test matches --module {args.module!r} --only {args.only!r} "
              f"--exclude {args.exclude!r}")
        return 77
    result = unittest.TextTestRunner(verbosity=2).run(unittest.TestSuite(selected))
    reasons = {}
    for test, reason in result.skipped:
        reasons.setdefault(reason, []).append(test.id())
    for reason, ids in reasons.items():
        print(f"SKIPPED {len(ids)} test(s): {reason}: {', '.join(sorted(ids)[:4])}"
              f"{' ...' if len(ids) > 4 else ''}")
    if result.failures or result.errors:
        return 1
    if args.require_server and any("decode-indexer-server" in r for r in reasons):
        print("FAILED: this build has a server, but the server tests could not find it")
        return 1
    if result.skipped:
        print(f"{result.testsRun - len(result.skipped)} of {result.testsRun} tests ran; "
              "the rest were skipped (reasons above)")
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
