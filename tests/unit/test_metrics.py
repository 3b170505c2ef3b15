"""The daemon's metrics observer: what the downloads and the swarm feed, as /metrics shows it."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from weightcache.config import OriginSettings
from weightcache.daemon.metrics import BAD_PEER_REASONS, Metrics
from weightcache.transfer.backends.file import FileBlob
from weightcache.transfer.downloader import BlobJob, RangedDownloader

PART = 256 << 10


def value(m: Metrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, labels)
    assert got is not None, f"{name}{labels} is not exported"
    return got


def test_requests_in_flight_are_counted_by_source() -> None:
    m = Metrics()
    for source in ("peer", "peer", "origin"):
        m.request_started(source)
    assert value(m, "weightcache_pieces_inflight", source="peer") == 2
    assert value(m, "weightcache_pieces_inflight", source="origin") == 1
    assert value(m, "weightcache_origin_get_inflight") == 1  # peers are not object-store GETs
    m.request_finished("peer")
    m.request_finished("origin")
    assert value(m, "weightcache_pieces_inflight", source="peer") == 1
    assert value(m, "weightcache_pieces_inflight", source="origin") == 0


def test_bytes_by_source_and_uploads() -> None:
    m = Metrics()
    m.received(100, "origin")
    m.received(300, "peer")
    m.peer_uploaded(700)
    m.peer_streamed(200)
    assert value(m, "weightcache_bytes_total", source="origin") == 100
    assert value(m, "weightcache_bytes_total", source="peer") == 300
    assert value(m, "weightcache_peer_upload_bytes_total") == 700
    assert value(m, "weightcache_peer_streamed_bytes_total") == 200


def test_peers_marked_bad_by_reason_all_shown_from_the_start() -> None:
    m = Metrics()
    page = generate_latest(m.registry).decode()
    for reason in BAD_PEER_REASONS:  # a zero series, so that increase() sees the first one
        assert f'weightcache_peers_marked_bad_total{{reason="{reason}"}} 0.0' in page
    for source in ("origin", "peer"):
        assert f'weightcache_pieces_inflight{{source="{source}"}} 0.0' in page
    m.peer_marked_bad("wrong_bytes")
    m.peer_marked_bad("wrong_bytes")
    m.peer_marked_bad("unreachable")
    assert value(m, "weightcache_peers_marked_bad_total", reason="wrong_bytes") == 2
    assert value(m, "weightcache_peers_marked_bad_total", reason="unreachable") == 1
    with pytest.raises(ValueError, match="unknown reason"):
        m.peer_marked_bad("liar")


class PeerFile(FileBlob):
    """A local file posing as a peer; `on_read` runs before each read of a range."""

    kind = "peer"

    def __init__(self, path: Path, on_open: threading.Event, go_on: threading.Event) -> None:
        super().__init__(path)
        self.opened, self.go_on = on_open, go_on

    def open_range(self, start: int, end: int, size: int, timeout: float):  # type: ignore[no-untyped-def]
        self.opened.set()
        assert self.go_on.wait(30)
        return super().open_range(start, end, size, timeout)


def test_the_downloader_feeds_the_gauge_and_the_bytes(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(4 * PART)
    path = tmp_path / "blob"
    path.write_bytes(data)
    m, opened, go_on = Metrics(), threading.Event(), threading.Event()
    settings = OriginSettings(part_size=PART, max_concurrency=2, timeout=60.0)
    job = BlobJob(PeerFile(path, opened, go_on), len(data), tmp_path / "blob.part", "blob")
    worker = threading.Thread(target=lambda: RangedDownloader(settings, observer=m).download([job]))
    worker.start()
    try:
        assert opened.wait(30)
        assert value(m, "weightcache_pieces_inflight", source="peer") >= 1
    finally:
        go_on.set()
        worker.join(60)
    assert value(m, "weightcache_pieces_inflight", source="peer") == 0
    assert value(m, "weightcache_bytes_total", source="peer") == len(data)
    assert value(m, "weightcache_bytes_total", source="origin") == 0
