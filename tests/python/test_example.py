"""examples/frontend.py runs against a real server and exits 0 (streamed and unary)."""

import subprocess
import sys
import unittest

from _support import REPO, ServerTestCase
from test_server import SMALL_PROFILE


class FrontendExampleTest(ServerTestCase):
    PROFILE = SMALL_PROFILE

    def run_example(self, *extra):
        cmd = [sys.executable, str(REPO / "examples" / "frontend.py"), "--target",
               self.server.target, "--steps", "2", "--next-n", "2", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
        self.assertIn("OK", done.stdout.splitlines()[-1])
        return done.stdout

    def test_streamed(self):
        out = self.run_example()
        self.assertIn("(stream)", out)

    def test_unary_with_float_keys(self):
        out = self.run_example("--unary", "--fp32-keys", "--sequences", "3")
        self.assertIn("(unary)", out)

    def test_shared_memory_streamed_and_unary(self):
        self.assertIn("(stream, shared memory)", self.run_example("--shared-memory"))
        self.assertIn("(unary, shared memory)", self.run_example("--shared-memory", "--unary"))


if __name__ == "__main__":
    unittest.main()
