"""Generates the Protobuf/gRPC modules of decode_indexer.v1 into decode_indexer/_gen/.

The generated modules are checked in (made by Debian 12's protoc 3.21.12 and
grpc_python_plugin 1.51), so `pip install ./client/python` needs no protoc. CI checks that they
match the proto (tests/python/test_packaging.py). They are remade:
  * by hand after changing the proto:  python3 -m decode_indexer._generate  (then commit them),
  * at package build time where a generator exists (setup.py; without one the committed
    modules are packaged as they are),
  * on import from a writable checkout when the proto changed and a generator exists.

Tools, first found wins: `protoc` + `grpc_python_plugin` on PATH (Debian's protobuf-compiler
and protobuf-compiler-grpc, which match Debian's python3-protobuf/python3-grpcio runtime),
else the `grpc_tools` package (pip's grpcio-tools). The gRPC plugin is optional: the client
builds its calls from the message classes alone; the stub module is generated for users who
want the plain generated API.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_REL = "decode_indexer/v1/indexer.proto"
GEN_DIR = Path(__file__).resolve().parent / "_gen"
# Where the build copies the proto inside the package, so an installed package can regenerate.
PACKAGED_PROTO_ROOT = GEN_DIR / "proto"
_STAMP = "indexer.proto.sha256"


class GenerateError(RuntimeError):
    pass


def find_proto_root() -> Path | None:
    """The directory holding decode_indexer/v1/indexer.proto: $DI_PROTO_ROOT, the repository
    (when running from a checkout), or the copy packaged at build time."""
    candidates = []
    if os.environ.get("DI_PROTO_ROOT"):
        candidates.append(Path(os.environ["DI_PROTO_ROOT"]))
    # client/python/decode_indexer/_generate.py -> repository root is parents[3].
    candidates.append(Path(__file__).resolve().parents[3] / "proto")
    candidates.append(PACKAGED_PROTO_ROOT)
    for root in candidates:
        if (root / PROTO_REL).is_file():
            return root
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_current(proto_root: Path | None = None, gen_dir: Path = GEN_DIR) -> bool:
    """Whether the generated message module exists and matches the proto (when one is found)."""
    if not (gen_dir / "indexer_pb2.py").is_file():
        return False
    proto_root = proto_root or find_proto_root()
    if proto_root is None:
        return True  # nothing to compare against: use what was generated at build time
    stamp = gen_dir / _STAMP
    return stamp.is_file() and stamp.read_text().strip() == _digest(proto_root / PROTO_REL)


def _protoc_command(proto_root: Path, out: Path) -> tuple[list[str], bool]:
    """The protoc invocation and whether it also generates the gRPC stub module."""
    proto = str(proto_root / PROTO_REL)
    base = [f"--proto_path={proto_root}", f"--python_out={out}"]
    protoc = shutil.which("protoc")
    if protoc:
        plugin = shutil.which("grpc_python_plugin") or (
            "/usr/bin/grpc_python_plugin" if os.path.exists("/usr/bin/grpc_python_plugin") else None
        )
        if plugin:
            return [protoc, *base, f"--grpc_python_out={out}",
                    f"--plugin=protoc-gen-grpc_python={plugin}", proto], True
    if importlib.util.find_spec("grpc_tools") is not None:  # pip's grpcio-tools: both tools
        return [sys.executable, "-m", "grpc_tools.protoc", *base, f"--grpc_python_out={out}",
                proto], True
    if protoc:
        return [protoc, *base, proto], False
    raise GenerateError(
        "decode_indexer: cannot generate the Protobuf modules: neither `protoc` "
        "(apt: protobuf-compiler protobuf-compiler-grpc) nor `grpcio-tools` (pip) is available")


def generate(proto_root: Path | None = None, gen_dir: Path = GEN_DIR) -> Path:
    """Runs protoc and installs indexer_pb2.py (and indexer_pb2_grpc.py) into gen_dir."""
    proto_root = proto_root or find_proto_root()
    if proto_root is None:
        raise GenerateError(f"decode_indexer: {PROTO_REL} not found (set DI_PROTO_ROOT)")
    gen_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="di_gen_") as tmp:
        out = Path(tmp)
        cmd, with_grpc = _protoc_command(proto_root, out)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise GenerateError(f"decode_indexer: {' '.join(cmd)} failed:\n{done.stderr}")
        src = out / "decode_indexer" / "v1"
        files = {"indexer_pb2.py": (src / "indexer_pb2.py").read_text()}
        if with_grpc:
            # The stub imports the messages by their proto path, which here is this package's
            # name; make it relative so it finds the sibling module.
            files["indexer_pb2_grpc.py"] = (src / "indexer_pb2_grpc.py").read_text().replace(
                "from decode_indexer.v1 import indexer_pb2", "from . import indexer_pb2")
        files[_STAMP] = _digest(proto_root / PROTO_REL) + "\n"
        # Write-then-rename, so concurrent importers never see a half-written module; the stamp
        # goes last so that it only ever vouches for complete modules.
        for name, text in files.items():
            tmp_path = gen_dir / f".{name}.{os.getpid()}.tmp"
            tmp_path.write_text(text)
            os.replace(tmp_path, gen_dir / name)
    return gen_dir


def have_generator() -> bool:
    """Whether protoc (or grpcio-tools) is available to regenerate the modules."""
    return shutil.which("protoc") is not None or importlib.util.find_spec("grpc_tools") is not None


def ensure_generated() -> None:
    """Called on import: regenerate when missing or stale, if the package dir is writable and a
    generator exists; otherwise use the modules that are there."""
    proto_root = find_proto_root()
    if is_current(proto_root):
        return
    present = (GEN_DIR / "indexer_pb2.py").is_file()
    if present and (not os.access(GEN_DIR, os.W_OK) or not have_generator()):
        return  # an installed copy, or no protoc: keep the modules that were shipped
    generate(proto_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto-root", type=Path, help=f"directory holding {PROTO_REL}")
    parser.add_argument("--out", type=Path, default=GEN_DIR, help="output directory")
    args = parser.parse_args(argv)
    try:
        print(generate(args.proto_root, args.out))
    except GenerateError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
