"""Fetcher.downloader and Fetcher.origin: the daemon's lazily built downloader and origin
client are built once, whatever the number of threads asking at once, and interrupt()
reaches the downloader."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from weightcache.cache.layout import Layout
from weightcache.config import OriginSettings
from weightcache.errors import Interrupted
from weightcache.fetch import Fetcher

THREADS = 16


@pytest.fixture
def fine_switching() -> Iterator[None]:
    """Switch threads every microsecond: a build inside the property (the boto3 client's
    takes tens of ms) then interleaves with every other thread's check."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _race(fetcher: Fetcher, attribute: str = "downloader") -> list[object]:
    barrier = threading.Barrier(THREADS)
    got: list[object] = []
    lock = threading.Lock()

    def ask() -> None:
        barrier.wait()
        d = getattr(fetcher, attribute)
        with lock:
            got.append(d)

    threads = [threading.Thread(target=ask) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


@pytest.mark.usefixtures("fine_switching")
def test_threads_racing_the_property_share_one_downloader(layout: Layout) -> None:
    fetcher = Fetcher(layout, OriginSettings(endpoint_url="http://127.0.0.1:9", bwlimit=1 << 20))
    got = _race(fetcher)
    assert len(got) == THREADS
    built = {id(d) for d in got}
    assert len(built) == 1, f"{len(built)} downloaders (token buckets) built by {THREADS} threads"
    assert all(d is fetcher.downloader for d in got)


def test_a_downloader_built_after_interrupt_is_interrupted(layout: Layout) -> None:
    fetcher = Fetcher(layout, OriginSettings(endpoint_url="http://127.0.0.1:9"))
    fetcher.interrupt()  # SIGTERM before any fetch built the downloader
    with pytest.raises(Interrupted):
        fetcher.downloader.download([])


@pytest.mark.usefixtures("fine_switching")
def test_threads_racing_for_the_origin_share_one_client(layout: Layout) -> None:
    fetcher = Fetcher(layout, OriginSettings(endpoint_url="http://127.0.0.1:9"))
    got = _race(fetcher, "origin")
    assert len(got) == THREADS
    assert len({id(o) for o in got}) == 1, "several boto3 clients built by racing threads"
    assert all(o is fetcher.origin for o in got)
