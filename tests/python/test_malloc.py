"""decode_indexer.keep_freed_memory and Client(malloc_keep_mb=): a step's message pattern (two
1 MiB bytes objects made and dropped, call after call) faults its pages in again every call
with glibc's defaults and reuses warm pages once the setting is applied. Each case runs in its
own interpreter, since the setting is process-wide."""

import os
import platform
import subprocess
import sys
import unittest

import _support  # noqa: F401  (puts the package on sys.path)

_PATTERN = r"""
import resource, sys
sys.path.insert(0, {path!r})
import decode_indexer as di
from decode_indexer import _malloc
{setup}
src = bytes(range(256)) * 4096  # 1 MiB

def faults(rounds):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        a = bytes(memoryview(src))  # a fresh 1 MiB object, written by the copy
        b = bytes(memoryview(src))
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults(3)
print(faults(100), _malloc._applied)
"""

_ROUNDS_PAGES = 100 * 2 * (1 << 20) // 4096


def _run(setup: str) -> tuple[int, str]:
    package = os.path.dirname(os.path.dirname(os.path.abspath(
        __import__("decode_indexer").__file__)))
    out = subprocess.run([sys.executable, "-c", _PATTERN.format(path=package, setup=setup)],
                         check=True, capture_output=True, text=True, timeout=120).stdout.split()
    return int(out[0]), out[1]


@unittest.skipUnless(platform.libc_ver()[0] == "glibc", "glibc's mallopt")
class KeepFreedMemoryTest(unittest.TestCase):
    def test_defaults_fault_and_kept_memory_does_not(self):
        default_faults, applied = _run("")
        self.assertEqual(applied, "None")
        self.assertGreaterEqual(default_faults, _ROUNDS_PAGES // 2,
                                "glibc's defaults should fault the pattern's pages every round")
        kept_faults, applied = _run("assert di.keep_freed_memory(64)")
        self.assertEqual(applied, "64")
        self.assertLessEqual(kept_faults, _ROUNDS_PAGES // 50,
                             f"64 MB kept should reuse warm pages (defaults: {default_faults})")

    def test_the_client_applies_it_unless_told_not_to(self):
        # A channel is made without connecting: no server needed.
        _, applied = _run("di.Client('127.0.0.1:1', malloc_keep_mb=0)")
        self.assertEqual(applied, "None")
        faults, applied = _run("di.Client('127.0.0.1:1')")
        self.assertEqual(applied, "64")
        self.assertLessEqual(faults, _ROUNDS_PAGES // 50)
        _, applied = _run("di.AsyncClient('127.0.0.1:1', malloc_keep_mb=16)")
        self.assertEqual(applied, "16")

    def test_nothing_to_apply_at_zero(self):
        from decode_indexer import keep_freed_memory
        self.assertFalse(keep_freed_memory(0))
        self.assertFalse(keep_freed_memory(-1))


if __name__ == "__main__":
    unittest.main()
