#!/usr/bin/env python3
"""The mutation check: plants each bug of plants.py into the source, one at a time, rebuilds
the test binaries that should catch it (incrementally, in an existing CPU-only build dir),
runs them, restores the source, and reports which plants no test caught.

usage: tests/mutation/run.py [--build-dir build-cpu] [--only NAME,...] [--report FILE]

The source is restored after every plant (also on Ctrl-C or an error), and the binaries are
rebuilt on the clean source at the end, so the build dir is left as it was. Exit status 1
when a plant was not caught or the unmutated suite does not pass.
"""
import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plants import PLANTS  # noqa: E402

BINARIES = {  # test binary -> its path in the build dir
    "kernels_test": "tests/kernels/kernels_test",
    "executor_test": "tests/server/executor_test",
    "executor_state_test": "tests/server/executor_state_test",
    "request_decode_test": "tests/service/request_decode_test",
    "api_test": "tests/service/api_test",
    "decode_test": "tests/service/decode_test",
    "columnar_test": "tests/service/columnar_test",
}


def build(build_dir: Path, targets) -> None:
    cmd = ["nice", "ninja", "-C", str(build_dir), "-j", os.environ.get("DI_JOBS", "1"), *targets]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"build failed: {' '.join(cmd)}\n{r.stdout[-3000:]}{r.stderr[-2000:]}")


def run_tests(build_dir: Path, names):
    """Answers {binary: [failed test names]} (a crash or a non-zero exit counts)."""
    out = {}
    for name in names:
        exe = build_dir / BINARIES[name]
        try:
            r = subprocess.run(["nice", str(exe), "--gtest_brief=1"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            out[name] = ["(hung: killed after 300 s)"]
            continue
        failed = sorted(set(re.findall(r"^\[  FAILED  \] ([\w/.]+)", r.stdout, re.M)))
        if r.returncode != 0 and not failed:
            failed = [f"(exit {r.returncode})"]
        if failed:
            out[name] = failed
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-cpu")
    ap.add_argument("--only", default="")
    ap.add_argument("--report", default="")
    args = ap.parse_args()
    build_dir = (ROOT / args.build_dir).resolve()
    plants = [p for p in PLANTS if not args.only or p["name"] in args.only.split(",")]
    all_tests = sorted({t for p in plants for t in p["tests"]})
    targets = all_tests

    print(f"baseline: building and running {', '.join(all_tests)}", flush=True)
    build(build_dir, targets)
    base = run_tests(build_dir, all_tests)
    if base:
        print(f"the unmutated suite fails: {base}")
        return 1

    rows = []
    t_all = time.time()
    try:
        for p in plants:
            path = ROOT / p["file"]
            original = path.read_text()
            if original.count(p["old"]) != 1:
                rows.append((p, None, "snippet not found exactly once: plants.py is stale"))
                print(f"{p['name']}: STALE (snippet not found once in {p['file']})", flush=True)
                continue
            t0 = time.time()
            try:
                path.write_text(original.replace(p["old"], p["new"]))
                try:
                    build(build_dir, p["tests"])
                    caught = run_tests(build_dir, p["tests"])
                    note = ""
                except RuntimeError as e:  # a plant that does not compile counts as caught
                    caught = {"(compiler)": [str(e).splitlines()[0]]}
                    note = "did not compile"
            finally:
                path.write_text(original)
            rows.append((p, caught, note))
            verdict = "caught by " + "; ".join(
                f"{b} ({len(t)}): {', '.join(t)}" for b, t in caught.items()
            ) if caught else "NOT CAUGHT"
            print(f"{p['name']}: {verdict} ({time.time() - t0:.0f} s)", flush=True)
    finally:
        # Leave the build dir built from the clean source.
        build(build_dir, targets)

    missed = [p["name"] for p, caught, _ in rows if not caught]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on commit {commit} "
        f"(plus the working tree), {time.time() - t_all:.0f} s: "
        f"`tests/mutation/run.sh --build-dir {args.build_dir}`; binaries run: "
        f"{', '.join(all_tests)}.",
        "",
        "| plant | what it breaks | caught by |",
        "|---|---|---|",
    ]
    for p, caught, note in rows:
        if caught is None:
            by = f"STALE: {note}"
        elif not caught:
            by = "**NOT CAUGHT**"
        else:
            by = "; ".join(f"`{b}` ({len(t)} failed): {', '.join(t[:4])}{', …' if len(t) > 4 else ''}"
                           for b, t in caught.items())
            if note:
                by += f" ({note})"
        lines.append(f"| `{p['name']}` | {p['what']} (`{p['file']}`) | {by} |")
    lines.append("")
    lines.append(f"Plants not caught: {', '.join(missed) if missed else 'none'}.")
    text = "\n".join(lines)
    print("\n" + text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 1 if missed or any(c is None for _, c, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
