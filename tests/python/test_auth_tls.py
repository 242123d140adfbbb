"""The client against a protected server: a bearer token (given, or read from a file), TLS with
the server verified against a CA, and mutual TLS with a client certificate (certificates made
by the openssl CLI, as tests/service/ops_test.cc makes them), synchronous and asyncio, the
columnar step included. A client without the token (or the certificate) is refused."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path

import grpc
import numpy as np
from _support import ServerTestCase

import decode_indexer as di

SMALL_PROFILE = str(Path(__file__).resolve().parent / "profiles" / "py-small.json")


def make_certificates(d: str) -> None:
    """ca.pem, server.pem/.key (localhost, 127.0.0.1), client.pem/.key, other-ca.pem."""
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    script = (
        f"openssl req -x509 {ec} -keyout ca.key -out ca.pem -days 2 -subj /CN=di-py-ca && "
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext && "
        f"openssl req {ec} -keyout server.key -out server.csr -subj /CN=localhost && "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext && "
        f"openssl req {ec} -keyout client.key -out client.csr -subj /CN=di-py-client && "
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2 && "
        f"openssl req -x509 {ec} -keyout other-ca.key -out other-ca.pem -days 2 "
        "-subj /CN=di-py-other-ca")
    subprocess.run(["sh", "-c", script], cwd=d, check=True, capture_output=True)


class ProtectedServerTests:
    """Mixed into a ServerTestCase whose server demands what CLIENT_KWARGS gives."""

    def one_step(self, client: di.Client) -> np.ndarray:
        """A columnar step on a fresh sequence; answers its top-k."""
        layer = next(l for l in self.info.layers if l.role == "dense")
        seq = client.create_sequence(self.new_id())
        client.append_keys(seq, layer.layer, self.keys(100))
        r = client.decode_step_columnar(layer.layer, [seq], self.q(1), self.weights(1),
                                        new_keys=self.keys(1))
        self.assertEqual(r.lengths.tolist(), [101])
        with client.stream(route_sequence_id=seq) as s:
            s.send_columnar(layer.layer, [seq], self.q(1), self.weights(1), new_keys=self.keys(1))
            self.assertEqual(s.recv().lengths.tolist(), [102])
        client.release_sequence(seq)
        return r.topk

    def expect_refused(self, client_kwargs: dict, codes: tuple) -> None:
        with di.Client(self.server.target, timeout=20, **client_kwargs) as c:
            with self.assertRaises(di.IndexerError) as e:
                c.server_info()
            self.assertIn(e.exception.code, codes, e.exception)
            with self.assertRaises(di.IndexerError) as e:
                c.decode_step_columnar(0, [1], self.q(1), self.weights(1))
            self.assertIn(e.exception.code, codes, e.exception)

    def test_the_protected_server_serves_its_client(self):
        self.assertEqual(self.one_step(self.client).shape, (1, self.info.topk))

    def test_asyncio_client_reaches_it(self):
        async def run():
            async with di.AsyncClient(self.server.target, timeout=30,
                                      **self.CLIENT_KWARGS) as c:
                info = await c.server_info()
                seq = await c.create_sequence(self.new_id())
                await c.append_keys(seq, 0, self.keys(60))
                r = await c.decode_step_columnar(0, [seq], self.q(1), self.weights(1),
                                                 new_keys=self.keys(1))
                await c.release_sequence(seq)
                return info, r
        info, r = asyncio.run(run())
        self.assertEqual(info.topk, self.info.topk)
        self.assertEqual(r.lengths.tolist(), [61])


class TokenTest(ProtectedServerTests, ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 128

    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.mkdtemp(prefix="di-py-token-")
        cls.token = secrets.token_hex(24)
        cls.token_file = os.path.join(cls.dir, "token")
        Path(cls.token_file).write_text(cls.token + "\n")  # a trailing newline, as editors leave
        os.chmod(cls.token_file, 0o600)
        cls.SERVER_ARGS = ("--auth-token-file", cls.token_file)
        cls.CLIENT_KWARGS = {"token_file": cls.token_file}
        super().setUpClass()

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_a_client_without_the_right_token_is_refused(self):
        self.expect_refused({}, (grpc.StatusCode.UNAUTHENTICATED,))
        self.expect_refused({"token": "not-" + self.token}, (grpc.StatusCode.UNAUTHENTICATED,))

    def test_the_token_given_directly(self):
        with di.Client(self.server.target, timeout=30, token=self.token) as c:
            self.one_step(c)

    def test_asyncio_without_the_token_is_refused(self):
        async def run():
            async with di.AsyncClient(self.server.target, timeout=20) as c:
                await c.decode_step_columnar(0, [1], self.q(1), self.weights(1))
        with self.assertRaises(di.IndexerError) as e:
            asyncio.run(run())
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)

    def test_token_options_are_checked(self):
        empty = os.path.join(self.dir, "empty")
        Path(empty).write_text("\n")
        with self.assertRaises(ValueError):
            di.Client(self.server.target, token_file=empty)
        with self.assertRaises(ValueError):
            di.Client(self.server.target, token="a", token_file=self.token_file)
        with self.assertRaises(ValueError):
            di.Client(self.server.target, token="two\nlines")
        with self.assertRaises(FileNotFoundError):
            di.Client(self.server.target, token_file=os.path.join(self.dir, "missing"))


def _have_openssl() -> bool:
    return shutil.which("openssl") is not None


@unittest.skipUnless(_have_openssl(), "the openssl CLI is not installed (TLS tests)")
class TlsTest(ProtectedServerTests, ServerTestCase):
    PROFILE = SMALL_PROFILE
    CACHE_PAGES = 128
    MUTUAL = False

    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.mkdtemp(prefix="di-py-tls-")
        make_certificates(cls.dir)
        args = ["--tls-cert", cls.path("server.pem"), "--tls-key", cls.path("server.key")]
        cls.CLIENT_KWARGS = {"tls_ca": cls.path("ca.pem")}
        if cls.MUTUAL:
            args += ["--tls-client-ca", cls.path("ca.pem")]
            cls.CLIENT_KWARGS.update(tls_cert=cls.path("client.pem"),
                                     tls_key=cls.path("client.key"))
        cls.SERVER_ARGS = tuple(args)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def path(cls, name: str) -> str:
        return os.path.join(cls.dir, name)

    def test_plaintext_and_unverified_servers_are_refused(self):
        self.expect_refused({}, (grpc.StatusCode.UNAVAILABLE,))
        self.expect_refused({**self.CLIENT_KWARGS, "tls_ca": self.path("other-ca.pem")},
                            (grpc.StatusCode.UNAVAILABLE,))

    def test_pem_bytes_and_a_server_name(self):
        kwargs = dict(self.CLIENT_KWARGS)
        kwargs["tls_ca"] = Path(self.path("ca.pem")).read_bytes()  # contents, not a path
        with di.Client(self.server.target, timeout=30, tls_server_name="localhost",
                       **kwargs) as c:
            self.one_step(c)

    def test_tls_options_are_checked(self):
        with self.assertRaises(ValueError):  # half a client certificate
            di.Client(self.server.target, tls_ca=self.path("ca.pem"),
                      tls_cert=self.path("client.pem"))
        with self.assertRaises(ValueError):  # a server name without TLS
            di.Client(self.server.target, tls_server_name="localhost")
        with self.assertRaises(TypeError):
            di.Client(self.server.target, tls_ca=42)


class MutualTlsTest(TlsTest):
    MUTUAL = True

    def test_a_client_without_a_certificate_is_refused(self):
        self.expect_refused({"tls_ca": self.path("ca.pem")}, (grpc.StatusCode.UNAVAILABLE,))


if __name__ == "__main__":
    unittest.main()
