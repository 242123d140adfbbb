"""The documentation's commands, run as written: the README's server command and every Python
snippet of the README (against that server), and docs/deploy.md's quick start (a server, the
health probe, a verified load run). The only change made to them is a free port in place of
50051 and the build folder this test was given in place of `build/`."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

from _support import REPO, _free_port, find_server_binary


def _commands(block: str) -> list[str]:
    """Shell lines of a block, continuations joined, comments and a trailing & dropped."""
    out, current = [], ""
    for line in block.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        current = re.sub(r"\s+#.*$", "", current).strip()
        out.append(current.rstrip("&").strip())
        current = ""
    return out


def _wait_port(port: int, proc: subprocess.Popen, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


class DocsTestCase(unittest.TestCase):
    def setUp(self) -> None:
        binary = find_server_binary()
        if binary is None:
            self.skipTest("no decode-indexer-server built (set DI_SERVER_BIN)")
        self.build = Path(binary).resolve().parents[1]
        self.procs: list[subprocess.Popen] = []
        self.log = tempfile.NamedTemporaryFile(prefix="di_docs_", suffix=".log", delete=False)

    def tearDown(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def argv(self, command: str, port: int) -> list[str]:
        command = command.replace("50051", str(port))
        argv = shlex.split(command)
        if argv[0].startswith("build/"):
            argv[0] = str(self.build / argv[0][len("build/"):])
        return argv

    def start_server(self, argv: list[str], port: int) -> None:
        proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        self.procs.append(proc)
        if not _wait_port(port, proc):
            self.fail(f"{' '.join(argv)} did not start:\n{Path(self.log.name).read_text()}")

    def server_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]


class ReadmeTest(DocsTestCase):
    def test_server_command_and_python_snippets(self):
        text = (REPO / "README.md").read_text()
        shell = [c for b in re.findall(r"```sh\n(.*?)```", text, re.S) for c in _commands(b)
                 if "decode-indexer-server --listen" in c]
        self.assertEqual(len(shell), 1, shell)
        port = _free_port()
        self.start_server(self.argv(shell[0].replace("0.0.0.0", "127.0.0.1"), port), port)
        snippets = re.findall(r"```python\n(.*?)```", text, re.S)
        self.assertTrue(snippets)
        env = dict(os.environ, DI_TARGET=f"127.0.0.1:{port}",
                   PYTHONPATH=str(REPO / "client" / "python"))
        for i, code in enumerate(snippets):
            done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=300)
            self.assertEqual(done.returncode, 0,
                             f"README snippet {i}:\n{code}\n{done.stdout}{done.stderr}\n"
                             f"{self.server_log()}")


class DeployGuideTest(DocsTestCase):
    def test_quick_start(self):
        text = (REPO / "docs" / "deploy.md").read_text()
        section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
        block = "\n".join(line[4:] for line in section.splitlines()
                          if line.startswith("    "))
        commands = _commands(block)
        self.assertEqual(len(commands), 3, commands)
        port = _free_port()
        self.start_server(self.argv(commands[0], port), port)
        for command in commands[1:]:
            argv = self.argv(command, port)
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
            self.assertEqual(done.returncode, 0,
                             f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}\n"
                             f"{self.server_log()}")


if __name__ == "__main__":
    unittest.main()
