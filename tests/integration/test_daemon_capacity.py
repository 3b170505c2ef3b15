"""The daemon's capacity bound (design §5): LRU eviction of unpinned, unleased revisions,
shared blobs kept, exit 5 when nothing evictable is enough, leases ending with their Pod."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    entry,
    is_marked,
    ls_json,
    wait_for,
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    markers,
)
from tests.support.faultproxy import FaultProxy

POD_L = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"  # the Pod that leases L (a Kubernetes UID)
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
          "KB": 10**3, "MB": 10**6, "GB": 10**9}  # fmt: skip


def sizes_in(message: str) -> list[float]:
    """Every size written in a message ("10.0MiB", "8 MB", "10485760 bytes"), in bytes."""
    found = [float(n) * _UNITS[u] for n, u in
             re.findall(r"(\d+(?:\.\d+)?)\s*(GiB|MiB|KiB|GB|MB|KB|B)\b", message)]  # fmt: skip
    found += [float(n) for n in re.findall(r"(\d+)\s*bytes", message)]
    return found


def mentions_size(message: str, nbytes: int, rel: float = 0.02) -> bool:
    return any(abs(s - nbytes) <= rel * nbytes for s in sizes_in(message))


@pytest.mark.timeout(180)
def test_capacity_evicts_lru_never_pinned_or_leased(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    # Each model has its own seed, so nothing is shared but what shard_seeds says: the
    # first shard of L and A is the same content (one blob, two revisions).
    pinned = publish([4 * MiB], name="pinned", rev="r1", seed="P")
    leased = publish([2 * MiB, 2 * MiB], name="leased", rev="r1", seed="L",
                     shard_seeds=["shared", "L-own"])  # fmt: skip
    lru = publish([2 * MiB, 2 * MiB], name="lru", rev="r1", seed="A",
                  shard_seeds=["shared", "A-own"])  # fmt: skip
    touched = publish([4 * MiB], name="touched", rev="r1", seed="B")
    newcomer = publish([4 * MiB], name="newcomer", rev="r1", seed="C")
    late = publish([4 * MiB], name="late", rev="r1", seed="D")
    huge = publish([5 * MiB, 5 * MiB], name="huge", rev="r1", seed="X")
    shared_blob = leased.model.hashes["model-00001-of-00002.safetensors"]
    assert lru.model.hashes["model-00001-of-00002.safetensors"] == shared_blob
    lru_own_blob = lru.model.hashes["model-00002-of-00002.safetensors"]
    leased_own_blob = leased.model.hashes["model-00002-of-00002.safetensors"]

    # P, L, A, B hold 14 MiB (the shared shard once) plus a few KiB of JSON. 16.5 MiB
    # fits them and leaves room for C only after evicting A (frees 2 MiB), and the high
    # watermark (0.99 x 16.5 MiB) stays above the 16 MiB of P, L, B, C: every eviction in
    # this test is one the fetches asked for.
    capacity = 16 * MiB + MiB // 2
    pods = tmp_path / "pods"
    (pods / POD_L).mkdir(parents=True)
    models = write_models(tmp_path / "models.yaml", [entry(pinned, pin=True)])
    watermarks = ["--high-watermark", "0.99", "--low-watermark", "0.9"]
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, capacity=str(capacity),
                           pods_dir=pods, extra=watermarks)  # fmt: skip
    wait_for("the pinned model", daemon.pins_ready, timeout=30)

    def fetch(pub: Published, pod_uid: str | None = None) -> None:
        env = {"POD_UID": pod_uid} if pod_uid else {"POD_UID": None}
        proc = wc.fetch(pub.source, cache_dir, endpoint=proxy.url, env=env)
        assert_ok_path(proc, pub.local_path(cache_dir))

    fetch(leased, pod_uid=POD_L)  # the oldest after P, but a running Pod uses it
    fetch(touched)
    fetch(lru)
    fetch(touched)  # a hit: B is now more recent than A, so A is the LRU evictable one
    rows = ls_json(wc, cache_dir)
    assert rows[(leased.name, leased.rev)]["leases"] == [POD_L], rows
    assert rows[(pinned.name, pinned.rev)]["last_access"] < rows[(leased.name, leased.rev)][
        "last_access"] < rows[(lru.name, lru.rev)]["last_access"] < rows[
        (touched.name, touched.rev)]["last_access"], rows  # fmt: skip
    assert len(markers(cache_dir)) == 4

    # C needs room: exactly A goes. P (pinned) and L (leased) are older but protected.
    fetch(newcomer)
    assert not is_marked(cache_dir, lru), "the LRU unpinned, unleased revision stayed"
    assert not lru.local_path(cache_dir).exists()
    for pub in (pinned, leased, touched, newcomer):
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    # A's own shard is freed; the shard it shared with L stays (L links it).
    assert (blobs_dir(cache_dir) / shared_blob).is_file()
    assert not (blobs_dir(cache_dir) / lru_own_blob).exists()
    assert_blobs_valid(cache_dir)

    # X (10 MiB) cannot fit: evicting B and C frees ~8 MiB of the 10 it needs.
    before = ls_json(wc, cache_dir)
    proc = wc.fetch(huge.source, cache_dir, endpoint=proxy.url, env={"POD_UID": None})
    message = assert_fails(proc, 5)
    assert re.search(r"need", message, re.I), message
    assert re.search(r"free", message, re.I), message
    assert mentions_size(message, huge.model.total_size), (
        f"the message does not say how much the revision needs "
        f"({huge.model.total_size} bytes): {message}"
    )
    freeable = touched.model.total_size + newcomer.model.total_size
    assert mentions_size(message, freeable), (
        f"the message does not say how much could be freed ({freeable} bytes): {message}"
    )
    # ...and nothing was evicted for it.
    for pub in (pinned, leased, touched, newcomer):
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert not huge.local_path(cache_dir).exists()
    assert set(ls_json(wc, cache_dir)) == set(before)

    # The Pod is gone: its lease ends, and L (now the LRU) is the one D's room comes from.
    (pods / POD_L).rmdir()

    def lease_ended() -> bool:
        return bool(ls_json(wc, cache_dir)[(leased.name, leased.rev)]["leases"] == [])

    wait_for("the lease of the deleted Pod to end", lease_ended, timeout=15, every=0.3)
    assert all(row["leases"] == [] for row in ls_json(wc, cache_dir).values())
    fetch(late)
    assert not is_marked(cache_dir, leased), "the revision whose Pod is gone was not evicted"
    for pub in (pinned, touched, newcomer, late):
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert not (blobs_dir(cache_dir) / shared_blob).exists()
    assert not (blobs_dir(cache_dir) / leased_own_blob).exists()
    assert_blobs_valid(cache_dir)

    m = daemon.metrics()
    assert m["weightcache_evictions_total"] == 2, m
    assert m["weightcache_cache_capacity_bytes"] == capacity, m
    assert m["weightcache_cache_bytes"] <= capacity, m
    assert daemon.alive(), daemon.log()
