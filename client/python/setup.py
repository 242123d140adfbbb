"""Build hook: generate the Protobuf/gRPC modules from proto/ before packaging them.

Everything else is in pyproject.toml. The generator is loaded by path, not imported through
the package, because the package's __init__ needs the very modules being generated.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _generator():
    spec = importlib.util.spec_from_file_location(
        "_decode_indexer_generate", HERE / "decode_indexer" / "_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def run(self):
        gen = _generator()
        root = gen.find_proto_root()
        shipped = (gen.GEN_DIR / "indexer_pb2.py").is_file()
        if root is None and not shipped:
            raise SystemExit(f"decode_indexer: {gen.PROTO_REL} not found; build from the "
                             "repository checkout or set DI_PROTO_ROOT")
        if root is not None:
            packaged = gen.PACKAGED_PROTO_ROOT / gen.PROTO_REL
            if root.resolve() != gen.PACKAGED_PROTO_ROOT.resolve():
                packaged.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / gen.PROTO_REL, packaged)
        # The generated modules are checked in: regenerate only where a generator exists
        # (no system protoc is needed to install the package).
        if root is not None and gen.have_generator():
            gen.generate(root)
        elif not gen.is_current(root):
            raise SystemExit("decode_indexer: the shipped modules do not match the proto and no "
                             "protoc / grpcio-tools is available to regenerate them")
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
