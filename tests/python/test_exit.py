"""A process that used a DecodeStream exits: grpcio could deadlock at interpreter exit when a
streaming call was still alive (its call object, collected during finalization, waited for a
lock a frozen gRPC daemon thread held); the client now closes every open Client at exit. Each
case runs a fresh interpreter against a real CPU server, several times (the hang was ~40% of
exits), and must end within a few seconds every time."""

import os
import subprocess
import sys
import unittest

from _support import REPO, ServerProcess, find_server_binary

PROFILE = str(REPO / "tests" / "python" / "profiles" / "py-small.json")

_SCRIPT = r"""
import sys
sys.path.insert(0, {path!r})
import numpy as np
import decode_indexer as di
c = di.Client({target!r}, timeout=30)
info = c.server_info()
layer = next(l.layer for l in info.layers if l.owns_cache and l.role == "dense")
seq = c.create_sequence()
rng = np.random.default_rng(1)
c.append_keys(seq, layer, rng.standard_normal((40, info.head_dim), dtype=np.float32))
q = rng.standard_normal((1, info.num_heads, info.head_dim), dtype=np.float32)
w = rng.standard_normal((1, info.num_heads), dtype=np.float32)
s = c.stream()
for _ in range(3):
    s.send(layer, [di.SequenceStep(seq)], q, w)
    s.recv()
{ending}
print("done", flush=True)
"""

ENDINGS = {
    "stream closed, client left open": "s.close()",
    "stream closed and drained": "s.close()\nfor _ in s: pass",
    "stream left open": "",
}


class ExitTest(unittest.TestCase):
    def test_processes_that_streamed_exit(self):
        binary = find_server_binary()
        if binary is None:
            self.skipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        server = ServerProcess(binary, PROFILE, 64)
        try:
            for name, ending in ENDINGS.items():
                script = _SCRIPT.format(path=str(REPO / "client" / "python"),
                                        target=server.target, ending=ending)
                for run in range(6):
                    with self.subTest(ending=name, run=run):
                        try:
                            done = subprocess.run([sys.executable, "-c", script], timeout=20,
                                                  capture_output=True, text=True,
                                                  env=dict(os.environ))
                        except subprocess.TimeoutExpired:
                            self.fail(f"{name}: the process did not exit within 20 s")
                        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
                        self.assertIn("done", done.stdout)
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()
