"""Coordinator and FetchSocketHandler in-process: the daemon's single-flight and its side
of the fetch socket, with a fake fetch function on a tmp cache dir (design §5)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cached import add_revision
from weightcache.cache.index import for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache
from weightcache.daemon.coordinator import Coordinator, FetchSocketHandler
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.models import DesiredState, ModelSpec
from weightcache.errors import NoSpaceError, UsageError
from weightcache.fetch import FetchResult
from weightcache.sourceurl import Source, SourcePrefix

POD = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
SOURCE = Source.parse("s3://models/m/r1")
WAIT = 30.0  # generous: the machine may be loaded


class FakeFetch:
    """A fetch function that makes the revision ready once `release` is set, counting calls."""

    def __init__(self, cache: Cache, assemble: bool = True) -> None:
        self.cache = cache
        self.assemble = assemble
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()

    def __call__(self, source: Source, pod_uid: str | None) -> FetchResult:
        with self._lock:
            self.calls.append((source.url, pod_uid))
        self.started.set()
        assert self.release.wait(WAIT), "the test never released the fetch"
        if self.assemble and self.cache.ready(source.name, source.revision) is None:
            add_revision(self.cache, source.name, source.revision, 10, source=source.url)
        return FetchResult(path=source.url, hit=False, bytes_from_origin=10, seconds=1.0)


@pytest.fixture
def cache(layout: Layout) -> Cache:
    return Cache(layout)


@pytest.fixture
def fake(cache: Cache) -> FakeFetch:
    return FakeFetch(cache)


@pytest.fixture
def coordinator(cache: Cache, fake: FakeFetch) -> Iterator[Coordinator]:
    c = Coordinator(fake, cache, for_cache(cache.layout), Metrics(), threading.Event())
    yield c
    fake.release.set()
    c.shutdown()


def sample(c: Coordinator, name: str, **labels: str) -> float:
    return c.metrics.registry.get_sample_value(name, labels) or 0.0


def test_two_requests_for_one_revision_share_one_fetch(
    coordinator: Coordinator, fake: FakeFetch
) -> None:
    first = coordinator.submit(SOURCE, POD)
    assert fake.started.wait(WAIT)
    second = coordinator.submit(SOURCE)
    assert second is first
    fake.release.set()
    assert first.result(WAIT) == second.result(WAIT)
    assert fake.calls == [(SOURCE.url, POD)]


def test_waiters_are_counted_one_fetch_each(coordinator: Coordinator, fake: FakeFetch) -> None:
    results: list[FetchResult] = []
    waiters = [
        threading.Thread(target=lambda: results.append(coordinator.wait(SOURCE))) for _ in range(3)
    ]
    for t in waiters:
        t.start()
    assert fake.started.wait(WAIT)
    fake.release.set()
    for t in waiters:
        t.join(WAIT)
    assert len(results) == 3 and len(fake.calls) == 1
    assert sample(coordinator, "weightcache_fetches_total", result="miss") == 3


def test_another_source_of_the_same_revision_is_another_fetch(
    coordinator: Coordinator, fake: FakeFetch
) -> None:
    other = Source.parse("s3://mirror/m/r1")
    fake.release.set()
    coordinator.submit(SOURCE).result(WAIT)
    coordinator.submit(other).result(WAIT)
    assert [url for url, _ in fake.calls] == [SOURCE.url, other.url]


def test_a_finished_fetch_is_not_joined_again(coordinator: Coordinator, fake: FakeFetch) -> None:
    fake.release.set()
    first = coordinator.submit(SOURCE)
    first.result(WAIT)
    deadline = time.monotonic() + WAIT  # its done-callback runs in the worker, just after
    while (again := coordinator.submit(SOURCE)) is first and time.monotonic() < deadline:
        time.sleep(0.01)
    again.result(WAIT)
    assert len(fake.calls) == 2


def test_the_lease_is_committed_before_the_fetch(coordinator: Coordinator, cache: Cache) -> None:
    coordinator.submit(SOURCE, POD)
    assert for_cache(cache.layout).lease_holders() == {POD}


def test_a_stopping_coordinator_starts_no_fetch(coordinator: Coordinator, fake: FakeFetch) -> None:
    coordinator.stopping.set()
    with pytest.raises(UsageError, match="shutting down"):
        coordinator.submit(SOURCE)
    assert fake.calls == []


def test_a_revision_evicted_as_it_became_ready_is_fetched_again_then_exit_5(
    cache: Cache,
) -> None:
    fake = FakeFetch(cache, assemble=False)  # "done", but never ready: evicted at once
    fake.release.set()
    c = Coordinator(fake, cache, for_cache(cache.layout), Metrics(), threading.Event())
    with pytest.raises(NoSpaceError, match="evicted three times"):
        c.wait(SOURCE)
    c.shutdown()
    assert len(fake.calls) == 3
    assert sample(c, "weightcache_fetches_total", result="error") == 1


def test_a_hit_is_counted_and_leased(coordinator: Coordinator, cache: Cache) -> None:
    add_revision(cache, "m", "r1", 10)
    coordinator.record_hit(SOURCE, POD)
    assert sample(coordinator, "weightcache_fetches_total", result="hit") == 1
    assert sample(coordinator, "weightcache_bytes_total", source="local") == 10
    assert for_cache(cache.layout).lease_holders() == {POD}


# -- the fetch socket's requests -----------------------------------------------------------


def handler(c: Coordinator, allow: tuple[SourcePrefix, ...] | None = None) -> FetchSocketHandler:
    desired = DesiredState((ModelSpec(SOURCE),))
    return FetchSocketHandler(c, allow, lambda: desired)


def line(source: str, op: str = "fetch") -> bytes:
    return json.dumps({"op": op, "source": source, "pod_uid": POD}).encode()


def events(sent: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in sent]


def test_a_fetch_request_is_accepted_and_answered(
    coordinator: Coordinator, fake: FakeFetch
) -> None:
    fake.release.set()
    sent: list[dict[str, Any]] = []
    handler(coordinator).handle_line(line(SOURCE.url), sent.append)
    assert events(sent) == ["accepted", "done"]
    assert sent[-1]["result"]["path"] == SOURCE.url


def test_a_source_outside_the_models_file_prefixes_is_refused(
    coordinator: Coordinator, fake: FakeFetch
) -> None:
    sent: list[dict[str, Any]] = []
    handler(coordinator).handle_line(line("s3://elsewhere/m/r1"), sent.append)
    assert events(sent) == ["refused"]
    assert fake.calls == []


def test_allow_source_replaces_the_models_file_prefixes(coordinator: Coordinator) -> None:
    sent: list[dict[str, Any]] = []
    allow = (SourcePrefix.parse("s3://elsewhere"),)
    handler(coordinator, allow).handle_line(line(SOURCE.url), sent.append)
    assert events(sent) == ["refused"]


def test_a_bad_request_is_an_error_event(coordinator: Coordinator) -> None:
    sent: list[dict[str, Any]] = []
    handler(coordinator).handle_line(b"{not json", sent.append)
    assert events(sent) == ["error"] and sent[0]["exit_code"] == 2


def test_a_request_with_an_empty_revision_is_an_error_not_the_url_s(
    coordinator: Coordinator, fake: FakeFetch
) -> None:
    """A Pod's "revision": "" is refused (exit 2), not read as "take the URL's"."""
    sent: list[dict[str, Any]] = []
    request = json.dumps({"source": SOURCE.url, "revision": "", "pod_uid": POD}).encode()
    handler(coordinator).handle_line(request, sent.append)
    assert events(sent) == ["error"] and sent[0]["exit_code"] == 2, sent
    assert "empty" in sent[0]["message"] and fake.calls == []


@pytest.mark.parametrize("op", ["fetch", "hit"])
def test_a_name_that_is_no_path_segment_is_an_error_and_leases_nothing(
    coordinator: Coordinator, cache: Cache, fake: FakeFetch, op: str
) -> None:
    sent: list[dict[str, Any]] = []
    for name in ("n" * 60_000, "a/b", ".."):
        request = {"op": op, "source": SOURCE.url, "name": name, "pod_uid": POD}
        handler(coordinator).handle_line(json.dumps(request).encode(), sent.append)
    assert events(sent) == ["error"] * 3 and {e["exit_code"] for e in sent} == {2}, sent
    assert for_cache(cache.layout).lease_holders() == set() and fake.calls == []


def test_hits_on_revisions_the_cache_never_had_lease_nothing(
    coordinator: Coordinator, cache: Cache
) -> None:
    """A Pod that sends hits for made-up revisions must not grow the index."""
    for i in range(20):
        coordinator.record_hit(Source.parse(f"s3://models/m/made-up-{i}"), POD)
    assert for_cache(cache.layout).lease_holders() == set()
    add_revision(cache, "m", "r1", 10)
    coordinator.record_hit(SOURCE, POD)
    assert for_cache(cache.layout).lease_holders() == {POD}


def test_a_fetch_failing_with_an_os_error_is_logged_and_the_pod_falls_back(
    cache: Cache, caplog: pytest.LogCaptureFixture
) -> None:
    """An OSError of the fetch itself (EIO, a FIFO planted in tmp/) is not the connection
    going away: said in the daemon's log, no verdict (the Pod fetches alone)."""

    def failing(source: Source, pod_uid: str | None) -> FetchResult:
        raise OSError(5, "Input/output error")

    c = Coordinator(failing, cache, for_cache(cache.layout), Metrics(), threading.Event())
    try:
        sent: list[dict[str, Any]] = []
        with caplog.at_level("ERROR"):
            handler(c).handle_line(line(SOURCE.url), sent.append)  # does not raise
        assert events(sent) == ["accepted"]
        assert "Input/output error" in caplog.text and "fetches alone" in caplog.text

        def gone(event: dict[str, Any]) -> None:
            raise ConnectionResetError("the Pod went away")

        with pytest.raises(ConnectionResetError):  # the connection's: up to the server
            handler(c).handle_line(line(SOURCE.url), gone)
    finally:
        c.shutdown()


def test_a_stopping_daemon_answers_no_error(coordinator: Coordinator) -> None:
    coordinator.stopping.set()
    sent: list[dict[str, Any]] = []
    handler(coordinator).handle_line(line(SOURCE.url), sent.append)
    assert events(sent) == ["accepted"]  # then the socket closes: the Pod falls back


def test_a_fetch_done_before_submit_returns_does_not_deadlock(cache: Cache) -> None:
    """A fetch that ends at once runs its done-callback in the submitting thread; under
    the single-flight lock that callback (which takes the lock) used to hang the daemon."""

    def instant(source: Source, pod_uid: str | None) -> FetchResult:
        return FetchResult(path=source.url, hit=True, bytes_from_origin=0, seconds=0.0)

    c = Coordinator(instant, cache, for_cache(cache.layout), Metrics(), threading.Event())
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # let the worker finish between submit and the callback
    done = threading.Event()

    def submit_many() -> None:
        for i in range(300):
            c.submit(Source.parse(f"s3://models/m/r{i}")).result(WAIT)
        done.set()

    try:
        threading.Thread(target=submit_many, daemon=True).start()
        assert done.wait(WAIT), "submit() deadlocked on a fetch already done"
    finally:
        sys.setswitchinterval(before)
        c.shutdown()


def test_copies_and_throttles_of_fetches_alone_are_counted(
    coordinator: Coordinator, fake: FakeFetch, cache: Cache
) -> None:
    """Copies in flight: ours per revision, plus each fetch alone that has had GETs (one
    waiting on a revision lock is no copy). Their throttles add to ours, each counted once."""
    from weightcache.cache import alone

    coordinator.submit(SOURCE)
    assert fake.started.wait(WAIT)
    throttles = [2]
    with (
        alone.registered(cache.layout, "m", "r1", lambda: 4, lambda: throttles[0]),
        alone.registered(cache.layout, "m", "r1", lambda: 0),
    ):
        coordinator.count_fetches()
        assert sample(coordinator, "weightcache_copies_inflight") == 2
        assert sample(coordinator, "weightcache_downloads_inflight") == 1
        assert sample(coordinator, "weightcache_origin_throttled_total") == 2
        coordinator.count_fetches()
        assert sample(coordinator, "weightcache_origin_throttled_total") == 2
        throttles[0] = 5
        time.sleep(2 * alone.UPDATE_INTERVAL)
        coordinator.count_fetches()
        assert sample(coordinator, "weightcache_origin_throttled_total") == 5
    fake.release.set()
