"""N concurrent fetches of one revision on one node make one origin download (design §3 inv. 4)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, Running
from tests.support.checks import (
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024
#: Bytes the store may send beyond one copy: what a dropped connection had in flight (a
#: straggler's tail read elsewhere, design §4 Stragglers); a second download is 4 MiB a file.
SLACK = 1 * MiB


def holds_a_lock_file(pid: int, cache_dir: Path) -> bool:
    """Whether process `pid` has a file open under DIR/.weightcache/locks/ (a fetch that
    got past its hit check and holds or waits for a flock there)."""
    locks = str(cache_dir / ".weightcache" / "locks") + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(locks):
                return True
    return False


def in_fetch(p: Running, cache_dir: Path) -> bool:
    """Past its hit check: holding the download's locks, or logging that it waits for them
    (a waiter polls its lock, so its lock file is open for microseconds at a time)."""
    if holds_a_lock_file(p.pid, cache_dir):
        return True
    return "waiting for another fetch" in p.stderr_path.read_text(errors="replace")


def wait_for_all_in_fetch(procs: list[Running], cache_dir: Path, timeout: float = 90) -> None:
    """Until every process is in the fetch (see `in_fetch`), or fail."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < len(procs) and time.monotonic() < deadline:
        seen |= {p.pid for p in procs if p.pid not in seen and in_fetch(p, cache_dir)}
        for p in procs:
            assert p.poll() is None or p.pid in seen, f"a fetch exited first: {p.finish()}"
        time.sleep(0.02)
    assert len(seen) == len(procs), f"{len(procs) - len(seen)} fetches never reached a lock"


@pytest.mark.timeout(180)
def test_eight_concurrent_fetches_download_once(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([4 * MiB] * 4, name="herd", rev="r1")
    size = pub.model.total_size
    # The store trickles (64 KiB/s) until all eight processes are in the fetch, then runs
    # at 6 MiB/s: the test means something only if all eight wait on one download.
    proxy.configure(rate_limit=64 * 1024)

    # Half print the path, half print JSON (which also reports bytes from the origin).
    procs = [
        wc.fetch_popen(pub.source, cache_dir, *(["--json"] if i % 2 else []),
                       "--part-size", "1M", endpoint=proxy.url)
        for i in range(8)
    ]  # fmt: skip
    wait_for_all_in_fetch(procs, cache_dir)
    assert markers(cache_dir) == [], "the first fetch finished before the last one started"
    proxy.configure(rate_limit=6 * MiB)
    results = [p.finish(timeout=150) for p in procs]

    expected = pub.local_path(cache_dir)
    docs = []
    for i, r in enumerate(results):
        if i % 2:
            assert r.returncode == 0 and r.stdout.count("\n") == 1, describe(r)
            docs.append(json.loads(r.stdout))
            assert Path(docs[-1]["path"]).resolve() == expected.resolve(), describe(r)
        else:
            assert_ok_path(r, expected)

    s = proxy.stats()
    assert size <= s.body_bytes <= size + SLACK, (
        f"{s.body_bytes} bytes from the store for a {size}-byte model fetched by 8 processes"
    )
    # Each process reports what it took from the origin; together that is one model.
    assert sum(d["bytes_from_origin"] for d in docs) <= size + SLACK, docs
    assert markers(cache_dir) == [pub.local_path(cache_dir) / ".weightcache"]
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_linked_to_blobs(cache_dir, pub.name, pub.rev, pub.model)
