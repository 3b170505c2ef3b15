"""moto's S3 server (`moto[server]`) on a free loopback port: a second S3 implementation
beside SeaweedFS, with its own answers (HeadObject gives a multipart upload's COMPOSITE
checksum without its "-<parts>" suffix and without a checksum type)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.support.serverproc import ServerProcess, free_port


class MotoServer:
    """One `python -m moto.server` over HTTP; `url` is its S3 endpoint."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = ServerProcess("moto server")

    def start(self) -> MotoServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._server.spawn(argv, self.workdir / "server.log", f"{self.url}/moto-api/data.json",
                           60.0)  # fmt: skip
        return self

    def stop(self) -> None:
        self._server.stop()

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
