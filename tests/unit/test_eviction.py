"""`eviction.plan_eviction` with literal tables: LRU order, pins, leases, shared blobs,
targets from the watermarks, and a plan that cannot reach its target (design §5)."""

from __future__ import annotations

import pytest

from weightcache.cache.eviction import CachedRevision, Watermarks, floor_target, plan_eviction

MB = 1_000_000


def rev(
    name: str, last_access: float, *blobs: str, pinned: bool = False, leased: bool = False
) -> CachedRevision:
    return CachedRevision(name, "r1", frozenset(blobs), last_access, pinned, leased)


# Four revisions of 10 MB each (one blob apiece), used at t=1, 2, 3, 4.
SIZES = {"a": 10 * MB, "b": 10 * MB, "c": 10 * MB, "d": 10 * MB}


def four(**flags: dict[str, bool]) -> list[CachedRevision]:
    """Revisions old (t=1, blob a), mid (t=2, b), new (t=3, c), newest (t=4, d), listed out
    of order so that only last_access can give the LRU order."""
    table = [("new", 3.0, "c"), ("old", 1.0, "a"), ("newest", 4.0, "d"), ("mid", 2.0, "b")]
    return [rev(n, t, blob, **flags.get(n, {})) for n, t, blob in table]


def keys(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple((n, "r1") for n in names)


@pytest.mark.parametrize(
    ("target", "evicted"),
    [
        (40 * MB, ()),  # already at the target: nothing
        (35 * MB, ("old",)),  # one is enough, and it is the least recently used
        (30 * MB, ("old",)),  # exactly at the target counts as enough
        (25 * MB, ("old", "mid")),
        (10 * MB, ("old", "mid", "new")),
        (0, ("old", "mid", "new", "newest")),
    ],
)
def test_least_recently_used_go_first_and_only_as_many_as_needed(
    target: int, evicted: tuple[str, ...]
) -> None:
    plan = plan_eviction(four(), SIZES, 40 * MB, target)
    assert plan.evict == keys(*evicted)
    assert plan.freed_bytes == 10 * MB * len(evicted)
    assert (plan.usage_before, plan.usage_after) == (40 * MB, 40 * MB - plan.freed_bytes)
    assert plan.sufficient


@pytest.mark.parametrize("flag", ["pinned", "leased"])
def test_pinned_or_leased_revisions_are_never_evicted(flag: str) -> None:
    # The two least recently used are protected: the next ones in LRU order go instead.
    revisions = four(old={flag: True}, mid={flag: True})
    plan = plan_eviction(revisions, SIZES, 40 * MB, 25 * MB)
    assert plan.evict == keys("new", "newest")
    assert set(plan.protected) == set(keys("old", "mid"))
    assert plan.sufficient


@pytest.mark.parametrize("flag", ["pinned", "leased"])
def test_not_enough_room_without_protected_revisions_is_insufficient(flag: str) -> None:
    revisions = four(old={flag: True}, mid={flag: True}, new={flag: True})
    plan = plan_eviction(revisions, SIZES, 40 * MB, 5 * MB)
    assert plan.evict == keys("newest")
    assert (plan.freed_bytes, plan.usage_after) == (10 * MB, 30 * MB)
    assert not plan.sufficient
    for name in ("old", "mid", "new"):
        assert (name, "r1") not in plan.evict


def test_everything_protected_evicts_nothing() -> None:
    revisions = [rev("p", 1.0, "a", pinned=True), rev("l", 2.0, "b", leased=True)]
    plan = plan_eviction(revisions, SIZES, 20 * MB, 0)
    assert plan.evict == ()
    assert plan.freed_bytes == 0
    assert not plan.sufficient


def test_a_blob_shared_with_a_kept_revision_frees_nothing() -> None:
    # old and new share blob "s" (30 MB); old also has "a" (10 MB). Evicting old frees only
    # "a"; the shared blob is freed once new goes too.
    sizes = {"s": 30 * MB, "a": 10 * MB, "b": 10 * MB}
    revisions = [rev("old", 1.0, "s", "a"), rev("new", 2.0, "s", "b")]
    assert plan_eviction(revisions, sizes, 50 * MB, 40 * MB).evict == keys("old")
    plan = plan_eviction(revisions, sizes, 50 * MB, 35 * MB)
    assert plan.evict == keys("old", "new")
    assert plan.freed_bytes == 50 * MB


def test_a_shared_blob_with_a_protected_revision_is_never_counted_as_freed() -> None:
    sizes = {"s": 30 * MB, "a": 10 * MB}
    revisions = [rev("old", 1.0, "s", "a"), rev("pinned", 2.0, "s", pinned=True)]
    plan = plan_eviction(revisions, sizes, 40 * MB, 0)
    assert plan.evict == keys("old")
    assert plan.freed_bytes == 10 * MB
    assert not plan.sufficient


def test_usage_beyond_the_revisions_counts_but_cannot_be_freed() -> None:
    # 15 MB of partial downloads: only the revisions' blobs can be evicted.
    plan = plan_eviction(four(), SIZES, 55 * MB, 10 * MB)
    assert plan.evict == keys("old", "mid", "new", "newest")
    assert plan.usage_after == 15 * MB
    assert not plan.sufficient


def test_ties_in_last_access_break_by_name_for_a_stable_plan() -> None:
    revisions = [rev("b", 1.0, "b"), rev("a", 1.0, "a"), rev("c", 0.5, "c")]
    assert plan_eviction(revisions, SIZES, 30 * MB, 15 * MB).evict == keys("c", "a")


def test_a_target_from_the_watermarks() -> None:
    # Capacity 50 MB: the low watermark (0.85) is 42.5 MB, so 50 MB of usage evicts one.
    marks = Watermarks()
    capacity = 50 * MB
    usage = 50 * MB
    assert usage > capacity * marks.high
    sizes = {**SIZES, "e": 10 * MB}
    revisions = [*four(), rev("latest", 5.0, "e")]
    plan = plan_eviction(revisions, sizes, usage, int(capacity * marks.low))
    assert plan.evict == keys("old")
    assert plan.usage_after == 40 * MB


@pytest.mark.parametrize(("high", "low"), [(0.8, 0.9), (1.1, 0.5), (0.9, 0.0), (0.9, -0.1)])
def test_watermarks_out_of_order_or_range_are_refused(high: float, low: float) -> None:
    with pytest.raises(ValueError, match="watermarks"):
        Watermarks(high, low)


# -- the --min-free floor: free space on the disk, other files counted -----


@pytest.mark.parametrize(
    ("usage", "need", "free", "min_free", "target"),
    [
        (40 * MB, 10 * MB, 100 * MB, 20 * MB, 40 * MB),  # room to spare: evict nothing
        (40 * MB, 10 * MB, 30 * MB, 20 * MB, 40 * MB),  # 30 - 10 = 20 left: exactly the floor
        (40 * MB, 10 * MB, 25 * MB, 20 * MB, 35 * MB),  # 5 MB short: evict 5 MB of cache
        (40 * MB, 0, 5 * MB, 20 * MB, 25 * MB),  # other files filled the disk: 15 MB short
        (40 * MB, 10 * MB, 0, 50 * MB, -20 * MB),  # even an empty cache cannot keep it
        (40 * MB, 10 * MB, 5 * MB, 0, 35 * MB),  # floor off: the download itself must fit
    ],
)
def test_floor_target_keeps_min_free_after_the_download(
    usage: int, need: int, free: int, min_free: int, target: int
) -> None:
    assert floor_target(usage, need, free, min_free) == target


def test_other_files_filling_the_disk_make_the_plan_evict_for_the_floor() -> None:
    # A 100 MB disk, the cache holds 40 MB (4 revisions), other files 45 MB: 15 MB free.
    # A 10 MB download with a 20 MB floor needs 15 MB freed: the two least recently used.
    target = floor_target(40 * MB, 10 * MB, 15 * MB, 20 * MB)
    plan = plan_eviction(four(), SIZES, 40 * MB, target)
    assert (target, plan.evict, plan.sufficient) == (25 * MB, keys("old", "mid"), True)


def test_a_floor_that_pins_and_leases_prevent_is_insufficient() -> None:
    # Only "old" and "mid" are evictable; the floor wants 35 MB freed.
    target = floor_target(40 * MB, 10 * MB, 0, 25 * MB)
    plan = plan_eviction(four(new={"pinned": True}, newest={"leased": True}), SIZES, 40 * MB,
                         target)  # fmt: skip
    assert plan.evict == keys("old", "mid") and plan.freed_bytes == 20 * MB
    assert not plan.sufficient
