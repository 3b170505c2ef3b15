"""Azurite (Microsoft's Azure Storage emulator, from npm) on loopback, for the az:// tests
and benchmarks/azure_source.py.

`.ci/run` installs it under /opt/azurite; AZURITE_BLOB names another `azurite-blob`.
Telemetry is off (Azurite otherwise reports to an Azure endpoint), the API version check is
skipped (the SDK from PyPI may be newer than the emulator) and unsupported headers ignored.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCOUNT = "devstoreaccount1"
#: Azurite's well-known development key (public, in Microsoft's documentation).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DEFAULT_BINARY = "/opt/azurite/node_modules/.bin/azurite-blob"


def find_binary() -> str | None:
    """The azurite-blob to run: $AZURITE_BLOB, /opt/azurite, or one on PATH."""
    for candidate in (os.environ.get("AZURITE_BLOB"), DEFAULT_BINARY, shutil.which("azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def connection_string(endpoint: str, key: str = KEY) -> str:
    """The connection string of the emulator's account at `endpoint` (http://host:port)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


@dataclass
class Azurite:
    """One azurite-blob process on a free loopback port, its data under `location`."""

    binary: str
    location: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connection_string(self) -> str:
        return connection_string(self.endpoint)

    def start(self, timeout: float = 60.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.location.mkdir(parents=True, exist_ok=True)
        log = open(self.location.parent / f"azurite-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
             "--location", str(self.location), "--skipApiVersionCheck", "--loose",
             "--silent", "--disableTelemetry"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite-blob exited {self.proc.returncode}; see {log.name}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"azurite-blob did not listen on {self.port} in {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def service(self) -> Any:
        """A synchronous BlobServiceClient of the emulator's account."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)


def upload_dir(container: Any, root: Path, prefix: str) -> None:
    """Upload every regular file under `root` to `prefix/<relpath>`; one of at most 64 MiB
    (the SDK's max_single_put_size) goes in one Put Blob, so Azure stores its Content-MD5."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                name = f"{prefix}/{path.relative_to(root).as_posix()}"
                container.upload_blob(name, f, overwrite=True, max_concurrency=1)
