"""Fetcher.downloader and Fetcher.origin: the daemon's lazily built downloader and origin
client are built once, whatever the number of threads asking at once, and interrupt()
reaches the downloader; the threads that request the listing and SHA256SUMS are waited
for before the process exits."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

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


def test_a_background_request_is_waited_for_before_the_process_exits(tmp_path: Path) -> None:
    """The listing and SHA256SUMS are requested in threads; when one fails the process
    exits while the other may still be in a TLS handshake. As a daemon thread it was
    abandoned to the interpreter's finalization (SIGSEGV after the error line, seen in CI);
    the interpreter must wait for it and exit with the code the caller chose."""
    done = tmp_path / "done"
    script = (
        "import sys, time\n"
        "from weightcache.transfer.pacing import Background\n"
        f"Background(lambda: time.sleep(0.3) or open({str(done)!r}, 'w').close())\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=30)
    assert proc.returncode == 3
    assert done.exists()
