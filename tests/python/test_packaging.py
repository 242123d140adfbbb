"""The Python package ships its generated modules: they match the proto (regenerated here and
compared), and `pip install ./client/python` works offline without any protoc on PATH."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "client" / "python"
GEN = PACKAGE / "decode_indexer" / "_gen"
PROTO_ROOT = REPO / "proto"
PROTO = PROTO_ROOT / "decode_indexer" / "v1" / "indexer.proto"
REGENERATE = "python3 -m decode_indexer._generate (in client/python), then commit _gen/"


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "_di_generate_under_test", PACKAGE / "decode_indexer" / "_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serialized_descriptor(pb2_source: str) -> bytes:
    """The FileDescriptorProto a generated module registers: the same for any protoc version
    that compiles the same proto."""
    m = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2_source, re.S)
    if m is None:
        raise AssertionError("no AddSerializedFile(...) in the generated module")
    return eval(m.group(1))  # a bytes literal written by protoc


class GeneratedModulesTest(unittest.TestCase):
    def test_stamp_matches_the_proto(self):
        stamp = (GEN / "indexer.proto.sha256").read_text().strip()
        self.assertEqual(stamp, hashlib.sha256(PROTO.read_bytes()).hexdigest(),
                         f"the proto changed since the modules were generated: {REGENERATE}")

    def test_modules_match_a_fresh_generation(self):
        gen = _load_generator()
        if not gen.have_generator():
            self.skipTest("neither protoc nor grpcio-tools is installed")
        with tempfile.TemporaryDirectory(prefix="di_gen_check_") as tmp:
            gen.generate(PROTO_ROOT, Path(tmp))
            fresh = (Path(tmp) / "indexer_pb2.py").read_text()
            shipped = (GEN / "indexer_pb2.py").read_text()
            self.assertEqual(_serialized_descriptor(shipped), _serialized_descriptor(fresh),
                             f"indexer_pb2.py is out of date: {REGENERATE}")
            fresh_grpc = Path(tmp) / "indexer_pb2_grpc.py"
            if fresh_grpc.is_file():
                # Every RPC of the service has its stub method in the shipped module.
                methods = set(re.findall(r"'/decode_indexer\.v1\.DecodeIndexer/(\w+)'",
                                         fresh_grpc.read_text()))
                shipped_grpc = (GEN / "indexer_pb2_grpc.py").read_text()
                self.assertTrue(methods)
                for name in sorted(methods):
                    self.assertIn(f"'/decode_indexer.v1.DecodeIndexer/{name}'", shipped_grpc,
                                  f"indexer_pb2_grpc.py lacks {name}: {REGENERATE}")


class OfflineInstallTest(unittest.TestCase):
    def test_pip_install_without_protoc(self):
        if importlib.util.find_spec("pip") is None:
            self.skipTest("pip is not installed (Debian: python3-pip)")
        with tempfile.TemporaryDirectory(prefix="di_pip_") as tmp:
            src = Path(tmp) / "src"
            # A copy, so that the in-tree build leaves the checkout clean.
            shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns(
                "build", "*.egg-info", "__pycache__", "proto"))
            target = Path(tmp) / "site"
            # No protoc, no grpc_python_plugin, no grpcio-tools: PATH names an empty folder.
            empty = Path(tmp) / "empty-bin"
            empty.mkdir()
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DI_PROTO_ROOT")}
            env["PATH"] = str(empty)
            env["DI_PROTO_ROOT"] = str(PROTO_ROOT)
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                 "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
                env=env, capture_output=True, text=True, cwd=tmp)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            for name in ("indexer_pb2.py", "indexer_pb2_grpc.py", "indexer.proto.sha256"):
                self.assertTrue((target / "decode_indexer" / "_gen" / name).is_file(), name)
            env.pop("DI_PROTO_ROOT")
            env["PYTHONPATH"] = str(target)
            probe = ("import decode_indexer as di, sys; "
                     "from decode_indexer._gen import indexer_pb2, indexer_pb2_grpc; "
                     "assert di.__file__.startswith(sys.argv[1]), di.__file__; "
                     "print(indexer_pb2.DecodeStepRequest.DESCRIPTOR.full_name)")
            done = subprocess.run([sys.executable, "-c", probe, str(target)], env=env,
                                  capture_output=True, text=True, cwd=tmp)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            self.assertEqual(done.stdout.strip(), "decode_indexer.v1.DecodeStepRequest")


if __name__ == "__main__":
    unittest.main()
