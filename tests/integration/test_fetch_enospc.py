"""A full disk is exit 5 and harms nothing already cached (design §2.2 exit 5, §3 inv. 1)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, dead_endpoint
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    markers,
    mounted_tmpfs,
)
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs mounted at tmp_path/disk (needs root and mount(2))."""
    with mounted_tmpfs(tmp_path / "disk", "48m") as mountpoint:
        yield mountpoint


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.timeout(180)
def test_no_space_is_exit_5_and_keeps_other_revisions(
    wc: CLI, publish: Callable[..., Published], small_disk: Path
) -> None:
    a = publish([4 * MiB, 4 * MiB], name="small", rev="r1")
    b = publish([16 * MiB] * 4, name="big", rev="r1")
    assert a.model.total_size < 48 * MiB < a.model.total_size + b.model.total_size

    assert_ok_path(wc.fetch(a.source, small_disk, "--part-size", "4M"),
                   a.local_path(small_disk))  # fmt: skip

    proc = wc.fetch(b.source, small_disk, "--part-size", "4M")
    message = assert_fails(proc, 5)
    assert any(w in message.lower() for w in ("space", "full", "enospc")), message

    assert markers(small_disk) == [a.local_path(small_disk) / ".weightcache"]
    assert not b.local_path(small_disk).exists()
    assert_revision_ok(small_disk, a.name, a.rev, a.model)
    assert_blobs_valid(small_disk)
    # Still a hit, with the store gone and the disk still full.
    assert_ok_path(wc.fetch(a.source, small_disk, endpoint=dead_endpoint()),
                   a.local_path(small_disk))  # fmt: skip


@pytest.mark.timeout(240)
def test_disk_full_at_any_point_of_a_fetch(
    wc: CLI, publish: Callable[..., Published], small_disk: Path
) -> None:
    """Leave just enough room for the data plus 0..64 KiB, so ENOSPC strikes wherever it
    strikes (partials, part state, marker, index): exit 0 with a verified revision or
    exit 5 with one error line, never anything else, never a marker on bad data, nor a
    temporary left in tmp/."""
    pub = publish([3 * MiB + 123, 1 * MiB], name="tight", rev="r1")
    filler = small_disk / "filler"  # outside every cache directory below
    outcomes = {}
    for k in (0, 1, 2, 3, 4, 6, 8, 12, 16):
        cache = small_disk / f"cache{k}"
        filler.unlink(missing_ok=True)
        want_free = pub.model.total_size + k * 4096
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free_bytes(small_disk) - want_free)
        proc = wc.fetch(pub.source, cache, "--part-size", "1M")
        outcomes[k] = proc.returncode
        if proc.returncode == 0:
            assert_ok_path(proc, pub.local_path(cache))
            assert_revision_ok(cache, pub.name, pub.rev, pub.model)
        else:
            assert_fails(proc, 5)
            assert markers(cache) == []
        assert_blobs_valid(cache)
        leftovers = list((cache / ".weightcache" / "tmp").glob("*.tmp"))
        assert leftovers == [], f"k={k}: temporaries left behind"
    assert 5 in outcomes.values(), outcomes


@pytest.mark.timeout(180)
def test_disk_fills_up_during_the_download(
    wc: CLI, publish: Callable[..., Published], small_disk: Path, proxy: FaultProxy
) -> None:
    """Another tenant takes the last free byte after the download started (so after any
    free-space check): exit 5 (or 0 if nothing more needed space), and after space is
    freed the next fetch completes."""
    pub = publish([4 * MiB, 4 * MiB], name="squeezed", rev="r1")
    cache = small_disk / "cache"
    filler = small_disk / "filler"
    proxy.configure(rate_limit=4 * MiB)
    running = wc.fetch_popen(pub.source, cache, "--part-size", "1M", endpoint=proxy.url)
    deadline = time.monotonic() + 60
    while proxy.stats(settle=0).body_bytes < 2 * MiB and running.poll() is None:
        assert time.monotonic() < deadline, "the download never started"
        time.sleep(0.01)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free_bytes(small_disk))
    proc = running.finish(timeout=120)
    if proc.returncode == 0:
        assert_ok_path(proc, pub.local_path(cache))
        assert_revision_ok(cache, pub.name, pub.rev, pub.model)
    else:
        assert_fails(proc, 5)
        assert markers(cache) == []
    assert_blobs_valid(cache)

    filler.unlink()
    proxy.configure(rate_limit=None)
    again = wc.fetch(pub.source, cache, "--part-size", "1M", endpoint=proxy.url)
    assert_ok_path(again, pub.local_path(cache))
    assert_revision_ok(cache, pub.name, pub.rev, pub.model)


@pytest.mark.timeout(180)
def test_a_disk_filled_mid_prefetch_is_exit_5(
    wc: CLI, publish: Callable[..., Published], small_disk: Path, proxy: FaultProxy,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The data goes into space preallocated at the start; the small part-state file saved
    beside it (and the marker after it) need new pages: a disk filled up mid-download is
    the disk's fault, exit 5 with the no-space message, for `prefetch` as for `fetch` (it
    was an unexpected OSError, exit 1)."""
    pub = publish([6 * MiB], name="stateful", rev="r1")
    cache = small_disk / "cache"
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - source: {pub.source}\n")
    proxy.configure(rate_limit=2 * MiB)
    running = wc.popen("prefetch", "--cache-dir", cache, "--models", models, "--min-free",
                       "0", "--part-size", "1M", "--endpoint-url", proxy.url,
                       env={"AWS_ENDPOINT_URL": proxy.url})  # fmt: skip
    deadline = time.monotonic() + 60
    while proxy.stats(settle=0).body_bytes < 1 * MiB and running.poll() is None:
        assert time.monotonic() < deadline, "the download never started"
        time.sleep(0.01)
    with open(small_disk / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free_bytes(small_disk))
    message = assert_fails(running.finish(timeout=120), 5)
    assert "no space left on the cache disk" in message, message
    assert markers(cache) == []
