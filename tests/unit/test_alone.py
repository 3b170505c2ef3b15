"""The registry of fetches alone (weightcache/cache/alone.py): a record lives exactly as long as
its process holds its lock, and carries its GETs in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from weightcache.cache import alone
from weightcache.cache.layout import Layout

HOLD = """
import sys, time
from weightcache.cache import alone
from weightcache.cache.layout import Layout
with alone.registered(Layout.open(sys.argv[1]), "m", "r1", lambda: 7):
    print("registered", flush=True)
    time.sleep(600)
"""


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_registered_fetch_is_live_with_its_gets_until_the_block_ends(tmp_path: Path) -> None:
    layout = Layout.open(tmp_path / "cache")
    gets = [0]
    assert alone.live(layout) == []
    with alone.registered(layout, "m", "r1", lambda: gets[0]):
        assert alone.live(layout) == [alone.AloneFetch("m", "r1", 0)]
        gets[0] = 16
        assert wait_until(
            lambda: alone.live(layout) == [alone.AloneFetch("m", "r1", 16, pulling=True)]
        )
    assert alone.live(layout) == []
    assert list(layout.fetching.iterdir()) == []


def test_a_killed_fetch_is_a_ghost_never_counted_and_removed(tmp_path: Path) -> None:
    layout = Layout.open(tmp_path / "cache")
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(layout.root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "registered\n"
        assert alone.live(layout) == [alone.AloneFetch("m", "r1", 7, pulling=True)]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert len(list(layout.fetching.glob("*.json"))) == 1  # left behind by kill -9
    assert alone.live(layout) == []
    assert list(layout.fetching.iterdir()) == []


def test_records_without_a_held_lock_or_unreadable_count_as_nothing(tmp_path: Path) -> None:
    layout = Layout.open(tmp_path / "cache")
    layout.fetching.mkdir()
    record = {"name": "m", "revision": "r1", "gets": 3}
    (layout.fetching / "1-aa.json").write_text(json.dumps(record))  # no lock file at all
    (layout.fetching / "2-bb.json").write_text(json.dumps(record))
    (layout.fetching / "2-bb.lock").touch()  # nobody holds it
    with alone.registered(layout, "x", "y", lambda: 1):
        assert alone.live(layout) == [alone.AloneFetch("x", "y", 1, pulling=True)]
        [own] = layout.fetching.glob("*.json")  # the ghosts are gone
        own.write_text("{not json")
        assert alone.live(layout) == []  # malformed: nothing, but not a ghost
        assert list(layout.fetching.glob("*.json")) == [own]
    assert list(layout.fetching.iterdir()) == []


@pytest.mark.timeout(10)
def test_records_and_locks_planted_as_fifos_or_symlinks_count_as_nothing_at_once(
    tmp_path: Path,
) -> None:
    """A FIFO at a lock's or a record's path must not hang the daemon's scrape."""
    layout = Layout.open(tmp_path / "cache")
    layout.fetching.mkdir()
    record = json.dumps({"name": "m", "revision": "r1", "gets": 3})
    os.mkfifo(layout.fetching / "1-aa.lock")  # opening it to read would wait for a writer
    (layout.fetching / "1-aa.json").write_text(record)
    assert alone.live(layout) == []  # not held: a ghost, removed
    assert list(layout.fetching.iterdir()) == []
    with alone.registered(layout, "x", "y", lambda: 1):
        [own] = layout.fetching.glob("*.json")
        own.unlink()
        os.mkfifo(own)  # a held lock, its record a FIFO
        assert alone.live(layout) == []
        own.unlink()
        own.symlink_to("/dev/zero")
        assert alone.live(layout) == []
        own.unlink()
        for content in ('{"name": "x", "revision": "y", "gets": 1e400}', "[" * 4000):
            own.write_text(content)  # OverflowError, RecursionError: nothing, no ghost
            assert alone.live(layout) == [] and own.exists()


def test_a_fetch_that_had_gets_stays_pulling_and_carries_its_throttles(tmp_path: Path) -> None:
    """`pulling` tells a copy downloading from a fetch waiting on another's revision lock;
    it holds through a pause between blobs (0 GETs), or the alert's `for:` would restart."""
    layout = Layout.open(tmp_path / "cache")
    gets, throttles = [0], [0]
    with alone.registered(layout, "m", "r1", lambda: gets[0], lambda: throttles[0]):
        [waiting] = alone.live(layout)
        assert (waiting.pulling, waiting.throttled) == (False, 0)
        gets[0], throttles[0] = 4, 3
        assert wait_until(lambda: alone.live(layout)[0].throttled == 3)
        gets[0] = 0
        assert wait_until(lambda: alone.live(layout)[0].gets == 0)
        [paused] = alone.live(layout)
        assert (paused.pulling, paused.throttled) == (True, 3)
        assert paused.key and (layout.fetching / f"{paused.key}.json").exists()
