"""The Python client over a Unix domain socket: a real CPU server started with only
`--listen unix:PATH` (a socket in a private temp directory, no TCP port), unary, columnar,
streamed and asyncio steps through it answering the exact reference, the socket file gone
when the server stops; and a socket address that cannot be served stops the server at once
with a message that says why: a second server on a live server's socket (its lock held), a
--shm-socket that is a --listen path, two TCP addresses that overlap, a bad --socket-mode.
--socket-mode is applied to both socket files."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import tempfile
import unittest
from pathlib import Path

import numpy as np

from _support import (REPO, ServerProcess, causal_lengths, di, find_server_binary, quant,
                      reference_logits_fp8, reference_topk)

PROFILE = str(REPO / "tests" / "python" / "profiles" / "py-small.json")


class UnixSocketTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.binary = find_server_binary()
        if cls.binary is None:
            raise unittest.SkipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        cls.dir = tempfile.TemporaryDirectory(prefix="di-uds-")
        cls.path = os.path.join(cls.dir.name, "grpc.sock")
        cls.server = ServerProcess(cls.binary, PROFILE, 64, listen=f"unix:{cls.path}")
        cls.client = di.Client(f"unix:{cls.path}", timeout=60)
        cls.info = cls.client.server_info()
        cls.rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.server.stop()
        cls.dir.cleanup()

    def test_serves_on_the_socket_alone(self):
        self.assertTrue(stat.S_ISSOCK(os.lstat(self.path).st_mode))
        self.assertIn(f"listening on unix:{self.path}", self.server.log_tail())
        self.assertNotIn("(port", self.server.log_tail())

    def test_steps_over_the_socket_answer_the_exact_reference(self):
        info, rng = self.info, self.rng
        layer = next(l for l in info.layers if l.role == "dense" and l.cache_format == "fp8")
        H, D, K = info.num_heads, info.head_dim, info.topk
        lengths = [40, K + 9]
        keys = [rng.standard_normal((n, D), dtype=np.float32) for n in lengths]
        ids = [self.client.create_sequence() for _ in lengths]
        for seq, k in zip(ids, keys):
            self.client.append_keys(seq, layer.layer, k)
        q = rng.standard_normal((2, H, D), dtype=np.float32)
        w = rng.standard_normal((2, H), dtype=np.float32)

        want = []
        for i in range(2):
            qc, wf = quant.quantize_q_fp8(q[i:i + 1], w[i:i + 1], hadamard_rotate=info.hadamard)
            kc, ks = quant.quantize_fp8(keys[i], hadamard_rotate=info.hadamard)
            logits = reference_logits_fp8(qc.array, wf, kc, ks)
            (length,) = causal_lengths(lengths[i], 1)
            want.append(reference_topk(logits[0], length, K))
        want = np.stack(want)

        steps = [di.SequenceStep(s) for s in ids]
        got = {"unary": self.client.decode_step(layer.layer, steps, q, w).topk,
               "columnar": self.client.decode_step_columnar(
                   layer.layer, np.asarray(ids, np.uint64), q, w, num_rows=1).topk}
        with self.client.stream() as s:
            s.send(layer.layer, steps, q, w)
            s.send_columnar(layer.layer, np.asarray(ids, np.uint64), q, w, num_rows=1)
            got["stream"], got["stream columnar"] = s.recv().topk, s.recv().topk

        async def over_asyncio():
            async with di.AsyncClient(f"unix:{self.path}", timeout=60) as c:
                return (await c.decode_step(layer.layer, steps, q, w)).topk
        got["asyncio"] = asyncio.run(over_asyncio())
        for path, topk in got.items():
            np.testing.assert_array_equal(topk, want, f"{path} over the socket")
        for s in ids:
            self.client.release_sequence(s)

    def test_the_socket_file_goes_with_the_server(self):
        path = os.path.join(self.dir.name, "short-lived.sock")
        server = ServerProcess(self.binary, PROFILE, 16, listen=f"unix:{path}")
        try:
            self.assertTrue(os.path.exists(path))
        finally:
            server.stop()
        self.assertFalse(os.path.exists(path), "the socket file outlived the server")


class UnixSocketRefusalTest(unittest.TestCase):
    """What cannot be served stops the start, naming the address and the reason."""

    def run_server(self, *listen: str, extra: tuple = (), cwd: str | None = None
                   ) -> subprocess.CompletedProcess:
        binary = find_server_binary()
        if binary is None:
            self.skipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        args = [binary, "--backend", "cpu", "--profile", PROFILE, "--cache-pages", "16"]
        for a in listen:
            args += ["--listen", a]
        return subprocess.run(args + list(extra), capture_output=True, text=True, timeout=60,
                              cwd=cwd)

    def test_a_path_that_cannot_be_bound(self):
        with tempfile.TemporaryDirectory(prefix="di-uds-") as d:
            in_the_way = Path(d) / "file"
            in_the_way.write_text("x")
            for address, why in [
                    (f"unix:{d}/missing/grpc.sock", f'directory "{d}/missing": No such file'),
                    (f"unix:{in_the_way}", "the path exists and is not a socket")]:
                with self.subTest(address=address):
                    done = self.run_server("127.0.0.1:0", address)
                    self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                    self.assertIn(f'cannot start: ', done.stdout + done.stderr)
                    self.assertIn(f'listen: "{address}": {why}', done.stdout + done.stderr)
            self.assertEqual(in_the_way.read_text(), "x")

    def test_a_malformed_address_is_a_usage_error(self):
        for address, why in [("unix:", "unix: needs a path"),
                             ("localhost", "expected host:port")]:
            with self.subTest(address=address):
                done = self.run_server(address)
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn("--listen", done.stderr)
                self.assertIn(why, done.stderr)

    def test_an_address_given_twice_is_a_usage_error(self):
        # gRPC's second bind of one path would unlink the first's socket file, orphaning it.
        with tempfile.TemporaryDirectory(prefix="di-uds-") as d:
            for first, second in [(f"unix:{d}/grpc.sock", f"unix://{d}/grpc.sock"),
                                  ("127.0.0.1:50051", "127.0.0.1:50051")]:
                with self.subTest(address=second):
                    done = self.run_server(first, second)
                    self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                    self.assertIn(f'--listen: "{second}": ', done.stderr)
                    self.assertIn("given twice", done.stderr)
                    self.assertFalse(os.path.exists(f"{d}/grpc.sock"))

    def test_overlapping_tcp_addresses_are_a_usage_error(self):
        # gRPC's SO_REUSEPORT would let both bind: two listeners of one server on one port.
        for first, second, why in [
                ("localhost:50051", "127.0.0.1:50051", 'overlaps "localhost:50051"'),
                ("0.0.0.0:50051", "[::1]:50051", 'overlaps "0.0.0.0:50051": a wildcard host'),
                ("127.0.0.1:50051", "[::ffff:127.0.0.1]:50051", "the same address as")]:
            with self.subTest(address=second):
                done = self.run_server(first, second)
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn(f'--listen: "{second}": {why}', done.stderr)

    def test_an_shm_socket_on_a_listen_path_is_a_usage_error(self):
        with tempfile.TemporaryDirectory(prefix="di-uds-") as d:
            for listen, shm in [(f"unix:{d}/x.sock", f"{d}/x.sock"),
                                (f"unix://{d}/x.sock", "x.sock"),
                                (f"unix:x.sock", f"{d}/./x.sock")]:
                with self.subTest(listen=listen, shm=shm):
                    done = self.run_server("127.0.0.1:0", listen, extra=("--shm-socket", shm),
                                           cwd=d)
                    self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                    self.assertIn(f'--shm-socket: "{shm}" is the socket of --listen "{listen}"',
                                  done.stderr)
                    self.assertEqual(os.listdir(d), [])

    def test_a_bad_socket_mode_is_a_usage_error(self):
        for mode in ["0888", "01777", "rw", ""]:
            with self.subTest(mode=mode):
                done = self.run_server("127.0.0.1:0", extra=("--socket-mode", mode))
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn(f'--socket-mode: "{mode}": expected an octal file mode of at most '
                              "0777", done.stderr)

    def test_a_second_server_on_a_live_servers_paths_is_refused(self):
        binary = find_server_binary()
        if binary is None:
            self.skipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        with tempfile.TemporaryDirectory(prefix="di-uds-") as d:
            path = f"{d}/grpc.sock"
            server = ServerProcess(binary, PROFILE, 16, listen=f"unix:{path}",
                                   extra=["--socket-mode", "0660"])
            shm = server.shm_socket
            try:
                self.assertEqual(stat.S_IMODE(os.lstat(path).st_mode), 0o660)
                self.assertEqual(stat.S_IMODE(os.lstat(shm).st_mode), 0o660)
                done = self.run_server(f"unix:{path}")
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn(f'listen: "unix:{path}": another server holds {path}',
                              done.stdout + done.stderr)
                done = self.run_server("127.0.0.1:0", extra=("--shm-socket", shm))
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn(f'shm-socket: "{shm}": another server holds {shm}',
                              done.stdout + done.stderr)
                self.assertTrue(stat.S_ISSOCK(os.lstat(path).st_mode))
                self.assertTrue(stat.S_ISSOCK(os.lstat(shm).st_mode))
            finally:
                server.stop()
            self.assertEqual(os.listdir(d), [], "the socket or its lock file outlived it")
            for gone in (shm, shm + ".lock"):
                self.assertFalse(os.path.exists(gone), f"{gone} outlived the server")

if __name__ == "__main__":
    unittest.main()
