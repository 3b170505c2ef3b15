"""More tables for the pure eviction plan (weightcache/cache/eviction.py, design §5
Capacity), beyond tests/unit/test_eviction.py: revisions sharing blobs in chains, blobs the
survey could not size, revisions of one name, the plan's own arithmetic and its one-line
description (what `gc` prints and the daemon logs), and the watermark bounds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from weightcache.cache.eviction import CachedRevision, EvictionPlan, Watermarks, plan_eviction

Key = tuple[str, str]


def rev(
    key: str, t: float, *blobs: str, pinned: bool = False, leased: bool = False
) -> CachedRevision:
    """`key` is "name/revision"."""
    name, revision = key.split("/")
    return CachedRevision(name, revision, frozenset(blobs), t, pinned, leased)


def label(r: CachedRevision) -> str:
    return f"{r.name}/{r.revision}"


def keys(*labels: str) -> tuple[Key, ...]:
    return tuple((label.split("/")[0], label.split("/")[1]) for label in labels)


# A chain: m/1 {a, s1}, m/2 {s1, s2}, m/3 {s2, c}: neighbours share a shard; sizes are
# distinct powers of two so that every sum names its blobs.
CHAIN = [rev("m/1", 1.0, "a", "s1"), rev("m/2", 2.0, "s1", "s2"), rev("m/3", 3.0, "s2", "c")]
CHAIN_SIZES = {"a": 1, "s1": 2, "s2": 4, "c": 8}  # 15 bytes in all


@pytest.mark.parametrize(
    ("target", "evicted", "freed"),
    [
        pytest.param(15, (), 0, id="at-target"),
        pytest.param(14, ("m/1",), 1, id="oldest-frees-only-its-own"),  # s1 kept by m/2
        pytest.param(13, ("m/1", "m/2"), 3, id="second-frees-s1"),  # s2 kept by m/3
        pytest.param(12, ("m/1", "m/2"), 3, id="exactly-reached"),
        pytest.param(11, ("m/1", "m/2", "m/3"), 15, id="all"),
        pytest.param(-5, ("m/1", "m/2", "m/3"), 15, id="negative-target"),
    ],
)
def test_a_chain_of_shared_shards_frees_each_blob_with_its_last_link(
    target: int, evicted: tuple[str, ...], freed: int
) -> None:
    plan = plan_eviction(CHAIN, CHAIN_SIZES, 15, target)
    assert plan.evict == keys(*evicted)
    assert (plan.freed_bytes, plan.usage_after) == (freed, 15 - freed)
    assert plan.sufficient == (15 - freed <= target)


@pytest.mark.parametrize(
    ("flags", "evicted", "freed"),
    [
        pytest.param({"m/2": "pinned"}, ("m/1", "m/3"), 1 + 8, id="middle-pinned"),
        pytest.param({"m/1": "leased", "m/3": "leased"}, ("m/2",), 0, id="ends-leased"),
        pytest.param({"m/1": "pinned", "m/2": "leased", "m/3": "pinned"}, (), 0, id="all"),
    ],
)
def test_a_protected_revision_keeps_the_shards_it_shares(
    flags: dict[str, str], evicted: tuple[str, ...], freed: int
) -> None:
    revisions = [
        replace(r, pinned=flags.get(label(r)) == "pinned", leased=flags.get(label(r)) == "leased")
        for r in CHAIN
    ]
    plan = plan_eviction(revisions, CHAIN_SIZES, 15, 0)
    assert plan.evict == keys(*evicted)
    assert plan.freed_bytes == freed
    assert plan.protected == tuple(sorted(keys(*flags)))
    assert not plan.sufficient


def test_a_blob_the_survey_could_not_size_frees_nothing_and_still_evicts() -> None:
    # "gone" vanished between the listing and its stat (survey skips it): its revision is
    # evicted like any other, and only the sized blobs count as freed.
    revisions = [rev("m/old", 1.0, "gone", "a"), rev("m/new", 2.0, "b")]
    plan = plan_eviction(revisions, {"a": 10, "b": 20}, 30, 15)
    assert plan.evict == keys("m/old", "m/new")
    assert plan.freed_bytes == 30
    plan = plan_eviction([rev("m/x", 1.0, "gone")], {}, 5, 0)
    assert (plan.evict, plan.freed_bytes, plan.usage_after) == (keys("m/x"), 0, 5)


def test_a_revision_without_blobs_is_evicted_for_nothing() -> None:
    # An empty model (a manifest listing nothing) is a revision like any other in LRU order.
    plan = plan_eviction([rev("e/1", 1.0), rev("m/1", 2.0, "a")], {"a": 7}, 7, 0)
    assert plan.evict == keys("e/1", "m/1")
    assert plan.freed_bytes == 7


@pytest.mark.parametrize(
    ("revisions", "evicted"),
    [
        pytest.param(
            [rev("m/b", 1.0, "b"), rev("m/a", 1.0, "a")], ("m/a",), id="same-name-tie-by-revision"
        ),
        pytest.param(
            [rev("z/a", 1.0, "b"), rev("a/z", 1.0, "a")], ("a/z",), id="name-before-revision"
        ),
        pytest.param([rev("a/a", 2.0, "a"), rev("z/z", 1.0, "b")], ("z/z",), id="time-before-name"),
    ],
)
def test_ties_break_by_name_then_revision(
    revisions: list[CachedRevision], evicted: tuple[str, ...]
) -> None:
    assert plan_eviction(revisions, {"a": 5, "b": 5}, 10, 5).evict == keys(*evicted)


def test_protected_is_sorted_and_counts_pinned_and_leased_once() -> None:
    revisions = [
        rev("z/1", 1.0, "a", pinned=True),
        rev("a/2", 2.0, "b", leased=True),
        rev("a/1", 3.0, "c", pinned=True, leased=True),
    ]
    plan = plan_eviction(revisions, {"a": 1, "b": 1, "c": 1}, 3, 0)
    assert plan.protected == keys("a/1", "a/2", "z/1")
    assert plan.evict == ()


def test_the_plan_takes_any_iterable_once() -> None:
    # A generator (the daemon's survey may stream): read once, used for links and candidates.
    plan = plan_eviction((r for r in CHAIN), CHAIN_SIZES, 15, 0)
    assert plan.evict == keys("m/1", "m/2", "m/3")
    assert plan.freed_bytes == 15


@pytest.mark.parametrize(
    ("plan", "text"),
    [
        pytest.param(
            EvictionPlan(keys("m/1", "q/r2"), 30, 100, 70, 80, ()),
            "evict m/1, q/r2: frees 30 bytes, usage 100 -> 70 (target 80)",
            id="two",
        ),
        pytest.param(
            EvictionPlan((), 0, 50, 50, 80, keys("m/1")),
            "evict nothing: frees 0 bytes, usage 50 -> 50 (target 80)",
            id="nothing",
        ),
    ],
)
def test_the_description_is_one_line_with_the_numbers(plan: EvictionPlan, text: str) -> None:
    assert plan.describe() == text


@pytest.mark.parametrize(
    ("usage_after", "target", "sufficient"),
    [(79, 80, True), (80, 80, True), (81, 80, False), (0, -1, False)],
)
def test_sufficient_means_at_or_below_the_target(
    usage_after: int, target: int, sufficient: bool
) -> None:
    assert EvictionPlan((), 0, usage_after, usage_after, target, ()).sufficient is sufficient


@pytest.mark.parametrize(
    ("high", "low"),
    [
        pytest.param(0.95, 0.85, id="defaults"),
        pytest.param(0.9, 0.9, id="low-equals-high"),
        pytest.param(1.0, 0.5, id="high-is-the-whole-capacity"),
        pytest.param(1.0, 1.0, id="both-one"),
        pytest.param(0.01, 0.001, id="tiny"),
    ],
)
def test_watermarks_in_range_are_accepted(high: float, low: float) -> None:
    marks = Watermarks(high, low)
    assert (marks.high, marks.low) == (high, low)


@pytest.mark.parametrize(
    ("high", "low"),
    [
        pytest.param(1.0001, 0.5, id="high-above-one"),
        pytest.param(0.5, 0.5001, id="low-above-high"),
        pytest.param(0.5, 0.0, id="low-zero"),
        pytest.param(0.0, 0.0, id="both-zero"),
    ],
)
def test_watermarks_out_of_range_say_the_rule(high: float, low: float) -> None:
    with pytest.raises(ValueError, match=r"^watermarks must satisfy 0 < low <= high <= 1$"):
        Watermarks(high, low)


def test_a_revision_is_neither_pinned_nor_leased_unless_said() -> None:
    # The flags default to unprotected: a caller that leaves them out gets an evictable one.
    r = CachedRevision("m", "1", frozenset({"a"}), 1.0)
    assert (r.pinned, r.leased) == (False, False)
    plan = plan_eviction([r], {"a": 1}, 1, 0)
    assert (plan.evict, plan.protected) == (keys("m/1"), ())
