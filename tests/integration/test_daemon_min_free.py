"""The --min-free floor: on a small tmpfs that other files fill, the
daemon evicts so that free space after a download stays above the floor, and a download
that cannot keep it even with everything evictable gone is exit 5 saying so."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    is_marked,
    wait_for,
    write_models,
)
from tests.support.checks import assert_fails, assert_ok_path, assert_revision_ok, describe
from tests.support.faultproxy import FaultProxy

FLOOR = 16 * MiB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (needs root), unmounted whatever the outcome."""
    if os.geteuid() != 0:
        pytest.skip("the min-free test mounts a tmpfs: it needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, nbytes: int) -> None:
    """Another file on the disk (an image layer, a log), `nbytes` long."""
    with open(path, "ab") as f:
        f.write(b"\0" * nbytes)


@pytest.mark.timeout(180)
def test_the_daemon_evicts_to_keep_min_free_when_other_files_fill_the_disk(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, small_disk: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    old, mid, new, big = (publish([8 * MiB], name=n, rev="r1", seed=n)
                          for n in ("old", "mid", "new", "big"))  # fmt: skip
    cache_dir = small_disk / "cache"
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, capacity="100%",
                           extra=["--min-free", str(FLOOR)])  # fmt: skip
    no_lease = {"POD_UID": None}
    for pub in (old, mid):
        assert_ok_path(wc.fetch(pub.source, cache_dir, env=no_lease), pub.local_path(cache_dir))

    # Other files leave 20 MiB free: the next 8 MiB would leave 12 MiB, under the floor.
    fill(small_disk / "other-files", free_bytes(small_disk) - 20 * MiB)
    assert_ok_path(wc.fetch(new.source, cache_dir, env=no_lease), new.local_path(cache_dir))
    assert not is_marked(cache_dir, old), f"the LRU revision was kept\n{daemon.log()}"
    assert is_marked(cache_dir, mid) and is_marked(cache_dir, new)
    assert_revision_ok(cache_dir, new.name, new.rev, new.model)
    assert free_bytes(small_disk) >= FLOOR, (free_bytes(small_disk), daemon.log())

    # The other files grow past the floor: the daemon evicts on its own to restore it.
    fill(small_disk / "other-files", free_bytes(small_disk) - 10 * MiB)
    wait_for("the floor restored", lambda: free_bytes(small_disk) >= FLOOR, timeout=30)
    assert not is_marked(cache_dir, mid), daemon.log()

    # Again, until nothing evictable is left (about 18 MiB free then): 8 MiB more cannot
    # keep 16 MiB free, so the download is refused, exit 5, before a byte is written.
    fill(small_disk / "other-files", free_bytes(small_disk) - 10 * MiB)
    wait_for("the floor restored", lambda: free_bytes(small_disk) >= FLOOR, timeout=30)
    assert not is_marked(cache_dir, new), daemon.log()
    assert free_bytes(small_disk) < FLOOR + 8 * MiB
    result = wc.fetch(big.source, cache_dir, env=no_lease)
    message = assert_fails(result, 5)
    assert "--min-free" in message and "other files" in message, describe(result)
    assert not is_marked(cache_dir, big)
    assert free_bytes(small_disk) >= FLOOR
    assert daemon.alive(), daemon.log()
    # What WeightcacheDiskBelowMinFree compares.
    m = daemon.metrics()
    assert m["weightcache_min_free_bytes"] == FLOOR, m
    assert FLOOR <= m["weightcache_disk_free_bytes"] < FLOOR + 8 * MiB, m


@pytest.mark.timeout(120)
def test_gc_evicts_to_keep_min_free(
    wc: CLI, publish: Callable[..., Published], small_disk: Path
) -> None:
    old, new = (publish([8 * MiB], name=n, rev="r1", seed=n) for n in ("old", "new"))
    cache_dir = small_disk / "cache"
    for pub in (old, new):
        assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), pub.local_path(cache_dir))
    fill(small_disk / "other-files", free_bytes(small_disk) - 10 * MiB)
    gc = wc.run("gc", "--cache-dir", cache_dir, "--capacity", "100%", "--min-free", str(FLOOR))
    assert gc.returncode == 0, describe(gc)
    assert "evict old/r1" in gc.stdout, describe(gc)
    assert not is_marked(cache_dir, old) and is_marked(cache_dir, new), describe(gc)
    assert free_bytes(small_disk) >= FLOOR


@pytest.mark.timeout(120)
def test_gc_says_a_floor_no_eviction_can_keep_without_a_negative_target(
    wc: CLI, publish: Callable[..., Published], small_disk: Path
) -> None:
    """Other files leave less than the floor free even with the cache empty: gc evicts what
    it can (down to 0) and says the floor cannot be kept, never a negative target."""
    pub = publish([1 * MiB], name="m", rev="r1")
    cache_dir = small_disk / "cache"
    assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), pub.local_path(cache_dir))
    fill(small_disk / "other-files", free_bytes(small_disk) - 8 * MiB)
    args = ("gc", "--cache-dir", cache_dir, "--capacity", "100%", "--min-free", "50%")
    gc = wc.run(*args, "--dry-run")
    assert gc.returncode == 0, describe(gc)
    assert "target -" not in gc.stdout and "(target 0)" in gc.stdout, describe(gc)
    assert "--min-free 50%" in gc.stdout and "cannot be kept" in gc.stdout, describe(gc)


@pytest.mark.timeout(120)
def test_a_fetch_alone_keeps_min_free(
    wc: CLI, publish: Callable[..., Published], small_disk: Path
) -> None:
    """Without a daemon nothing evicts: a download that would leave less than --min-free
    free is exit 5 before its first byte (the read-write fallback keeps the node's floor),
    and one that keeps it goes ahead."""
    fits, big = (publish([8 * MiB], name=n, rev="r1", seed=n) for n in ("fits", "big"))
    cache_dir = small_disk / "cache"
    fill(small_disk / "other-files", free_bytes(small_disk) - 30 * MiB)
    floor = ("--min-free", str(FLOOR))
    ok = wc.fetch(fits.source, cache_dir, "--no-daemon", *floor)
    assert_ok_path(ok, fits.local_path(cache_dir))
    assert free_bytes(small_disk) >= FLOOR
    # About 22 MiB free now: 8 MiB more would leave 14, under the 16 MiB floor.
    refused = wc.fetch(big.source, cache_dir, "--no-daemon", *floor)
    message = assert_fails(refused, 5)
    assert "--min-free" in message and "big/r1" in message, describe(refused)
    assert not is_marked(cache_dir, big)
    assert free_bytes(small_disk) >= FLOOR
    # Without the option a fetch alone keeps no floor (a workstation's disk is its own).
    assert_ok_path(wc.fetch(big.source, cache_dir, "--no-daemon"), big.local_path(cache_dir))


@pytest.mark.parametrize("command", ["gc", "daemon", "fetch"])
def test_a_min_free_of_the_whole_disk_is_refused(wc: CLI, tmp_path: Path, command: str) -> None:
    """A floor of 100% free can never be kept: a usage error naming the option and its
    range, the same for the daemon (and prefetch) as for gc."""
    models = write_models(tmp_path / "models.yaml", [])
    args = {
        "gc": ("gc", "--capacity", "50%"),
        "daemon": ("daemon", "--models", models, "--capacity", "50%", "--metrics-addr",
                   "127.0.0.1:0"),
        "fetch": ("fetch", "s3://models/m/r1", "--no-daemon"),
    }[command]  # fmt: skip
    proc = wc.run(*args, "--cache-dir", tmp_path / "cache", "--min-free", "100%", timeout=30)
    message = assert_fails(proc, 2)
    assert "--min-free" in message and "[0, 100)" in message, message
