"""A test server run as a child process on a free loopback port: started with its output
in a log file (a pipe nobody reads would fill and block it), waited for until a URL
answers, and stopped."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """One child process serving on loopback; `name` says which in errors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._proc: subprocess.Popen[bytes] | None = None

    def spawn(self, argv: list[str], log_path: Path, ready_url: str, timeout: float) -> None:
        """Start `argv`, its output to `log_path`; return once `ready_url` answers."""
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc.poll() is None, f"{self.name} died (see {log_path})"
            try:
                with urllib.request.urlopen(ready_url, timeout=2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on {ready_url}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
