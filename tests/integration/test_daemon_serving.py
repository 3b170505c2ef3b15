"""The daemon's listeners against clients that misbehave (design §5):
idle floods of the metrics port and the fetch socket, malformed requests on the socket,
a second daemon on the same cache dir, a metrics port already taken, SIGTERM while Pods
wait. Real daemons, real sockets, the real store."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    DaemonProc,
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    entry,
    is_marked,
    wait_for,
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy

REPLICAS = "weightcache_replica_fetches_inflight"
MISSES = 'weightcache_fetches_total{result="miss"}'
HITS = 'weightcache_fetches_total{result="hit"}'
FLOOD = 1100  # more than the 1024 fds a container gets by default


def sock_path(cache_dir: Path) -> Path:
    return cache_dir / ".weightcache" / "daemon.sock"


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def nofile(limit: int) -> Iterator[None]:
    """This test process may hold `limit` fds (the floods need ~2,300)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {limit}: run the tests as root")
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_idle(connect: Callable[[], socket.socket], count: int) -> list[socket.socket]:
    """`count` connections that never send a byte (connects that fail are skipped)."""
    opened = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            opened.append(connect())
    return opened


def unix_connect(path: Path) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            s.close()
            raise
        return s

    return connect


def ask(path: Path, payload: bytes, timeout: float = 10.0) -> list[dict[str, object]]:
    """Send raw bytes on the fetch socket; the JSON lines it answers before closing."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        with contextlib.suppress(OSError):  # the daemon may close before reading it all
            s.sendall(payload)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


# -- item 10: floods of idle connections -------------------------------------------------------


@pytest.mark.timeout(240)
def test_idle_floods_of_the_metrics_port_and_the_socket_leave_the_daemon_serving(
    wc: CLI, publish: Callable[..., Published], store: Any, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([2 * MiB], name="flood", rev="r1", seed="flood")
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url)
    # What a container gets by default, whatever the daemon raised its own limit to.
    resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    with nofile(2 * FLOOD + 500):
        idle_socket = open_idle(unix_connect(sock_path(cache_dir)), FLOOD)
        idle_http = open_idle(
            lambda: socket.create_connection(("127.0.0.1", daemon.port), timeout=1.0), FLOOD
        )
        try:
            print(f"opened {len(idle_socket)} socket and {len(idle_http)} HTTP connections")
            assert daemon.alive(), daemon.log()
            assert daemon.get("/healthz", timeout=10)[0] == 200, daemon.log()
            proc = wc.fetch(pub.source, cache_dir, endpoint=store.endpoint_url)
            assert_ok_path(proc, pub.local_path(cache_dir))
            assert "fetching alone" not in proc.stderr, describe(proc)
            assert daemon.metrics()[MISSES] == 1, "the fetch did not go through the daemon"
            fds = fd_count(daemon.proc.pid)
            assert fds < 700, f"the daemon holds {fds} fds with {FLOOD} idle clients per port"
        finally:
            for s in idle_socket + idle_http:
                s.close()
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert daemon.alive(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()


# -- item 16: malformed requests on the socket ---------------------------------------------------

UID = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
BAD_REQUESTS = {
    "name is a number": b'{"op": "fetch", "source": "s3://models/x/m/r1", "name": 5}\n',
    "deep JSON": b"[" * 50_000 + b"\n",
    "not JSON": b"GET / HTTP/1.1\n",
    "not UTF-8": b"\xff\xfe\xfd\n",
    "a JSON list": b'["fetch"]\n',
    "no source": b'{"op": "fetch", "name": "m", "revision": "r1"}\n',
    "unknown op": b'{"op": "rm -rf", "source": "s3://models/x/m/r1"}\n',
    "pod_uid escapes": b'{"op": "fetch", "source": "s3://models/x/m/r1", "pod_uid": "../../.."}\n',
    "pod_uid 300 bytes": b'{"op": "fetch", "source": "s3://models/x/m/r1", "pod_uid": "'
    + b"a" * 300
    + b'"}\n',
    "huge line": b"{" + b" " * 200_000 + b"}\n",
}


@pytest.mark.timeout(150)
def test_malformed_socket_requests_are_one_warning_and_an_error_event(
    wc: CLI, publish: Callable[..., Published], store: Any, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB], name="sane", rev="r1", seed="sane")
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url)
    path = sock_path(cache_dir)
    for what, payload in BAD_REQUESTS.items():
        answers = ask(path, payload)
        assert len(answers) == 1, (what, answers, daemon.log())
        event = answers[0]
        assert event["event"] == "error" and event["exit_code"] == 2, (what, event)
        assert "bad request" in str(event["message"]), (what, event)
    # A connection that never finishes its request line is closed, without an answer.
    started = time.monotonic()
    assert ask(path, b'{"op": "fetch"', timeout=30) == []
    assert time.monotonic() - started < 20, "a half request held its connection"

    log = daemon.log()
    assert "Traceback" not in log, log
    warnings = [line for line in log.splitlines() if "bad request" in line]
    assert len(warnings) == len(BAD_REQUESTS), "\n".join(warnings)
    assert any("pod_uid" in w for w in warnings) and any("nested" in w for w in warnings), log
    assert daemon.alive() and daemon.get("/healthz")[0] == 200, log
    # A valid Pod UID is accepted: the daemon fetches for it.
    proc = wc.fetch(pub.source, cache_dir, endpoint=store.endpoint_url, env={"POD_UID": UID})
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert daemon.metrics()[MISSES] == 1, describe(proc)


# -- item 9: SIGTERM while Pods wait --------------------------------------------------------------


@pytest.mark.timeout(150)
def test_sigterm_lets_waiting_fetches_fall_back_and_succeed(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([4 * MiB] * 2, name="rollout", rev="r1", seed="rollout")
    proxy.configure(rate_limit=1 * MiB)  # the daemon's download crawls: 8 s for 8 MiB
    # The daemon prefetches the revision and the Pods join that download: on SIGTERM the
    # daemon waits for its prefetch to wind down, which leaves time to answer the Pods.
    models = write_models(tmp_path / "models.yaml", [entry(pub, pin=True)])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, extra=["--part-size", "1M"])
    procs = [wc.fetch_popen(pub.source, cache_dir, endpoint=proxy.url) for _ in range(2)]
    wait_for("2 Pods waiting on the daemon", lambda: daemon.metrics()[REPLICAS] == 2,
             timeout=30, every=0.05)  # fmt: skip
    assert not is_marked(cache_dir, pub)
    daemon.terminate()
    assert daemon.wait(timeout=30) == 0, daemon.log()
    proxy.configure(rate_limit=None)  # the Pods, on their own now, get the store at full speed

    for r in [p.finish(timeout=60) for p in procs]:
        assert_ok_path(r, pub.local_path(cache_dir))
        assert "error" not in r.stderr.lower(), describe(r)
    assert not sock_path(cache_dir).exists(), "a stopped daemon left its socket"
    assert markers(cache_dir) == [pub.local_path(cache_dir) / ".weightcache"]
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_blobs_valid(cache_dir)


# -- item 11: one daemon per cache dir; the metrics port taken ------------------------------------


def start_second(daemons: Daemons, first: DaemonProc, endpoint: str) -> DaemonProc:  # noqa: F811
    return daemons.start(first.cache_dir, first.models_file, endpoint=endpoint, wait=False)


@pytest.mark.timeout(150)
def test_a_second_daemon_on_the_cache_dir_exits_2_and_leaves_the_first_serving(
    wc: CLI, publish: Callable[..., Published], store: Any, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB], name="solo", rev="r1", seed="solo")
    endpoint = store.endpoint_url
    models = write_models(tmp_path / "models.yaml", [])
    first = daemons.start(cache_dir, models, endpoint=endpoint)
    inode = sock_path(cache_dir).stat().st_ino

    second = start_second(daemons, first, endpoint)
    assert second.wait(timeout=60) == 2, second.log()
    text = second.stderr_path.read_text()
    errors = [line for line in text.splitlines() if line.startswith("weightcache: error:")]
    assert len(errors) == 1 and "Traceback" not in text, text
    assert f"pid {first.proc.pid}" in errors[0] and "another" in errors[0], errors[0]

    # The first daemon keeps its socket and serves fetches through it.
    assert sock_path(cache_dir).stat().st_ino == inode
    proc = wc.fetch(pub.source, cache_dir, endpoint=endpoint)
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert first.metrics()[MISSES] == 1, describe(proc)

    # Once the first one stops, the cache dir is free for a new daemon.
    first.terminate()
    assert first.wait(timeout=30) == 0, first.log()
    third = daemons.start(cache_dir, models, endpoint=endpoint)
    assert third.alive() and sock_path(cache_dir).exists()


@pytest.mark.timeout(60)
def test_the_metrics_port_in_use_is_one_line_and_exit_2(
    wc: CLI, cache_dir: Path, tmp_path: Path
) -> None:
    models = write_models(tmp_path / "models.yaml", [])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = wc.run("daemon", "--cache-dir", cache_dir, "--models", models, "--capacity",
                      "1G", "--metrics-addr", f"127.0.0.1:{port}", timeout=30)  # fmt: skip
    message = assert_fails(proc, 2)
    assert f"127.0.0.1:{port}" in message and "--metrics-addr" in message, message
    assert not sock_path(cache_dir).exists()


@pytest.mark.timeout(90)
def test_metrics_serve_on_a_bracketed_ipv6_address(
    store: Any, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """--metrics-addr takes [v6]:port as --peer-addr and --peers do (one parser)."""
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url, wait=False,
                           extra=["--metrics-addr", f"[::1]:{port}"])  # fmt: skip
    daemon_v6 = f"http://[::1]:{port}"

    def healthy() -> bool:
        assert daemon.alive(), daemon.log()
        try:
            with urllib.request.urlopen(daemon_v6 + "/healthz", timeout=1.0) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    wait_for("/healthz on [::1]", healthy, timeout=30)


@pytest.mark.timeout(120)
def test_a_cache_dir_too_deep_for_a_socket_path_still_serves_pods(
    wc: CLI, publish: Callable[..., Published], store: Any, tmp_path: Path,
    daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Local NVMe mounted deep: the socket's path is longer than a Unix socket's address
    may be (107 bytes). The daemon still listens and Pods still reach it (through their
    directory's descriptor), for a miss and for a hit."""
    cache_dir = tmp_path / ("nvme-" + "x" * 60) / ("models-" + "y" * 40) / "cache"
    cache_dir.mkdir(parents=True)
    assert len(os.fsencode(sock_path(cache_dir))) > 107
    pub = publish([1 * MiB], name="deep", rev="r1", seed="deep")
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url)
    miss = wc.fetch(pub.source, cache_dir, endpoint=store.endpoint_url)
    assert_ok_path(miss, pub.local_path(cache_dir))
    assert "fetching alone" not in miss.stderr, describe(miss)
    hit = wc.fetch(pub.source, cache_dir, endpoint=store.endpoint_url)
    assert_ok_path(hit, pub.local_path(cache_dir))

    def counted() -> dict[str, float] | None:
        m = daemon.metrics()
        return m if m[MISSES] == 1 and m[HITS] == 1 else None

    wait_for("the miss and the hit counted by the daemon", counted, 10)
