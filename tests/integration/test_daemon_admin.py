"""Operator commands on a live cache (SPEC §2, §3 inv. 1, §5): `gc` racing `fetch`,
`verify` catching and un-marking damage that the next `fetch` repairs, `gc --dry-run`."""

from __future__ import annotations

import os
import random
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import MiB, is_marked, ls_json
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
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
        gc_args = ("gc", "--capacity", "1", "--cache-dir", cache_dir)
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

    dry = wc.run("gc", "--dry-run", "--capacity", "1", "--cache-dir", cache_dir)
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
    real = wc.run("gc", "--capacity", "1", "--cache-dir", cache_dir)
    assert real.returncode == 0, describe(real)
    assert markers(cache_dir) == []
