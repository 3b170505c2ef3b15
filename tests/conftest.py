"""Shared fixtures: one SeaweedFS for the session, the real CLI as a subprocess, a fault
proxy in front of the store, fresh cache directories and unique model prefixes per test.

Every server binds 127.0.0.1 and is stopped at the end. Integration tests share one store,
so each test publishes under its own prefix (`s3://models/<test>-<uuid>/...`).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.faultproxy import FaultProxy
from tests.support.modelgen import MANIFEST, Model, make_model

BUCKET = "models"
REPO_ROOT = Path(__file__).resolve().parent.parent


# --- the object store ------------------------------------------------------------------


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A `weed mini` on loopback with the bucket "models", for the whole session."""
    from weightcache.ops.devstore import DevStore

    local = DevStore(tmp_path_factory.mktemp("seaweedfs"))
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def s3(store: Any) -> Any:
    """A boto3 S3 client talking to the store directly (no proxy).

    Without `Expect: 100-continue`, as weightcache's own client: with it, the put that
    follows an empty one on the same connection stalls for botocore's 60 s read timeout
    (see `without_expect_continue`). It sends no checksum unless one is asked for (boto3
    adds crc32 to every upload by default, and the store would then vouch for the content
    of a prefix without SHA256SUMS: design §4, Verification without SHA256SUMS)."""
    import boto3
    from botocore.config import Config

    from weightcache.transfer.backends.s3.transport import without_expect_continue

    env = store.env
    client = boto3.client(
        "s3",
        endpoint_url=store.endpoint_url,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
        config=Config(request_checksum_calculation="when_required"),
    )
    return without_expect_continue(client)


@pytest.fixture
def proxy(store: Any, request: pytest.FixtureRequest) -> Iterator[FaultProxy]:
    """A fault proxy in front of the store, seeded by the test's name, no faults set."""
    with FaultProxy(store.endpoint_url, seed=request.node.nodeid) as p:
        yield p


def dead_endpoint() -> str:
    """An http:// URL on a loopback port where nothing listens (connections refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- the other schemes' servers (gs://, az://) -----------------------------------------


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """fake-gcs-server (tests/support/gcsemu.py) with the bucket "models", for the session."""
    from tests.support.gcsemu import FakeGcs

    with FakeGcs(tmp_path_factory.mktemp("gcs")) as server:
        server.fs().mkdir(BUCKET)
        yield server


@pytest.fixture(scope="session")
def moto(store: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """moto's S3 server (tests/support/motoserver.py) with the bucket "models", for the
    session; the `store`'s credentials work on it (moto takes any)."""
    from tests.support.motoserver import MotoServer

    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        server.client(store.env).create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One azurite-blob (tests/support/azurite.py) for the session, with the container
    "models"; skips when Azurite is not installed (.ci/run installs it from npm)."""
    from tests.support.azurite import Azurite, find_binary

    binary = find_binary()
    if binary is None:
        pytest.skip("azurite-blob not installed (.ci/run installs it under /opt/azurite)")
    server = Azurite(binary, tmp_path_factory.mktemp("azurite") / "data")
    server.start()
    try:
        server.service().create_container(BUCKET)
        yield server
    finally:
        server.stop()


# --- per-test names and directories ----------------------------------------------------


@pytest.fixture
def uniq(request: pytest.FixtureRequest) -> str:
    """A prefix segment unique to this test run: `<test name>-<8 hex>`."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A fresh cache directory (not created: the CLI must create it)."""
    return tmp_path / "cache"


@dataclass(frozen=True)
class Published:
    """A model uploaded to the store and where `fetch` will put it."""

    model: Model
    bucket: str
    prefix: str  # key prefix without trailing slash, e.g. "t-1234/m/r1"
    name: str
    rev: str

    @property
    def source(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}"

    def local_path(self, cache_dir: Path) -> Path:
        return cache_dir / self.name / self.rev


def upload_dir(s3: Any, root: Path, bucket: str, prefix: str) -> None:
    """Upload every regular file under `root` to `bucket/prefix/<relpath>` with boto3."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


def put_objects(s3: Any, bucket: str, prefix: str, objects: Mapping[str, bytes | str]) -> None:
    """Put literal objects at `bucket/prefix/<relpath>`."""
    for relpath, body in objects.items():
        data = body.encode() if isinstance(body, str) else body
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{relpath}", Body=data)


@pytest.fixture
def publish(s3: Any, uniq: str, tmp_path: Path) -> Callable[..., Published]:
    """`publish(shard_sizes, name="m", rev="r1", **make_model_kwargs) -> Published`.

    Writes a model under tmp_path/src/<name>/<rev>, uploads it with boto3 (not through
    weightcache, so the fetch tests don't depend on `publish`) to
    s3://models/<uniq>/<name>/<rev>/ with its SHA256SUMS.
    """

    def _publish(
        shard_sizes: Sequence[int], *, name: str = "m", rev: str = "r1", **kwargs: Any
    ) -> Published:
        root = tmp_path / "src" / name / rev
        model = make_model(root, shard_sizes, **kwargs)
        prefix = f"{uniq}/{name}/{rev}"
        upload_dir(s3, root, BUCKET, prefix)
        return Published(model, BUCKET, prefix, name, rev)

    return _publish


# --- running the CLI -------------------------------------------------------------------


def cli_env(store: Any, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """os.environ + the store's credentials and endpoint, isolated from the host's AWS
    config and from any WEIGHTCACHE_* set outside; `None` in `overrides` unsets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")}
    env.update(store.env)
    env.update(
        AWS_CONFIG_FILE="/nonexistent/aws-config",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials",
        AWS_EC2_METADATA_DISABLED="true",
        PYTHONDONTWRITEBYTECODE="1",
    )
    for k, v in (overrides or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@dataclass
class Running:
    """A CLI process started with `CLI.popen`."""

    proc: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill9(self) -> int:
        """SIGKILL and reap; returns the exit status (negative: killed by that signal)."""
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=30)

    def sigterm(self, timeout: float = 90) -> tuple[subprocess.CompletedProcess[str], float]:
        """SIGTERM (as the kubelet sends), then `finish`: its outputs and the seconds it
        took to exit."""
        self.proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        done = self.finish(timeout)
        return done, time.monotonic() - began

    def finish(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Wait for exit (killing it on timeout) and return its outputs."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise
        return subprocess.CompletedProcess(
            self.proc.args,
            self.proc.returncode,
            self.stdout_path.read_text(errors="replace"),
            self.stderr_path.read_text(errors="replace"),
        )


class CLI:
    """Runs `python -m weightcache ...` as a real subprocess against the store."""

    def __init__(self, store: Any, cwd: Path) -> None:
        self.store = store
        self.cwd = cwd
        self._started = 0
        self.running: list[Running] = []

    def argv(self, *args: str | os.PathLike[str]) -> list[str]:
        return [sys.executable, "-m", "weightcache", *map(str, args)]

    def run(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str | None] | None = None,
        timeout: float = 120,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run to completion; stdout/stderr captured as text; never raises on exit code."""
        return subprocess.run(
            self.argv(*args),
            env=cli_env(self.store, env),
            cwd=cwd or self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def popen(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
    ) -> Running:
        """Start without waiting (for concurrency and kill -9 tests). Output goes to files,
        not pipes, so a chatty process never blocks on a pipe nobody reads."""
        self._started += 1
        logs = self.cwd.parent / "logs"
        logs.mkdir(exist_ok=True)
        out = logs / f"{self._started}.stdout"
        err = logs / f"{self._started}.stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(
                self.argv(*args),
                env=cli_env(self.store, env),
                cwd=cwd or self.cwd,
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
            )
        running = Running(proc, out, err)
        self.running.append(running)
        return running

    def kill_leftovers(self) -> None:
        """SIGKILL processes this test started and left running (after a failure)."""
        for r in self.running:
            if r.poll() is None:
                r.kill9()

    def fetch(
        self,
        source: str,
        cache_dir: Path,
        *extra: str | os.PathLike[str],
        endpoint: str | None = None,
        env: Mapping[str, str | None] | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """`fetch SOURCE --cache-dir DIR [--endpoint-url E] ...`; with `endpoint`, the
        AWS_ENDPOINT_URL in the environment points there too, so nothing reaches the store
        another way."""
        return self.run(*self.fetch_args(source, cache_dir, *extra, endpoint=endpoint),
                        env=_with_endpoint(env, endpoint), timeout=timeout)  # fmt: skip

    def fetch_popen(
        self,
        source: str,
        cache_dir: Path,
        *extra: str | os.PathLike[str],
        endpoint: str | None = None,
        env: Mapping[str, str | None] | None = None,
    ) -> Running:
        return self.popen(*self.fetch_args(source, cache_dir, *extra, endpoint=endpoint),
                          env=_with_endpoint(env, endpoint))  # fmt: skip

    @staticmethod
    def fetch_args(
        source: str, cache_dir: Path, *extra: str | os.PathLike[str], endpoint: str | None
    ) -> list[str | os.PathLike[str]]:
        args: list[str | os.PathLike[str]] = ["fetch", source, "--cache-dir", cache_dir]
        if endpoint is not None:
            args += ["--endpoint-url", endpoint]
        return [*args, *extra]


def _with_endpoint(
    env: Mapping[str, str | None] | None, endpoint: str | None
) -> dict[str, str | None]:
    merged: dict[str, str | None] = {}
    if endpoint is not None:
        merged["AWS_ENDPOINT_URL"] = endpoint
    merged.update(env or {})
    return merged


@pytest.fixture
def wc(store: Any, tmp_path: Path) -> Iterator[CLI]:
    """The real CLI, run from an empty working directory under tmp_path."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    cli = CLI(store, cwd)
    yield cli
    cli.kill_leftovers()


__all__ = ["BUCKET", "CLI", "MANIFEST", "Published", "Running", "dead_endpoint", "put_objects"]
