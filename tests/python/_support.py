"""Shared by the Python client tests: the package on sys.path, a real server subprocess, and an
exact NumPy twin of the CPU reference's scoring (spec sections 3, 5 and 6)."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))

import decode_indexer as di  # noqa: E402
from decode_indexer import quant  # noqa: E402


def find_server_binary() -> str | None:
    """$DI_SERVER_BIN, else the newest build*/server/decode-indexer-server of the checkout."""
    env = os.environ.get("DI_SERVER_BIN")
    if env:
        return env
    found = glob.glob(str(REPO / "build*" / "server" / "decode-indexer-server"))
    found = [f for f in found if os.access(f, os.X_OK)]
    return max(found, key=os.path.getmtime) if found else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A decode-indexer-server on a free local port, stopped by stop()."""

    def __init__(self, binary: str, profile: str, cache_pages: int, extra: list[str] = (),
                 env: dict | None = None, client_kwargs: dict | None = None,
                 backend: str = "cpu", listen: str | None = None):
        # client_kwargs: how a client reaches it (TLS, a token), for the readiness probe.
        # backend: "cpu", or "cuda" on a GPU machine (tests/python/test_torch_cuda.py).
        # listen: serve there alone (e.g. "unix:PATH"), the target too, instead of a TCP port.
        self.log = tempfile.NamedTemporaryFile(prefix="di_server_", suffix=".log", delete=False)
        for _ in range(3):  # the free port can be taken between probe and bind: retry
            self.port = _free_port() if listen is None else 0
            self.target = listen or f"127.0.0.1:{self.port}"
            # The shared-memory registration socket: private to this server.
            self.shm_socket = os.path.join(
                tempfile.gettempdir(), f"di-test-{os.getpid()}-{self.port or id(self)}.sock")
            cmd = [binary, "--listen", self.target, "--backend", backend, "--profile", profile,
                   "--cache-pages", str(cache_pages), "--shm-socket", self.shm_socket, *extra]
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
            client = di.Client(self.target, **(client_kwargs or {}))
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and self.proc.poll() is None:
                    try:
                        client.wait_ready(timeout=0.5)
                        return
                    except di.IndexerError:
                        pass
            finally:
                client.close()
            self.stop(keep_log=True)
        raise RuntimeError(f"server did not start: {' '.join(cmd)}\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def stop(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not keep_log:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)


class ServerTestCase(unittest.TestCase):
    """Starts one server per test class (profile PROFILE) and a client to it."""

    PROFILE = "v41"
    CACHE_PAGES = 512
    # More server flags, and the client options that reach such a server (TLS, a token);
    # setUpClass may be given them by a subclass that must make files (certificates) first.
    SERVER_ARGS: tuple = ()
    CLIENT_KWARGS: dict = {}
    BACKEND = "cpu"

    @classmethod
    def setUpClass(cls) -> None:
        binary = find_server_binary()
        if binary is None:
            raise unittest.SkipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"DI_SERVER_BIN={binary} is not an executable")
        cls.server = ServerProcess(binary, cls.PROFILE, cls.CACHE_PAGES, list(cls.SERVER_ARGS),
                                   client_kwargs=cls.CLIENT_KWARGS, backend=cls.BACKEND)
        cls.client = di.Client(cls.server.target, timeout=60, **cls.CLIENT_KWARGS)
        cls.info = cls.client.server_info()
        seed = int.from_bytes(os.urandom(8), "little")
        print(f"\n[{cls.__name__}] server {binary} profile {cls.PROFILE} seed {seed}",
              file=sys.stderr)
        cls.rng = np.random.default_rng(seed)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.server.stop()

    def run(self, result=None):
        # Attach the server's log to a failing test: the server's side of the story.
        failures = len(result.failures) + len(result.errors) if result else 0
        out = super().run(result)
        if result and len(result.failures) + len(result.errors) > failures:
            print(f"\n--- server log (tail) ---\n{self.server.log_tail()}", file=sys.stderr)
        return out

    # -- random inputs -----------------------------------------------------------------------

    def keys(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((n, self.info.head_dim), dtype=np.float32)

    def q(self, rows: int) -> np.ndarray:
        return self.rng.standard_normal((rows, self.info.num_heads, self.info.head_dim),
                                        dtype=np.float32)

    def weights(self, rows: int) -> np.ndarray:
        return self.rng.standard_normal((rows, self.info.num_heads), dtype=np.float32)

    def new_id(self) -> int:
        return int(self.rng.integers(1, 2**62))

    def dense_layers(self) -> list[di.LayerInfo]:
        """Cache-owning layers that score densely (dense or candidate source)."""
        return [l for l in self.info.layers
                if l.owns_cache and l.role in ("dense", "candidate_source")]


# --- the exact reference -------------------------------------------------------------------


def reference_logits_fp8(q_codes, weights, k_codes, k_scales) -> np.ndarray:
    """[rows, L] float32: k_scale * sum_h w[h] * relu(q8 . k8), exact dot, double sums."""
    qv = quant.decode_e4m3(q_codes).astype(np.float64)  # [rows, H, D]
    kv = quant.decode_e4m3(k_codes).astype(np.float64)  # [L, D]
    dots = np.maximum(qv @ kv.T, 0.0)  # exact: small dyadic products, < 2^53 in total
    acc = np.zeros((qv.shape[0], kv.shape[0]))
    for h in range(qv.shape[1]):  # ascending h, in double, as the reference sums
        acc += dots[:, h, :] * np.asarray(weights, np.float64)[:, h, None]
    return (acc * np.asarray(k_scales, np.float64)[None, :]).astype(np.float32)


def reference_logits_fp4(q_packed, q_scale_bytes, weights, k_packed, k_scale_bytes) -> np.ndarray:
    qv = quant.decode_e2m1(quant.unpack_fp4(q_packed)).astype(np.float64)  # [rows, H, D]
    kv = quant.decode_e2m1(quant.unpack_fp4(k_packed)).astype(np.float64)  # [L, D]
    qs = quant.decode_ue8m0(q_scale_bytes).astype(np.float64)  # [rows, H, G]
    ks = quant.decode_ue8m0(k_scale_bytes).astype(np.float64)  # [L, G]
    rows, heads, d = qv.shape
    groups = d // quant.FP4_GROUP
    acc = np.zeros((rows, kv.shape[0]))
    for h in range(heads):
        s = np.zeros((rows, kv.shape[0]))
        for g in range(groups):
            sl = slice(g * quant.FP4_GROUP, (g + 1) * quant.FP4_GROUP)
            s += (qv[:, h, sl] @ kv[:, sl].T) * (qs[:, h, g, None] * ks[None, :, g])
        acc += np.maximum(s, 0.0) * np.asarray(weights, np.float64)[:, h, None]
    return acc.astype(np.float32)


def reference_topk(logits_row: np.ndarray, length: int, k: int) -> np.ndarray:
    """The canonical rule: (logit desc, position asc), first K, ascending, -1 padded."""
    out = np.full(k, -1, dtype=np.int32)
    if length <= k:
        out[:length] = np.arange(length)
        return out
    pos = np.arange(length)
    order = np.lexsort((pos, -logits_row[:length].astype(np.float64)))
    out[:] = np.sort(order[:k])
    return out


def causal_lengths(total: int, rows: int) -> list[int]:
    """Row j of n sees [0, L - n + j + 1) (spec section 5)."""
    return [total - rows + j + 1 for j in range(rows)]
