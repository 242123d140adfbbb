"""Scale-out behind a standard balancer, for real on loopback: three CPU server replicas behind
HAProxy (Debian's package; h2c both ways, `balance hdr(x-di-sequence-id)` with consistent
hashing), driven by the Python client, which sends every call's sequence id as metadata.

Checks: the sequences spread over the replicas (each replica asked directly); every answer
through the balancer equals a single reference server's; after one replica is killed only its
sequences fail, with UNAVAILABLE (the balancer's answer, naming the replica's loss) or
NOT_FOUND (another replica that never had it, saying it may have been lost with its
replica); the other replicas' sequences answer exactly as before; and the documented recovery
(re-create the sequence and prefill it again) brings the lost ones back with the same answers.
The config written here is the one docs/deploy.md documents (deploy/haproxy/haproxy.cfg)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import grpc
import numpy as np

from _support import REPO, ServerProcess, _free_port, di, find_server_binary

PROFILE = str(REPO / "tests" / "python" / "profiles" / "py-small.json")
TEMPLATE = REPO / "deploy" / "haproxy" / "haproxy.cfg"
SEQUENCES = 36
PREFILL = 40


def _wait_port(port: int, proc: subprocess.Popen, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


class Balancer:
    """HAProxy in the foreground with the repository's config, servers filled in."""

    def __init__(self, replicas: list[str], workdir: Path):
        self.workdir = workdir
        errors = workdir / "errors"
        errors.mkdir()
        for code in (502, 503, 504):
            shutil.copyfile(TEMPLATE.parent / "errors" / f"{code}.http",
                            errors / f"{code}.http")
        servers = "\n".join(f"    server r{i} {t} proto h2 check inter 200ms fall 2 rise 1"
                            for i, t in enumerate(replicas))
        for _ in range(3):
            self.port = _free_port()
            text = TEMPLATE.read_text()
            text = text.replace("bind 127.0.0.1:8080", f"bind 127.0.0.1:{self.port}")
            text = text.replace("/etc/haproxy/decode-indexer-errors", str(errors))
            marker = "    # servers (one line a replica)"
            text = text.replace(marker, marker + "\n" + servers)
            cfg = workdir / "haproxy.cfg"
            cfg.write_text(text)
            self.log = open(workdir / "haproxy.log", "w")
            self.proc = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=self.log,
                                         stderr=subprocess.STDOUT)
            if _wait_port(self.port, self.proc):
                self.target = f"127.0.0.1:{self.port}"
                return
            self.stop()
        raise RuntimeError("haproxy did not start:\n" + (workdir / "haproxy.log").read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@unittest.skipIf(shutil.which("haproxy") is None, "haproxy not installed (Debian: haproxy)")
class ThreeReplicasBehindHaproxy(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        binary = find_server_binary()
        if binary is None:
            raise unittest.SkipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        cls.tmp = Path(tempfile.mkdtemp(prefix="di_balancer_"))
        cls.replicas = [ServerProcess(binary, PROFILE, 256, ["--cpu-threads", "1"])
                        for _ in range(3)]
        cls.reference = ServerProcess(binary, PROFILE, 512, ["--cpu-threads", "1"])
        cls.balancer = Balancer([r.target for r in cls.replicas], cls.tmp)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.balancer.stop()
        for s in [*cls.replicas, cls.reference]:
            s.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def _prefill(self, client: di.Client, seq: int, info: di.ServerInfo) -> None:
        for layer in info.cache_layers:
            client.append_keys(seq, layer, self.keys[seq][layer])

    def _step(self, client: di.Client, seq: int) -> np.ndarray:
        # Read-only steps (no new keys): the caches stay as prefilled, so the same step can be
        # asked again after the recovery and must answer the same.
        q, w = self.queries[seq]
        return client.decode_step(0, [di.SequenceStep(seq)], q, w, timeout=30).topk.copy()

    def _held_by(self, replica: ServerProcess, seq: int) -> bool:
        with di.Client(replica.target, timeout=30) as c:
            try:
                self._step(c, seq)
                return True
            except di.IndexerError as e:
                self.assertEqual(e.code, grpc.StatusCode.NOT_FOUND, e)
                return False

    def _load_through_balancer(self) -> None:
        """decode-indexer-load keys all of a worker's calls by its first sequence, so its
        multi-sequence batches stay on one replica: a verified run through the balancer."""
        load = Path(find_server_binary()).resolve().parents[1] / "client/load/decode-indexer-load"
        if not load.is_file():
            return
        done = subprocess.run(
            [str(load), "--target", self.balancer.target, "--concurrency", "3",
             "--requests-per-step", "3", "--context", "48", "--steps", "6", "--warmup-steps",
             "0", "--verify", "--verify-sequences", "3", "--progress", "off", "-q"],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout[-3000:] + done.stderr[-3000:])

    def _batch_with_one_route_key(self, lb: di.Client, ref: di.Client, info, rng) -> None:
        """Sequences created, prefilled and stepped under one routing key share a replica, so
        a batch of them works through the balancer and answers as a single server."""
        ids = [int(x) for x in rng.choice(1 << 62, 4, replace=False)]
        key = ids[0]
        for s in ids:
            keys = {layer: rng.standard_normal((PREFILL, info.head_dim), dtype=np.float32)
                    for layer in info.cache_layers}
            lb.create_sequence(s, route=key)
            ref.create_sequence(s)
            for layer in info.cache_layers:
                lb.append_keys(s, layer, keys[layer], route=key)
                ref.append_keys(s, layer, keys[layer])
        q = rng.standard_normal((len(ids), info.num_heads, info.head_dim), dtype=np.float32)
        w = rng.standard_normal((len(ids), info.num_heads), dtype=np.float32)
        steps = [di.SequenceStep(s) for s in ids]
        np.testing.assert_array_equal(lb.decode_step(0, steps, q, w).topk,
                                      ref.decode_step(0, steps, q, w).topk)
        for s in ids:
            lb.release_sequence(s, route=key)
            ref.release_sequence(s)

    def test_sequence_affine_routing_failover_and_recovery(self):
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        lb = di.Client(self.balancer.target, timeout=30)
        ref = di.Client(self.reference.target, timeout=30)
        info = ref.server_info()
        self._load_through_balancer()
        self._batch_with_one_route_key(lb, ref, info, rng)
        ids = [int(x) for x in rng.choice(1 << 62, SEQUENCES, replace=False)]
        self.keys = {s: {layer: rng.standard_normal((PREFILL, info.head_dim), dtype=np.float32)
                         for layer in info.cache_layers} for s in ids}
        self.queries = {s: (rng.standard_normal((1, info.num_heads, info.head_dim),
                                                dtype=np.float32),
                            rng.standard_normal((1, info.num_heads), dtype=np.float32))
                        for s in ids}
        expected = {}
        for s in ids:
            for c in (lb, ref):
                c.create_sequence(s)
                self._prefill(c, s, info)
            expected[s] = self._step(ref, s)
            np.testing.assert_array_equal(self._step(lb, s), expected[s], err_msg=f"seq {s}")

        # Spread: each replica holds some, none twice, all accounted for.
        holder = {}
        for i, r in enumerate(self.replicas):
            for s in ids:
                if self._held_by(r, s):
                    self.assertNotIn(s, holder, "a sequence on two replicas")
                    holder[s] = i
        self.assertEqual(sorted(holder), sorted(ids))
        counts = [list(holder.values()).count(i) for i in range(3)]
        self.assertTrue(all(n > 0 for n in counts), f"no spread: {counts}")

        # One replica dies.
        victim = max(range(3), key=lambda i: counts[i])
        self.replicas[victim].proc.send_signal(signal.SIGKILL)
        self.replicas[victim].proc.wait()
        lost = [s for s in ids if holder[s] == victim]
        kept = [s for s in ids if holder[s] != victim]
        for s in kept:
            np.testing.assert_array_equal(self._step(lb, s), expected[s],
                                          err_msg=f"a surviving replica's sequence {s} changed")
        seen = {}
        for s in lost:
            with self.assertRaises(di.IndexerError) as cm:
                self._step(lb, s)
            e = cm.exception
            seen[e.code.name] = seen.get(e.code.name, 0) + 1
            self.assertIn(e.code, (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND), e)
            if e.code == grpc.StatusCode.NOT_FOUND:
                self.assertIn("lost with the replica", e.message)
            else:
                self.assertIn("replica", e.message)

        print(f"\n[balancer] sequences per replica {counts}; replica {victim} killed; its "
              f"{len(lost)} sequences answered {seen}", file=sys.stderr)
        # Recovery as documented: re-create and prefill (retrying while the balancer still
        # routes to the dead replica), then the same step answers as before.
        for s in lost:
            for attempt in range(600):
                try:
                    lb.create_sequence(s)
                    break
                except di.IndexerError as e:
                    self.assertEqual(e.code, grpc.StatusCode.UNAVAILABLE, e)
                    time.sleep(0.05)
            else:
                self.fail(f"sequence {s} could not be re-created through the balancer")
            self._prefill(lb, s, info)
            np.testing.assert_array_equal(self._step(lb, s), expected[s],
                                          err_msg=f"recovered sequence {s}")
        # The survivors now hold every sequence, each once.
        live = [r for i, r in enumerate(self.replicas) if i != victim]
        for s in ids:
            self.assertEqual(sum(self._held_by(r, s) for r in live), 1, f"sequence {s}")
        lb.close()
        ref.close()


if __name__ == "__main__":
    unittest.main()
