"""moto's S3 server (`moto[server]`) on a free loopback port: a second S3 implementation
beside SeaweedFS, with its own answers (HeadObject gives a multipart upload's COMPOSITE
checksum without its "-<parts>" suffix and without a checksum type)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class MotoServer:
    """One `python -m moto.server` over HTTP; `url` is its S3 endpoint."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MotoServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = self.url.rpartition(":")[2]
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", port]
        with open(self.workdir / "server.log", "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_ready(60.0)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None and self._proc.poll() is None, "moto server died"
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.url}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def client(self, env: dict[str, str]) -> Any:
        """A boto3 S3 client with the credentials in `env` (moto takes any)."""
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.url, region_name=env["AWS_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
