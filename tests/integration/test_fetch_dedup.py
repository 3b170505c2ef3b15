"""Identical content downloads once per node: revisions share blobs (design §3 inv. 4, §8)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.support.checks import (
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
)
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024
SLACK = 64 * 1024


@pytest.mark.timeout(180)
def test_new_revision_downloads_only_the_changed_shard(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    sizes = [3 * MiB, 3 * MiB, 3 * MiB, 3 * MiB]
    old = publish(sizes, name="llm", rev="v1", seed="llm", shard_seeds=["a", "b", "c", "d"])
    new = publish([*sizes[:3], 2 * MiB + 5], name="llm", rev="v2", seed="llm",
                  shard_seeds=["a", "b", "c", "e"])  # fmt: skip
    changed = new.model.shard_names()[3]
    assert old.model.hashes[changed] != new.model.hashes[changed]
    shared = [p for p in new.model.hashes if new.model.hashes[p] == old.model.hashes.get(p)]
    assert len(shared) == 5  # three shards, config.json, tokenizer.json

    assert_ok_path(wc.fetch(old.source, cache_dir, "--part-size", "1M", endpoint=proxy.url),
                   old.local_path(cache_dir))  # fmt: skip
    proxy.reset_stats()
    assert_ok_path(wc.fetch(new.source, cache_dir, "--part-size", "1M", endpoint=proxy.url),
                   new.local_path(cache_dir))  # fmt: skip

    s = proxy.stats()
    changed_size = new.model.sizes[changed]
    assert changed_size <= s.body_bytes <= changed_size + SLACK, (
        f"{s.body_bytes} bytes from the store; only {changed} ({changed_size}) changed; "
        f"per path: {s.path_bytes}"
    )
    for rel in shared:
        assert s.bytes_for("/" + rel) == 0, f"{rel} downloaded again"

    for pub in (old, new):
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
        assert_linked_to_blobs(cache_dir, pub.name, pub.rev, pub.model)
    for rel in shared:
        blob = blobs_dir(cache_dir) / new.model.hashes[rel]
        a, b = old.local_path(cache_dir) / rel, new.local_path(cache_dir) / rel
        assert a.stat().st_ino == b.stat().st_ino == blob.stat().st_ino, rel
        assert blob.stat().st_nlink >= 3, rel
    blobs = {p.name for p in blobs_dir(cache_dir).iterdir()}
    assert blobs == set(old.model.hashes.values()) | set(new.model.hashes.values())


@pytest.mark.timeout(120)
def test_identical_files_within_one_revision_share_one_blob(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """Two manifest entries with the same content: one download, one blob, two links."""
    pub = publish([2 * MiB, 2 * MiB], name="twin", rev="r", shard_seeds=["same", "same"])
    a, b = pub.model.shard_names()
    assert pub.model.hashes[a] == pub.model.hashes[b]
    proc = wc.fetch(pub.source, cache_dir, "--part-size", "1M", endpoint=proxy.url)
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    rev = pub.local_path(cache_dir)
    assert os.path.samefile(rev / a, rev / b)
    assert proxy.stats().body_bytes <= pub.model.total_size - 2 * MiB + SLACK
