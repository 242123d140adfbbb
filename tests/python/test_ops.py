"""Operating the real decode-indexer-server binary: the /metrics text passes `promtool check
metrics` (Debian's prometheus package), --metrics-listen wins over DI_METRICS_LISTEN, JSON logs
carry the request id the response echoes, health answers per service name, and SIGTERM with
--drain-grace reports NOT_SERVING while still serving before it stops."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import unittest
import urllib.error
import urllib.request

import grpc

from _support import REPO, ServerProcess, _free_port, di, find_server_binary

PROFILE = str(REPO / "tests" / "python" / "profiles" / "py-small.json")
SERVICE = "decode_indexer.v1.DecodeIndexer"
SERVING, NOT_SERVING = 1, 2


def health(target: str, service: str) -> int:
    """grpc.health.v1.Health/Check by hand (field 1 of request and response), no stubs."""
    with grpc.insecure_channel(target) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=None, response_deserializer=None)
        name = service.encode()
        reply = check(b"\x0a" + bytes([len(name)]) + name if name else b"", timeout=30)
        return reply[1] if len(reply) >= 2 and reply[0] == 0x08 else 0


def scrape(port: int, headers: dict | None = None) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


class BinaryTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.binary = find_server_binary()
        if self.binary is None:
            self.skipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        self.servers: list[ServerProcess] = []

    def tearDown(self) -> None:
        for s in self.servers:
            s.stop()

    def start(self, extra: list[str], env: dict | None = None) -> ServerProcess:
        s = ServerProcess(self.binary, PROFILE, 64, extra, env=env)
        self.servers.append(s)
        return s


class MetricsTest(BinaryTestCase):
    def test_scrape_passes_promtool(self):
        if shutil.which("promtool") is None:
            self.skipTest("promtool not installed (Debian: prometheus)")
        port = _free_port()
        s = self.start(["--metrics-listen", f"127.0.0.1:{port}"])
        with di.Client(s.target, timeout=30) as c:
            seq = c.create_sequence()
            info = c.server_info()
            import numpy as np
            rng = np.random.default_rng(1)
            for layer in info.cache_layers:
                c.append_keys(seq, layer, rng.standard_normal((20, info.head_dim),
                                                              dtype=np.float32))
            q = rng.standard_normal((1, info.num_heads, info.head_dim), dtype=np.float32)
            w = rng.standard_normal((1, info.num_heads), dtype=np.float32)
            c.decode_step(0, [di.SequenceStep(seq)], q, w)
            with self.assertRaises(di.IndexerError):
                c.release_sequence(seq + 1)
        text = scrape(port)
        done = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                              capture_output=True)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        for name in ("decode_indexer_build_info", "decode_indexer_steps_in_flight",
                     "decode_indexer_rpc_duration_seconds_bucket", "process_cpu_seconds_total",
                     "process_resident_memory_bytes", "process_open_fds",
                     "decode_indexer_device_memory_bytes"):
            self.assertIn(name, text)
        self.assertIn('decode_indexer_rpcs_total{method="ReleaseSequence",code="NOT_FOUND"} 1',
                      text)

    def test_alert_rules_name_only_what_the_server_exports(self):
        """deploy/prometheus/decode-indexer-rules.yml must not alert on a metric (or a label)
        the server does not export: a renamed metric would leave its alert silent forever."""
        import re
        rules = (REPO / "deploy" / "prometheus" / "decode-indexer-rules.yml").read_text()
        exprs = "\n".join(re.findall(r"expr:(.*?)(?=\n\s*(?:for|labels|record|- |$))", rules,
                                      re.S))
        named = set(re.findall(r"(?<![:\w])((?:decode_indexer|process)_[a-z0-9_]+)", exprs))
        self.assertGreater(len(named), 8, f"no metrics found in the rules: {named}")
        port = _free_port()
        s = self.start(["--metrics-listen", f"127.0.0.1:{port}"])
        with di.Client(s.target, timeout=30) as c:  # one step, so the step families have samples
            seq = c.create_sequence()
            info = c.server_info()
            import numpy as np
            rng = np.random.default_rng(2)
            c.append_keys(seq, 0, rng.standard_normal((20, info.head_dim), dtype=np.float32))
            q = rng.standard_normal((1, info.num_heads, info.head_dim), dtype=np.float32)
            w = rng.standard_normal((1, info.num_heads), dtype=np.float32)
            c.decode_step(0, [di.SequenceStep(seq)], q, w)
        text = scrape(port)
        families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        for name in sorted(named):
            family = name if name in families else re.sub(r"_(bucket|sum|count)$", "", name)
            with self.subTest(metric=name):
                self.assertIn(family, families, f"the rules use {name}; the server exports no "
                              f"{family}")
                if name != family:
                    self.assertEqual(families[family], "histogram", name)
        # The labels the rules group and match on.
        for metric, label in (("decode_indexer_step_latency_seconds_bucket", "kind"),
                              ("decode_indexer_cache_pages_in_use", "cache_layer"),
                              ("decode_indexer_cache_pages", "cache_layer"),
                              ("decode_indexer_rpcs_total", "code"),
                              ("decode_indexer_rpcs_total", "method"),
                              ("decode_indexer_step_graphs_total", "event")):
            with self.subTest(metric=metric, label=label):
                self.assertRegex(text, rf"(?m)^{metric}\{{[^}}]*\b{label}=\"")

    def test_flag_wins_over_environment(self):
        flag_port, env_port = _free_port(), _free_port()
        env = dict(os.environ, DI_METRICS_LISTEN=f"127.0.0.1:{env_port}")
        self.start(["--metrics-listen", f"127.0.0.1:{flag_port}"], env=env)
        self.assertIn("decode_indexer_healthy 1", scrape(flag_port))
        with self.assertRaises(OSError):
            scrape(env_port)
        # Without the flag the environment applies.
        env_only = _free_port()
        self.start([], env=dict(os.environ, DI_METRICS_LISTEN=f"127.0.0.1:{env_only}"))
        self.assertIn("decode_indexer_healthy 1", scrape(env_only))

    def test_metrics_auth_reuses_the_bearer_token(self):
        port = _free_port()
        token = os.urandom(8).hex()
        s = self.start(["--metrics-listen", f"127.0.0.1:{port}", "--metrics-auth"],
                       env=dict(os.environ, DI_AUTH_TOKEN=token))
        with self.assertRaises(urllib.error.HTTPError) as cm:
            scrape(port)
        self.assertEqual(cm.exception.code, 401)
        self.assertIn("decode_indexer_healthy 1",
                      scrape(port, {"Authorization": f"Bearer {token}"}))
        self.assertEqual(health(s.target, ""), SERVING)


class LogsAndHealthTest(BinaryTestCase):
    def test_json_logs_and_request_id(self):
        s = self.start(["--log-format", "json", "--log-level", "debug"])
        with grpc.insecure_channel(s.target) as ch:
            release = ch.unary_unary(f"/{SERVICE}/ReleaseSequence",
                                     request_serializer=None, response_deserializer=None)
            # ReleaseSequence{sequence_id: 12345} of a sequence that does not exist.
            with self.assertRaises(grpc.RpcError) as cm:
                release(b"\x08\xb9\x60", timeout=30, metadata=(("x-request-id", "rid-e2e-1"),))
            err = cm.exception
            self.assertEqual(err.code(), grpc.StatusCode.NOT_FOUND)
            echoed = dict(err.initial_metadata() or ()) | dict(err.trailing_metadata() or ())
            self.assertEqual(echoed.get("x-request-id"), "rid-e2e-1")
        s.stop(keep_log=True)
        lines = [json.loads(line) for line in s.log_tail(1 << 20).splitlines() if line.strip()]
        self.assertTrue(all({"time", "level", "message"} <= set(x) for x in lines), lines[:3])
        mine = [x for x in lines if x.get("request_id") == "rid-e2e-1"]
        self.assertTrue(mine, lines[-5:])
        self.assertIn("ReleaseSequence", mine[0]["message"])

    def test_health_by_name_and_drain_grace(self):
        s = self.start(["--drain-grace", "5", "--drain-timeout", "1"])
        self.assertEqual(health(s.target, ""), SERVING)
        self.assertEqual(health(s.target, SERVICE), SERVING)
        with self.assertRaises(grpc.RpcError) as cm:
            health(s.target, "no.such.Service")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        s.proc.send_signal(signal.SIGTERM)
        status = SERVING
        for _ in range(1000):
            status = health(s.target, SERVICE)
            if status != SERVING:
                break
            time.sleep(0.002)
        self.assertEqual(status, NOT_SERVING)
        self.assertEqual(health(s.target, ""), NOT_SERVING)
        # Still accepting calls during the grace window.
        with di.Client(s.target, timeout=30) as c:
            self.assertEqual(c.server_info().profile, "py-small")
        self.assertEqual(s.proc.wait(timeout=60), 0)


if __name__ == "__main__":
    unittest.main()
