"""CapacityGuard in-process: the daemon's capacity role on a tmp cache dir, disk numbers
given (design §5, Capacity and Free-space floor)."""

from __future__ import annotations

import pytest

from tests.support.cached import add_revision
from weightcache.cache.eviction import Watermarks
from weightcache.cache.index import Index, for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache
from weightcache.config import Capacity
from weightcache.daemon.capacity import CapacityGuard
from weightcache.daemon.metrics import Metrics
from weightcache.errors import NoSpaceError

POD = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
BIG_DISK = (10**12, 10**12)  # (size, free): only --capacity binds


@pytest.fixture
def cache(layout: Layout) -> Cache:
    """Revisions old (used at t=1), mid (t=2) and new (t=3), 100 bytes each."""
    cache = Cache(layout)
    for name, used_at in (("new", 3.0), ("old", 1.0), ("mid", 2.0)):
        add_revision(cache, name, "r1", 100, used_at=used_at)
    return cache


def guard(
    cache: Cache,
    capacity: int | None = 300,
    min_free: int = 0,
    disk: tuple[int, int] = BIG_DISK,
    pinned: frozenset[tuple[str, str]] = frozenset(),
) -> CapacityGuard:
    return CapacityGuard(
        cache,
        for_cache(cache.layout),
        Metrics(),
        capacity=None if capacity is None else Capacity(bytes=capacity),
        min_free=Capacity(bytes=min_free),
        watermarks=Watermarks(),
        pinned=lambda: pinned,
        disk_space=lambda: disk,
    )


def present(cache: Cache) -> set[str]:
    return {name for name, _ in cache.layout.revisions() if cache.ready(name, "r1")}


def test_make_room_evicts_the_least_recently_used_revision_only(cache: Cache) -> None:
    g = guard(cache)
    g.make_room(100)
    assert present(cache) == {"mid", "new"}
    assert g.metrics.registry.get_sample_value("weightcache_evictions_total") == 1
    assert g.metrics.registry.get_sample_value("weightcache_cache_bytes") == 200


def test_make_room_never_evicts_a_pinned_revision(cache: Cache) -> None:
    guard(cache, pinned=frozenset({("old", "r1")})).make_room(100)
    assert present(cache) == {"old", "new"}


def test_make_room_never_evicts_a_leased_revision(cache: Cache) -> None:
    index: Index = for_cache(cache.layout)
    index.lease("old", "r1", POD)
    guard(cache).make_room(200)
    assert present(cache) == {"old"}


def test_make_room_that_cannot_be_made_is_exit_5_and_evicts_nothing(cache: Cache) -> None:
    for name in ("old", "mid", "new"):
        for_cache(cache.layout).lease(name, "r1", POD)
    with pytest.raises(NoSpaceError, match="raise --capacity") as e:
        guard(cache).make_room(100)
    assert e.value.exit_code == 5
    assert present(cache) == {"old", "mid", "new"}


def test_make_room_keeps_the_free_space_floor_without_a_capacity(cache: Cache) -> None:
    # 1000-byte disk, 150 free, 200 kept free: 100 more bytes need 150 evicted (2 revisions).
    guard(cache, capacity=None, min_free=200, disk=(1000, 150)).make_room(100)
    assert present(cache) == {"new"}


def test_enforce_evicts_from_above_the_high_watermark_down_to_the_low_one(cache: Cache) -> None:
    # 300 of 310 is above 95%: down to 85% (263), one revision.
    g = guard(cache, capacity=310)
    g.enforce()
    assert present(cache) == {"mid", "new"}
    assert g.metrics.registry.get_sample_value("weightcache_cache_capacity_bytes") == 310


def test_enforce_below_the_high_watermark_evicts_nothing(cache: Cache) -> None:
    guard(cache, capacity=400).enforce()
    assert present(cache) == {"old", "mid", "new"}


def test_enforce_restores_the_free_space_floor_when_other_files_grew(cache: Cache) -> None:
    guard(cache, capacity=None, min_free=200, disk=(1000, 150)).enforce()  # 50 short
    assert present(cache) == {"mid", "new"}


def test_orphan_blobs_are_collected_first(cache: Cache, layout: Layout) -> None:
    orphan = layout.blob("0" * 64)
    orphan.write_bytes(b"x" * 50)
    g = guard(cache, capacity=None)
    g.enforce()
    assert not orphan.exists()
    assert present(cache) == {"old", "mid", "new"}
    assert g.metrics.registry.get_sample_value("weightcache_cache_bytes") == 300


def test_an_eviction_the_index_cannot_record_still_frees_its_space(
    cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk, SQLite may fail to commit the removal of an entry after the
    revision was moved out of place: the eviction completes (its trash and blobs go), or
    the space it was for stays taken by a revision no one can use."""
    import sqlite3

    from weightcache.cache import eviction

    marker = add_revision(cache, "m", "r1", 1000)
    index = for_cache(cache.layout)
    revisions, sizes, usage = eviction.survey(cache, index, frozenset())
    plan = eviction.plan_eviction(revisions, sizes, usage, 0)
    real = Index.remove_unless_protected

    def full(self: Index, name: str, revision: str, remove: object) -> bool:
        real(self, name, revision, lambda: None)  # the lease check, as on a full disk
        remove()  # type: ignore[operator]
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Index, "remove_unless_protected", full)
    assert eviction.execute(plan, cache, index) == plan.freed_bytes == usage  # the fixture's too
    assert not any(cache.layout.revision_dir(*key).exists() for key in plan.evict)
    assert list(cache.layout.tmp.iterdir()) == []  # no trash left behind
    [(digest, _)] = marker.files.values()
    assert not cache.layout.blob(digest).exists()


def test_survey_counts_the_index_pins_with_the_callers(cache: Cache) -> None:
    """Pins reach the planner from both places: the daemon's models file (the caller) and
    the index (`gc` run beside a daemon that pinned them)."""
    from weightcache.cache import eviction

    index = for_cache(cache.layout)
    index.set_pins({("mid", "r1")})
    revisions, _, _ = eviction.survey(cache, index, frozenset({("new", "r1")}))
    assert {r.name for r in revisions if r.pinned} == {"mid", "new"}


def test_survey_skips_a_revision_directory_without_a_marker(cache: Cache) -> None:
    # "aaa" sorts first: an unmarked directory neither ends the listing nor fails it.
    from weightcache.cache import eviction

    cache.layout.revision_dir("aaa", "r1").mkdir(parents=True)
    revisions, _, _ = eviction.survey(cache, for_cache(cache.layout))
    assert sorted(r.name for r in revisions) == ["mid", "new", "old"]


def test_execute_skips_a_revision_whose_lock_a_fetch_holds(cache: Cache) -> None:
    from weightcache.cache import eviction
    from weightcache.cache.locks import FileLock

    index = for_cache(cache.layout)
    plan = eviction.plan_eviction(*eviction.survey(cache, index), 100)
    assert plan.evict == (("old", "r1"), ("mid", "r1"))
    fetch = FileLock(cache.layout.revision_lock("old", "r1"), "old/r1")
    assert fetch.try_acquire()
    try:
        assert eviction.execute(plan, cache, index) == 100
    finally:
        fetch.release()
    assert present(cache) == {"old", "new"}


def test_execute_releases_the_lock_of_each_revision_it_evicts(cache: Cache) -> None:
    # A fetch of the same revision later must not wait forever for the evictor's lock.
    from weightcache.cache import eviction
    from weightcache.cache.locks import FileLock

    index = for_cache(cache.layout)
    plan = eviction.plan_eviction(*eviction.survey(cache, index), 200)
    assert eviction.execute(plan, cache, index) == 100
    fetch = FileLock(cache.layout.revision_lock("old", "r1"), "old/r1")
    assert fetch.try_acquire()
    fetch.release()


def test_execute_skips_a_revision_leased_since_the_plan(cache: Cache) -> None:
    from weightcache.cache import eviction

    index = for_cache(cache.layout)
    plan = eviction.plan_eviction(*eviction.survey(cache, index), 100)
    index.lease("old", "r1", POD)
    assert eviction.execute(plan, cache, index) == 100
    assert present(cache) == {"old", "new"}


def test_execute_keeps_a_revision_whose_leases_cannot_be_read(
    cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index that cannot be read cannot say the revision is unleased: it stays."""
    import sqlite3

    from weightcache.cache import eviction

    index = for_cache(cache.layout)
    plan = eviction.plan_eviction(*eviction.survey(cache, index), 200)

    def unreadable(self: Index, name: str, revision: str, remove: object) -> bool:
        raise sqlite3.DatabaseError("file is not a database")

    monkeypatch.setattr(Index, "remove_unless_protected", unreadable)
    assert eviction.execute(plan, cache, index) == 0
    assert present(cache) == {"old", "mid", "new"}


def test_measure_disk_exports_free_space_and_the_floor(cache: Cache) -> None:
    """What WeightcacheDiskBelowMinFree compares: free bytes on the cache disk against the
    --min-free floor resolved on that disk."""
    g = CapacityGuard(
        cache, for_cache(cache.layout), Metrics(), capacity=None,
        min_free=Capacity(percent=20.0), watermarks=Watermarks(),
        disk_space=lambda: (1000, 150),
    )  # fmt: skip
    g.measure_disk()
    sample = g.metrics.registry.get_sample_value
    assert sample("weightcache_disk_free_bytes") == 150
    assert sample("weightcache_min_free_bytes") == 200
