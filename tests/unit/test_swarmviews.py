"""swarm.views: the bounded view of a blob's swarm (which peers a node watches) and the idle
rule's scope with a partial view (pure decisions, and `PeerViews` over a fixed list)."""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import Any, cast

import pytest

from weightcache.config import PeerSettings
from weightcache.fetch.blobs import SwarmMembers
from weightcache.swarm import views as swarmviews
from weightcache.swarm.bitsets import iter_bits
from weightcache.swarm.choice import (
    ORIGIN,
    Local,
    PeerView,
    Request,
    RequestLimits,
    StoreView,
    stripe,
)
from weightcache.swarm.client import Peers
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.views import (
    LATE_FACTOR,
    LATE_GRACE,
    MEMBER_TTL,
    Claims,
    Late,
    PeerViews,
    idle_requests,
    idle_scope,
    orphaned,
    unclaim,
    watch,
)
from weightcache.swarm.wire import PIECES

N = 16  # pieces


def bits(pieces: Iterable[int]) -> int:
    return sum(1 << p for p in set(pieces))


def peer(url: str, have: Iterable[int] = (), fetching: Iterable[int] = ()) -> PeerView:
    return PeerView(url, Bitmap.of(N, have), Bitmap.of(N, fetching))


# -- which peers to watch ------------------------------------------------------------------------


def test_a_small_membership_is_watched_whole_whatever_is_dropped() -> None:
    members = [f"p{i}" for i in range(5)]
    assert watch(members, [], {"p1"}, 5, random.Random(1)) == members


def test_a_large_membership_is_sampled_up_to_the_bound() -> None:
    members = [f"p{i:03}" for i in range(1000)]
    seen = set()
    for seed in range(5):
        got = watch(members, [], (), 32, random.Random(seed))
        assert len(got) == len(set(got)) == 32 and set(got) <= set(members)
        seen |= set(got)
    assert len(seen) > 100  # random samples, not the first 32


def test_watched_peers_are_kept_and_those_dropped_or_gone_replaced() -> None:
    members = [f"p{i:02}" for i in range(40)]
    first = watch(members, [], (), 8, random.Random(1))
    dead, left = first[0], first[1]
    listed = [m for m in members if m != left]  # left discovery; `dead` is shunned or gone
    again = watch(listed, first, {dead}, 8, random.Random(2))
    assert len(again) == 8 and dead not in again and left not in again
    assert again[:6] == first[2:]  # the others stay watched


def test_one_watched_peer_not_serving_pieces_is_rotated_out_each_round() -> None:
    members = [f"p{i:02}" for i in range(40)]
    first = watch(members, [], (), 8, random.Random(1))
    busy = first[:7]  # all but one serve this node pieces: the eighth is rotated
    again = watch(members, first, (), 8, random.Random(2), rotate=1, busy=busy)
    assert again[:7] == busy and again[7] != first[7] and again[7] not in first
    everyone = set()
    for seed in range(200):  # every member gets its turn in the view
        first = watch(members, first, (), 8, random.Random(seed), rotate=1)
        everyone |= set(first)
    assert everyone == set(members)


def test_fewer_than_the_bound_when_the_others_are_all_dropped() -> None:
    members = [f"p{i}" for i in range(10)]
    assert sorted(watch(members, [], members[3:], 4, random.Random(1))) == members[:3]


# -- claims that do not become pieces ------------------------------------------------------------


def test_a_claim_expires_unless_it_becomes_a_piece_and_each_peer_s_claim_is_its_own() -> None:
    claims = Claims()
    claims.saw([peer("a", fetching=[1, 2, 3]), peer("b", have=[5], fetching=[5])], 100.0)
    assert claims.expired(103.9, 4.0) == {}
    claims.saw([peer("a", have=[1], fetching=[2, 3, 4]), peer("b", fetching=[2])], 102.0)
    # a's 1 became a piece; its 2 and 3 are 4 s old; its 4 and b's 2 (claimed after a's
    # expired) are their own, younger; b's 5 is held: no claim
    assert claims.expired(104.0, 4.0) == {"a": bits([2, 3])}
    assert claims.expired(106.0, 4.0) == {"a": bits([2, 3, 4]), "b": bits([2])}
    claims.saw([peer("b")], 106.0)  # a out of view (left out): its claims are kept
    assert claims.expired(106.0, 4.0) == {"a": bits([2, 3, 4])}


def test_unclaimed_views_neither_fetch_nor_stream_their_expired_claims() -> None:
    a = PeerView("a", Bitmap.of(N, [0]), Bitmap.of(N, [1, 2]), 3, Bitmap.of(N, [1, 2]))
    b = peer("b", fetching=[1])
    out = unclaim([a, b], {"a": bits([1])})
    assert out[0] == PeerView("a", Bitmap.of(N, [0]), Bitmap.of(N, [2]), 3, Bitmap.of(N, [2]))
    assert out[1] is b
    # the store's again: a node whose stripe a claimed asks for it
    local = Local(Bitmap(N), {}, rank=0, nodes=3)
    asked = swarmviews.choose(local, out, StoreView(), RequestLimits(), random.Random(0))
    assert Request(0, "a") in asked and Request(1, ORIGIN) not in asked  # b still claims 1
    asked = swarmviews.choose(local, unclaim(out, {"b": bits([1])}), StoreView(), RequestLimits(),
                              random.Random(0))  # fmt: skip
    assert Request(1, ORIGIN) in asked


# -- the idle rule with a partial view -----------------------------------------------------------


def test_no_piece_is_late_before_the_swarm_showed_one() -> None:
    late = Late(100.0, N)
    late.saw(bits([3]), 0, 101.0)  # piece 3 in flight somewhere: nothing held yet
    assert late.late(200.0, 0, 4) == 0


def test_a_late_piece_is_asked_for_by_its_owner_s_successors_more_of_them_as_time_passes(
) -> None:  # fmt: skip
    # 16 nodes, one piece each: node r owns piece r
    late = Late(100.0, N)
    late.saw(bits([0, 1]), bits([0]), 102.0)  # the first piece showed after 2 s
    wait = max(LATE_GRACE, LATE_FACTOR * 2.0)
    late.saw(bits([1]), bits([0]), 102.0 + wait / 2)  # 1 stays seen a while longer

    def asked(t: float, rank: int) -> list[int]:
        return list(iter_bits(late.late(102.0 + t, rank, N)))

    assert asked(wait - 0.01, 5) == []
    # one period: the piece of the node just before (distance 1), and the own one
    assert asked(wait, 5) == [4, 5]
    assert asked(2 * wait, 5) == [3, 4, 5]  # distance 2
    assert asked(2 * wait, 2) == [0, 1, 2]  # piece 1 unseen 1.5 periods: distance 1 only
    assert asked(2 * wait, 3) == [2, 3]
    assert asked(3 * wait, 5) == [2, 3, 4, 5]  # distance 4 for piece 1 at 2.5 periods: no
    assert asked(6 * wait, 5) == list(range(N))  # 2 ** 5 >= 15: everyone asks for all


def test_late_pieces_with_fewer_pieces_than_nodes_belong_to_the_stripe_owners() -> None:
    late = Late(0.0, 4)  # 4 pieces among 10 nodes: owners 2, 4, 7, 9
    late.saw(0, bits([0]), 1.0)
    wait = max(LATE_GRACE, LATE_FACTOR * 1.0)
    assert [r for r in range(10) if late.late(1.0 + wait, r, 10) >> 2 & 1] == [7, 8]
    assert stripe(7, 10, 4) == bits([2])


def test_orphaned_stripes_are_those_of_members_gone() -> None:
    members = ["a", "b", "c", "d"]  # stripes of 4 pieces each
    assert orphaned(members, {"b", "d"}, N) == bits([4, 5, 6, 7, 12, 13, 14, 15])
    assert orphaned(members, (), N) == 0


def test_idle_scope_is_everything_with_a_whole_view_and_the_own_stripe_orphans_and_late_pieces_else(
) -> None:  # fmt: skip
    me = Local(Bitmap(N), {}, rank=1, nodes=4)
    assert idle_scope(False, me, 0, 0) == -1
    assert idle_scope(True, me, bits([12]), bits([0])) == bits([0, 4, 5, 6, 7, 12])


def test_an_idle_node_with_a_partial_view_asks_the_store_only_for_its_scope() -> None:
    # 8 nodes, this one (rank 0, pieces 0-1) holds its stripe; "a" holds 2, "b" fetches 3
    views = [peer("a", have=[2]), peer("b", fetching=[3])]
    me = Local(Bitmap.of(N, [0, 1]), {}, rank=0, nodes=8)
    store, limits, rng = StoreView(False, 2), RequestLimits(), random.Random(1)
    # before: any piece nobody in view claims (one at a time: `choose`'s partial view rule);
    # 4.. are most likely claimed out of view
    assert idle_requests(me, views, store, limits, rng, -1) == [Request(4, ORIGIN)]
    assert idle_requests(me, views, store, limits, rng, idle_scope(True, me, 0, 0)) == []
    # an orphaned stripe (pieces 10, 11) and late pieces (3, 7): those, never a claimed one
    scope = idle_scope(True, me, bits([10, 11]), bits([3, 7]))
    asked, have = [], me.have.bits
    while got := idle_requests(replace(me, have=Bitmap(N, have)), views, store, limits, rng,
                               scope):  # fmt: skip
        asked += got
        have |= bits(r.piece for r in got)
    assert asked == [Request(7, ORIGIN), Request(10, ORIGIN), Request(11, ORIGIN)]


# -- PeerViews over a fixed membership -----------------------------------------------------------


class FakePeers:
    """What `PeerViews` uses of `Peers`: the discovered list, HEADs (every peer answers
    with nothing held, or not at all if dead), this node's URL."""

    def __init__(
        self, listed: list[str], view: int, dead: Collection[str] = (),
        absent: Collection[str] = (),
    ) -> None:  # fmt: skip
        self.settings = PeerSettings(("127.0.0.1", 9401), "t" * 16, view=view)
        self.listed, self.dead, self.absent = listed, set(dead), set(absent)
        self.asked: list[set[str]] = []
        self.discovery = self

    def peers(self) -> list[str]:
        return self.listed

    def own_url(self) -> str:
        return "http://127.0.0.1:9401"

    def probe_all(
        self, sha256: str, skip: frozenset[str] = frozenset(), within: Collection[str] = ()
    ) -> dict[str, tuple[int, dict[str, str]] | None]:
        asked = {p for p in self.listed if (not within or p in within) and p not in skip}
        self.asked.append(asked)
        return {p: self._answer(p) for p in asked}

    def _answer(self, peer: str) -> tuple[int, dict[str, str]] | None:
        """None (no answer) if dead; 404 if absent (not on this blob); else all held."""
        if peer in self.dead:
            return None
        return (404, {}) if peer in self.absent else (200, {PIECES: "all"})

    def failed(self, peer: str) -> None:
        pass


def urls(n: int) -> list[str]:
    return [f"http://10.0.{i // 250}.{i % 250 + 1}:9401" for i in range(n)]


def views_of(fake: FakePeers, members: SwarmMembers | None = None) -> PeerViews:
    return PeerViews(cast(Peers, cast(Any, fake)), "ab" * 32, 64 << 20, 1 << 20, members)


def test_a_membership_within_the_bound_is_all_watched_and_striped_by_advertisers() -> None:
    fake = FakePeers(urls(4), view=4)
    views = views_of(fake)
    views.refresh()
    assert fake.asked == [set(urls(4))]
    got, _rank, nodes = views.current()
    assert len(got) == 4 and nodes == 5 and not views.partial() and views.orphans() == 0


def test_a_piece_answer_spares_the_next_head_round_unless_it_starts_a_streamed_piece() -> None:
    """A held piece's answer carries the peer's current headers: no HEAD needed this round.
    A streamed piece's answer lasts as long as the store takes to send the piece: its
    headers go stale meanwhile, so the round still asks that peer (the simulator: 4.9 s
    against 3.1 s, 4 nodes, four 16 MiB shards, when such answers spared their peers)."""
    fake = FakePeers(urls(3), view=4)
    views = views_of(fake)
    a, b, c = urls(3)
    views.heard(a, {PIECES: "all"}, piece_answer=True)
    views.heard(b, {PIECES: "all"}, piece_answer=True, streamed=True)
    views.refresh()
    assert fake.asked == [{b, c}]


def test_a_large_membership_is_watched_in_a_sample_and_striped_whole() -> None:
    fake = FakePeers(urls(300), view=8)
    views = views_of(fake)
    views.refresh()
    (asked,) = fake.asked
    assert len(asked) == 8
    got, rank, nodes = views.current()
    assert {v.url for v in got} == asked and views.partial()
    members = sorted([*urls(300), fake.own_url()])
    assert (rank, nodes) == (members.index(fake.own_url()), 301)  # stripes among all


def test_a_watched_peer_dead_or_shunned_is_replaced_and_a_dead_one_s_stripe_orphaned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(swarmviews.time, "monotonic", lambda: clock[0])
    listed = urls(20)  # 21 nodes, 64 pieces: 3 or 4 pieces a stripe
    fake = FakePeers(listed, view=8)
    views = views_of(fake)
    views.refresh()
    first = sorted(fake.asked[0])
    dead, shunned = first[0], first[1]
    fake.dead = {dead}
    views.shun(shunned)
    clock[0] += 0.5
    views.refresh()  # the shunned one is replaced at once
    assert shunned not in fake.asked[1] and dead in fake.asked[1] and len(fake.asked[1]) == 8
    assert views.orphans() == 0
    while clock[0] < 1000.0 + MEMBER_TTL:  # rounds every 0.5 s, as the daemon's
        clock[0] += 0.5
        views.refresh()
    # silent for MEMBER_TTL: gone, replaced, its stripe nobody's (the others answer)
    assert dead not in fake.asked[-1] and len(fake.asked[-1]) == 8
    members = sorted([*listed, fake.own_url()])
    rank = members.index(dead)
    start, end = rank * views.count // 21, (rank + 1) * views.count // 21
    assert end - start >= 3 and views.orphans() == bits(range(start, end))


def test_the_first_node_at_a_blob_stripes_with_the_peers_seen_on_the_revision_until_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node reaches a blob first: its three peers, still on the revision's blob before,
    answer 404 here. Alone, its stripe would be the whole blob (it took every piece from the
    store, and its uplink became every peer's only source); they were seen swarming the
    revision (the shared members), so the blob is cut in four. A peer that stops answering
    leaves after MEMBER_TTL; the advertisers of this blob join the revision's members."""
    clock = [1000.0]
    monkeypatch.setattr(swarmviews.time, "monotonic", lambda: clock[0])
    listed = urls(3)
    fake = FakePeers(listed, view=16, absent=listed)
    alone = views_of(fake)
    alone.refresh()
    assert alone.current() == ([], 0, 1)
    members = SwarmMembers()
    members.add(listed)
    views = views_of(fake, members)
    views.refresh()
    everyone = sorted([*listed, fake.own_url()])
    assert views.current() == ([], everyone.index(fake.own_url()), 4)
    fake.dead = {listed[0]}
    while clock[0] < 1000.0 + MEMBER_TTL:
        clock[0] += 0.5
        views.refresh()
    assert views.current()[2] == 3
    other = SwarmMembers()
    advertised = views_of(FakePeers(listed, view=16), other)
    advertised.refresh()
    advertised.current()
    assert other.get() == frozenset(listed)


def test_a_peer_failing_pieces_again_is_left_out_longer_even_while_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once: out until it answers a HEAD. Again before a piece landed from it (it answers
    HEADs but cuts every piece short): out twice as long each time, answers or not, so
    that its pieces go to others; a piece landing from it forgives it."""
    clock = [1000.0]
    monkeypatch.setattr(swarmviews.time, "monotonic", lambda: clock[0])
    fake = FakePeers(urls(2), view=4)
    views = views_of(fake)
    bad = urls(2)[0]

    def out_for() -> float:
        """Seconds until `bad` is back in the views, HEAD rounds every 0.5 s."""
        start = clock[0]
        while bad not in {v.url for v in views.current()[0]}:
            clock[0] += 0.5
            views.refresh()
        return clock[0] - start

    views.refresh()
    views.shun(bad)
    assert out_for() == 0.5  # back at its next answer
    for strike in (2, 3, 4):
        views.shun(bad)
        views.shun(bad)  # another request that was in flight: no strike of its own
        assert out_for() == swarmviews.SHUN_SECONDS * 2 ** (strike - 1)
    views.served(bad)
    views.shun(bad)
    assert out_for() == 0.5
