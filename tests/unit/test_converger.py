"""Converger in-process: the models file, prefetch with a fake fetch function, pins and the
one readiness that /metrics, /readyz and the node labels read (design §5)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from tests.support.cached import add_revision
from weightcache.cache.index import for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache
from weightcache.daemon import models
from weightcache.daemon.converger import Converger
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.models import DesiredState
from weightcache.errors import Interrupted, SourceError, UsageError
from weightcache.sourceurl import Source

MODELS = """
models:
  - source: s3://models/good/r1
    pin: true
  - source: s3://models/bad/r1
    pin: true
  - source: s3://models/plain/r1
"""


class FakeFetch:
    """Makes a revision ready, except those named in `fail` (a SourceError, exit 3)."""

    def __init__(self, cache: Cache, fail: set[str]) -> None:
        self.cache = cache
        self.fail = fail
        self.calls: list[str] = []

    def __call__(self, source: Source) -> None:
        self.calls.append(source.name)
        if source.name in self.fail:
            raise SourceError(f"no such prefix {source.url}")
        add_revision(self.cache, source.name, source.revision, 10, source=source.url)


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    return path


@pytest.fixture
def cache(layout: Layout) -> Cache:
    return Cache(layout)


def converger(
    models_file: Path, cache: Cache, fail: frozenset[str] = frozenset({"bad"})
) -> Converger:
    c = Converger(
        models_file, cache, for_cache(cache.layout), Metrics(), FakeFetch(cache, set(fail)),
        threading.Event(),
    )  # fmt: skip
    c.load()
    return c


def gauge(c: Converger, name: str, pinned: str) -> float | None:
    labels = {"name": name, "revision": "r1", "pinned": pinned}
    return c.metrics.registry.get_sample_value("weightcache_revision_ready", labels)


def test_a_failing_entry_never_stops_the_others(models_file: Path, cache: Cache) -> None:
    c = converger(models_file, cache)
    c.converge_once()
    assert c.ready("good", "r1") and c.ready("plain", "r1")
    assert not c.ready("bad", "r1")
    assert set(c.failures) == {("bad", "r1")} and c.failures["bad", "r1"].exit_code == 3


def test_a_failing_entry_is_retried_after_its_backoff_only(models_file: Path, cache: Cache) -> None:
    c = converger(models_file, cache)
    c.converge_once()
    c.converge_once()  # within the backoff: not asked again
    assert c.fetch.calls.count("bad") == 1  # type: ignore[attr-defined]
    assert not c.retry_due()


def test_pinned_revisions_are_written_to_the_index(models_file: Path, cache: Cache) -> None:
    converger(models_file, cache)
    assert for_cache(cache.layout).pins() == {("good", "r1"), ("bad", "r1")}


def test_readiness_is_exported_per_listed_revision(models_file: Path, cache: Cache) -> None:
    c = converger(models_file, cache)
    c.export_readiness()
    assert [gauge(c, n, p) for n, p in (("good", "true"), ("plain", "false"))] == [0, 0]
    c.converge_once()
    c.export_readiness()
    assert gauge(c, "good", "true") == 1 and gauge(c, "plain", "false") == 1
    assert gauge(c, "bad", "true") == 0
    assert c.pinned_missing() == ["bad/r1"]


def test_an_evicted_revision_reads_not_ready_at_once(models_file: Path, cache: Cache) -> None:
    c = converger(models_file, cache)
    c.converge_once()
    cache.remove_revision("plain", "r1")
    c.export_readiness()
    assert gauge(c, "plain", "false") == 0


def test_a_revision_no_longer_listed_has_no_series(models_file: Path, cache: Cache) -> None:
    c = converger(models_file, cache)
    c.export_readiness()
    models_file.write_text("models:\n  - source: s3://models/good/r1\n")
    assert c.reload()
    c.export_readiness()
    assert gauge(c, "good", "false") == 0
    assert gauge(c, "good", "true") is None and gauge(c, "plain", "false") is None


def test_a_models_file_turned_invalid_keeps_the_last_good_state(
    models_file: Path, cache: Cache
) -> None:
    c = converger(models_file, cache)
    models_file.write_text("models: {not: a list}\n")
    assert not c.reload()
    assert len(c.desired.models) == 3


def test_a_missing_models_file_at_start_is_a_usage_error(tmp_path: Path, cache: Cache) -> None:
    with pytest.raises(UsageError, match="cannot read the models file"):
        converger(tmp_path / "absent.yaml", cache)


def test_step_converges_then_calls_then(models_file: Path, cache: Cache) -> None:
    c = converger(models_file, cache, fail=frozenset())
    after: list[bool] = []
    c.step(then=lambda: after.append(c.ready("plain", "r1")))
    c.step(then=lambda: after.append(True))  # nothing changed, nothing due: no step
    assert after == [True]


def test_a_prefetch_interrupted_by_the_daemon_stopping_is_no_failure(
    models_file: Path, cache: Cache, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM interrupts the download: logged as stopped, not as an error to retry; the
    same Interrupted while the daemon runs on is a failure like any other."""

    def interrupted(source: Source) -> None:
        raise Interrupted()

    caplog.set_level(logging.INFO)
    c = converger(models_file, cache)
    c.fetch = interrupted
    c.stopping.set()
    c._converge_entry(Source.parse("s3://models/good/r1"))
    assert c.failures == {} and "ERROR" not in caplog.text and "stopped" in caplog.text
    c.stopping.clear()
    c._converge_entry(Source.parse("s3://models/good/r1"))
    assert set(c.failures) == {("good", "r1")}


def test_bytes_parsed_already_are_not_parsed_again(
    models_file: Path, cache: Cache, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle daemon re-reads the file at every --interval; parsing a large one each time
    cost it a core. Valid or not, the same bytes are parsed once."""
    parsed: list[bytes] = []

    def parse(path: Path, data: bytes) -> DesiredState:
        parsed.append(data)
        return models.parse(path, data)

    c = Converger(models_file, cache, for_cache(cache.layout), Metrics(),
                  FakeFetch(cache, set()), threading.Event(), parse=parse)  # fmt: skip
    c.load()
    for _ in range(5):
        assert c.reload() is False
    assert len(parsed) == 1
    models_file.write_text("models: [\n")  # invalid: logged once, parsed once
    for _ in range(5):
        c.reload()
    assert len(parsed) == 2 and len(c.desired.models) == 3
    models_file.unlink()  # gone, then back with the same invalid bytes: said again
    c.reload()
    models_file.write_text("models: [\n")
    c.reload()
    assert len(parsed) == 3
    models_file.write_text(MODELS.replace("plain", "other"))
    assert c.reload() is True and len(parsed) == 4
    assert [m.source.name for m in c.desired.models] == ["good", "bad", "other"]
