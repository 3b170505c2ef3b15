"""Helpers for the daemon tests: a real `weightcache daemon` subprocess in its own process
group, its /metrics, /healthz and /readyz, the models file, `ls --json`, polling.

Every daemon started through the `daemons` fixture is SIGKILLed (whole process group) at
teardown if the test did not stop it, whatever the outcome of the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import BUCKET, CLI, Published, cli_env
from tests.support.checks import describe
from weightcache.ops.devstore import free_port

MiB = 1024 * 1024

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name' or 'name{labels}': value} (labels as exposed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_for(
    what: str, predicate: Callable[[], Any], timeout: float = 30.0, every: float = 0.1
) -> Any:
    """Poll `predicate` until it returns something truthy; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass
class DaemonProc:
    """A `weightcache daemon` started in a new session (so its whole group can be killed)."""

    proc: subprocess.Popen[bytes]
    cache_dir: Path
    models_file: Path
    pods_dir: Path
    port: int
    stderr_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 3.0) -> tuple[int, str]:
        """(status, body) of GET path; (0, error) if nothing answered."""
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            return 0, str(e)

    def metrics(self) -> dict[str, float]:
        status, body = self.get("/metrics")
        assert status == 200, f"/metrics answered {status}: {body}\n{self.log()}"
        return parse_metrics(body)

    def pins_ready(self) -> bool:
        """Every pinned revision of the models file is ready, as the daemon exports it
        (`weightcache_revision_ready{pinned="true"}`; /readyz does not wait for pins)."""
        series = "weightcache_revision_ready{"
        pinned = [
            v for k, v in self.metrics().items() if k.startswith(series) and 'pinned="true"' in k
        ]
        return bool(pinned) and all(v == 1 for v in pinned)

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Until /healthz answers (the fetch socket is up before the HTTP server)."""

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited {self.proc.returncode}\n{self.log()}")
            return self.get("/healthz", timeout=1.0)[0] == 200

        wait_for("the daemon's /healthz", up, timeout=timeout)

    def log(self) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "--- daemon stderr (tail) ---\n" + text[-6000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM to the daemon itself (as the kubelet does to PID 1 of a container)."""
        self.proc.send_signal(signal.SIGTERM)

    def kill9(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


class Daemons:
    """Starts daemons for one test and kills whatever is left at teardown."""

    def __init__(self, store: Any, tmp_path: Path) -> None:
        self.store = store
        self.tmp_path = tmp_path
        self.started: list[DaemonProc] = []

    def start(
        self,
        cache_dir: Path,
        models_file: Path,
        *,
        endpoint: str,
        capacity: str = "10G",
        pods_dir: Path | None = None,
        extra: Sequence[str] = (),
        wait: bool = True,
        env: Mapping[str, str | None] | None = None,
        allow_source: Sequence[str] = (f"s3://{BUCKET}",),
    ) -> DaemonProc:
        """Start a daemon; by default it fetches for Pods anything in the test bucket
        (`allow_source=()` leaves the daemon's own default: the models file's prefixes)."""
        if pods_dir is None:
            pods_dir = self.tmp_path / "pods"
        pods_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        args = [
            "daemon", "--cache-dir", str(cache_dir), "--models", str(models_file),
            "--capacity", capacity, "--metrics-addr", f"127.0.0.1:{port}",
            "--kubelet-pods-dir", str(pods_dir), "--interval", "0.5s",
            "--endpoint-url", endpoint,
            # no free-space floor unless a test sets one (in `extra`, which comes after): the
            # default, 20% of the disk /tmp is on, made every download exit 5 on a fuller disk
            "--min-free", "0", *extra,
        ]  # fmt: skip
        for prefix in allow_source:
            args += ["--allow-source", prefix]
        logs = self.tmp_path / "logs"
        logs.mkdir(exist_ok=True)
        n = len(self.started) + 1
        stderr_path = logs / f"daemon{n}.stderr"
        with open(logs / f"daemon{n}.stdout", "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache", *args],
                env=cli_env(self.store, {"AWS_ENDPOINT_URL": endpoint, **(env or {})}),
                cwd=self.tmp_path,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        daemon = DaemonProc(proc, cache_dir, models_file, pods_dir, port, stderr_path, args)
        self.started.append(daemon)
        if wait:
            daemon.wait_serving()
        return daemon

    def kill_all(self) -> None:
        for d in self.started:
            if d.alive():
                d.signal_group(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.proc.wait(timeout=30)


@pytest.fixture
def daemons(store: Any, tmp_path: Path) -> Iterator[Daemons]:
    d = Daemons(store, tmp_path)
    try:
        yield d
    finally:
        d.kill_all()


def write_models(path: Path, entries: Sequence[dict[str, Any] | Published]) -> Path:
    """Write a models file atomically (as a ConfigMap update appears: all at once)."""
    models = []
    for e in entries:
        models.append({"source": e.source} if isinstance(e, Published) else e)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump({"models": models}, sort_keys=False))
    os.replace(tmp, path)
    return path


def entry(pub: Published, pin: bool = False) -> dict[str, Any]:
    return {"source": pub.source, "pin": pin}


def ls_json(wc: CLI, cache_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """`weightcache ls --json`, keyed by (name, revision)."""
    proc = wc.run("ls", "--json", "--cache-dir", cache_dir)
    assert proc.returncode == 0, describe(proc)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {(r["name"], r["revision"]): r for r in rows}


def is_marked(cache_dir: Path, pub: Published) -> bool:
    return (pub.local_path(cache_dir) / ".weightcache").is_file()
