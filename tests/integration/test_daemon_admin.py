"""Operator commands on a live cache (design §2, §3 inv. 1, §5): `gc` racing `fetch`,
`verify` catching and un-marking damage that the next `fetch` repairs, `gc --dry-run`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import MiB, entry, is_marked, ls_json, write_models
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
    markers,
    snapshot,
)
from tests.support.faultproxy import FaultProxy


@pytest.mark.timeout(180)
def test_gc_racing_fetch_never_leaves_a_marker_on_bad_data(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([1 * MiB] * 4, name="race", rev="r1", seed="race")
    marker = pub.local_path(cache_dir) / ".weightcache"
    # ~0.25 s of download per miss, so gc lands before, during and after it.
    proxy.configure(rate_limit=16 * MiB)
    (cache_dir / ".weightcache").mkdir(parents=True)  # gc refuses a path with no cache
    rng = random.Random(3)
    outcomes = []
    for i in range(8):
        warm = is_marked(cache_dir, pub)
        gc_first = rng.random() < 0.5
        delay = rng.uniform(0.0, 0.4)
        gc_args = ("gc", "--capacity", "1B", "--cache-dir", cache_dir)
        fetch_args = ("--part-size", "1M")
        if gc_first:
            gc = wc.popen(*gc_args)
            time.sleep(delay)
            fetch = wc.fetch_popen(pub.source, cache_dir, *fetch_args, endpoint=proxy.url)
        else:
            fetch = wc.fetch_popen(pub.source, cache_dir, *fetch_args, endpoint=proxy.url)
            time.sleep(delay)
            gc = wc.popen(*gc_args)
        f, g = fetch.finish(timeout=60), gc.finish(timeout=60)
        assert g.returncode == 0, f"iteration {i}: gc {describe(g)}"
        assert f.returncode == 0, f"iteration {i}: fetch {describe(f)}"
        assert f.stdout.strip() == str(pub.local_path(cache_dir)), describe(f)
        # Invariant 1 whatever the interleaving: a marker only on the complete revision.
        assert markers(cache_dir) in ([], [marker]), markers(cache_dir)
        if is_marked(cache_dir, pub):
            assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
        assert_blobs_valid(cache_dir)
        outcomes.append((i, "warm" if warm else "cold", "gc-first" if gc_first else
                         "fetch-first", round(delay, 2), "kept" if is_marked(cache_dir, pub)
                         else "evicted"))  # fmt: skip
    print(outcomes)

    # Whatever the race left, a plain fetch now gives the verified revision.
    final = wc.fetch(pub.source, cache_dir, endpoint=proxy.url)
    assert_ok_path(final, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_linked_to_blobs(cache_dir, pub.name, pub.rev, pub.model)


@pytest.mark.timeout(120)
def test_verify_catches_damage_and_fetch_repairs_it(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([2 * MiB, 1 * MiB], name="damaged", rev="r1", seed="damaged")
    target = f"{pub.name}/{pub.rev}"
    rev_dir = pub.local_path(cache_dir)
    assert_ok_path(wc.fetch(pub.source, cache_dir, endpoint=proxy.url), rev_dir)

    ok = wc.run("verify", target, "--cache-dir", cache_dir)
    assert ok.returncode == 0, describe(ok)
    assert ok.stdout.strip() == str(rev_dir), describe(ok)

    # Flip one byte in place through the revision's path (a hard link to the blob).
    shard = "model-00001-of-00002.safetensors"
    path = rev_dir / shard
    os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)
    with open(path, "r+b") as fh:
        fh.seek(12345)
        byte = fh.read(1)
        fh.seek(12345)
        fh.write(bytes([byte[0] ^ 0xFF]))

    bad = wc.run("verify", target, "--cache-dir", cache_dir)
    message = assert_fails(bad, 4)
    assert shard in message, message
    assert pub.model.hashes[shard] in message, message
    assert not (rev_dir / ".weightcache").exists(), "verify kept the marker on damaged data"
    assert ls_json(wc, cache_dir)[(pub.name, pub.rev)]["ready"] is False

    proxy.reset_stats()
    repaired = wc.fetch(pub.source, cache_dir, endpoint=proxy.url)
    assert_ok_path(repaired, rev_dir)
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_blobs_valid(cache_dir)
    assert proxy.stats().bytes_for(shard) >= pub.model.sizes[shard], "the shard was not re-fetched"
    again = wc.run("verify", target, "--cache-dir", cache_dir)
    assert again.returncode == 0, describe(again)


@pytest.mark.timeout(120)
def test_gc_dry_run_prints_the_plan_and_changes_nothing(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    old = publish([1 * MiB], name="old", rev="r1", seed="old")
    new = publish([1 * MiB], name="new", rev="r1", seed="new")
    for pub in (old, new):
        assert_ok_path(wc.fetch(pub.source, cache_dir), pub.local_path(cache_dir))

    def tree() -> dict[str, tuple[int, int]]:
        """The whole tree but SQLite's own files: opening a WAL database (as `ls` does)
        creates and removes state.db-wal/-shm, which also bumps their directory's mtime."""
        return {k: v for k, v in snapshot(cache_dir).items()
                if k != ".weightcache" and not k.startswith(".weightcache/state.db")}  # fmt: skip

    before_tree, before_ls = tree(), ls_json(wc, cache_dir)

    dry = wc.run("gc", "--dry-run", "--capacity", "1B", "--cache-dir", cache_dir)
    assert dry.returncode == 0, describe(dry)
    assert "old/r1" in dry.stdout and "new/r1" in dry.stdout, describe(dry)
    assert tree() == before_tree
    assert ls_json(wc, cache_dir) == before_ls
    for pub in (old, new):
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)

    # A bound both fit under: the plan is to evict nothing.
    roomy = wc.run("gc", "--dry-run", "--capacity", "1G", "--cache-dir", cache_dir)
    assert roomy.returncode == 0, describe(roomy)
    assert "old/r1" not in roomy.stdout and "new/r1" not in roomy.stdout, describe(roomy)

    # The same plan for real does what the dry run said.
    real = wc.run("gc", "--capacity", "1B", "--cache-dir", cache_dir)
    assert real.returncode == 0, describe(real)
    assert markers(cache_dir) == []


def _fetch_in_order(wc: CLI, cache_dir: Path, pubs: list[Published]) -> None:
    """Fetch each (a miss), in order, so that their last accesses are in that order."""
    for pub in pubs:
        assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), pub.local_path(cache_dir))
        time.sleep(0.05)  # distinct last-access times whatever the clock's resolution


@pytest.mark.timeout(120)
def test_gc_evicts_only_the_least_recently_used(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    a, b, c = (publish([1 * MiB], name=n, rev="r1", seed=n) for n in ("lru-a", "lru-b", "lru-c"))
    _fetch_in_order(wc, cache_dir, [a, b, c])
    # A hit on a makes b the least recently used.
    assert_ok_path(wc.fetch(a.source, cache_dir, "--no-daemon"), a.local_path(cache_dir))

    # Room for two of the three: exactly one goes, and it is b.
    gc = wc.run("gc", "--capacity", str(2 * MiB + MiB // 2), "--cache-dir", cache_dir)
    assert gc.returncode == 0, describe(gc)
    kept = {p.name for p in (a, b, c) if is_marked(cache_dir, p)}
    assert kept == {"lru-a", "lru-c"}, f"gc kept {kept}\n{describe(gc)}"
    assert not b.local_path(cache_dir).exists()
    for pub in (a, c):
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_blobs_valid(cache_dir)
    kept_blobs = set(a.model.hashes.values()) | set(c.model.hashes.values())
    present = {p.name for p in blobs_dir(cache_dir).iterdir()}
    assert kept_blobs <= present, "a blob of a kept revision was deleted"
    assert not (set(b.model.hashes.values()) - kept_blobs) & present, "b's blobs were kept"


@pytest.mark.timeout(120)
def test_gc_with_models_keeps_what_the_models_file_pins(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path, tmp_path: Path
) -> None:
    old, mid, new = (publish([1 * MiB], name=n, rev="r1", seed=n) for n in ("old", "mid", "new"))
    _fetch_in_order(wc, cache_dir, [old, mid, new])
    models = write_models(tmp_path / "models.yaml", [entry(old, pin=True), entry(mid)])

    # Room for one: without the pin the two oldest would go and `new` stay; with it, the
    # pinned (least recently used) one stays and the two others go.
    gc = wc.run("gc", "--capacity", str(MiB + MiB // 2), "--models", models,
                "--cache-dir", cache_dir)  # fmt: skip
    assert gc.returncode == 0, describe(gc)
    kept = {p.name for p in (old, mid, new) if is_marked(cache_dir, p)}
    assert kept == {"old"}, f"gc kept {kept}, not the pinned revision alone\n{describe(gc)}"
    assert_revision_ok(cache_dir, old.name, old.rev, old.model)


def _pod_uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def _end_leases(cache_dir: Path) -> None:
    """What the daemon's reaper does once the Pods are gone (no daemon runs here)."""
    with contextlib.closing(sqlite3.connect(cache_dir / ".weightcache" / "state.db")) as db:
        db.execute("DELETE FROM leases")
        db.commit()


@pytest.mark.timeout(600)
def test_gc_racing_leased_fetches_never_removes_a_printed_path(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    """Design §3 invariant 8: `gc --capacity 1` runs back to back in two loops while Pods fetch
    one revision (hits and misses, as gc keeps evicting it). A path printed with POD_UID
    set is leased before it is printed, so it is still complete when the fetch exits,
    and stays so through a later gc, until the lease ends."""
    pub = publish([256 * 1024] * 2, name="leased", rev="r1", seed="leased-race")
    rev_dir = pub.local_path(cache_dir)
    assert_ok_path(wc.fetch(pub.source, cache_dir), rev_dir)
    stop = threading.Event()
    gc_runs: list[int] = []

    def gc_loop() -> None:
        while not stop.is_set():
            g = wc.run("gc", "--capacity", "1B", "--cache-dir", cache_dir)
            assert g.returncode == 0, describe(g)
            gc_runs.append(1)

    loops = [threading.Thread(target=gc_loop, daemon=True) for _ in range(2)]
    for t in loops:
        t.start()
    rng = random.Random(9)
    outcomes: dict[str, int] = {"hit": 0, "miss": 0}
    try:
        for i in range(30):
            time.sleep(rng.uniform(0.0, 0.3))
            f = wc.fetch(pub.source, cache_dir, "--json", env={"POD_UID": _pod_uid(i)})
            assert f.returncode == 0, f"round {i}: {describe(f)}"
            printed = Path(json.loads(f.stdout)["path"])
            assert printed == rev_dir, describe(f)
            assert (printed / ".weightcache").is_file(), (
                f"round {i}: the path printed with a lease is gone (gc evicted it)"
            )
            assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
            outcomes["hit" if json.loads(f.stdout)["hit"] else "miss"] += 1
            if i % 2:  # every other Pod stays: the next fetch then races gc on a hit
                _end_leases(cache_dir)
    finally:
        stop.set()
        for t in loops:
            t.join(timeout=60)
    print(outcomes, "gc runs:", len(gc_runs))
    assert outcomes["hit"] and outcomes["miss"], outcomes  # both paths were raced
    assert_blobs_valid(cache_dir)
