"""swarm: the stripes and the piece and source choice (pure)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

import pytest

from weightcache.swarm.choice import (
    ORIGIN,
    Local,
    PeerView,
    Request,
    RequestLimits,
    StoreView,
    choose,
    next_window,
    stripe,
)
from weightcache.swarm.pieces import Bitmap, BitmapError

# -- stripes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "nodes", "count", "pieces"),
    [
        (0, 1, 5, [0, 1, 2, 3, 4]),
        (0, 4, 16, [0, 1, 2, 3]),
        (3, 4, 16, [12, 13, 14, 15]),
        (0, 3, 10, [0, 1, 2]),
        (1, 3, 10, [3, 4, 5]),
        (2, 3, 10, [6, 7, 8, 9]),
        (0, 4, 2, []),  # more nodes than pieces: some own nothing
        (1, 4, 2, [0]),
        (3, 4, 2, [1]),
    ],
)
def test_stripes(rank: int, nodes: int, count: int, pieces: list[int]) -> None:
    assert list(Bitmap(count, stripe(rank, nodes, count))) == pieces


def test_stripes_partition_the_blob() -> None:
    for nodes, count in [(1, 1), (7, 64), (16, 64), (1000, 522), (5, 2087)]:
        total = 0
        for rank in range(nodes):
            bits = stripe(rank, nodes, count)
            assert not total & bits
            total |= bits
        assert total == (1 << count) - 1


# -- the choice: situations and the expected requests ---------------------------------------------

N = 16
EMPTY = Bitmap(N)


def peer(
    url: str,
    have: Iterable[int] = (),
    fetching: Iterable[int] = (),
    load: int = 0,
    streaming: Iterable[int] | None = None,
) -> PeerView:
    streams = None if streaming is None else Bitmap.of(N, streaming)
    return PeerView(url, Bitmap.of(N, have), Bitmap.of(N, fetching), load, streams)


def local(
    have: Iterable[int] = (),
    inflight: dict[int, set[str]] | None = None,
    rank: int = 0,
    nodes: int = 1,
    spare: bool = True,
) -> Local:
    flights = {k: frozenset(v) for k, v in (inflight or {}).items()}
    return Local(Bitmap.of(N, have), flights, rank, nodes, spare)


def pick(
    me: Local,
    peers: list[PeerView],
    room: bool = False,
    limits: RequestLimits | None = None,
    seed: int = 1,
    window: int = 8,
    ahead: int | None = 1,
) -> list[Request]:
    """The choice, by default with a store window as wide as the default limits allow."""
    store = StoreView(room, window, ahead)
    return choose(me, peers, store, limits or RequestLimits(), random.Random(seed))


def test_start_alone_takes_the_own_stripe_one_claim_at_a_time() -> None:
    assert pick(local(rank=1, nodes=4), [], window=1) == [Request(4, ORIGIN)]
    assert pick(local([4], rank=1, nodes=4), [], window=1) == [Request(5, ORIGIN)]
    assert pick(local(rank=3, nodes=4, inflight={12: {ORIGIN}}), [], window=1) == []
    assert pick(local(rank=1, nodes=4), [], window=3) == [Request(p, ORIGIN) for p in (4, 5, 6)]
    # without room, the own stripe only, however wide the window
    assert pick(local(rank=1, nodes=4), []) == [Request(p, ORIGIN) for p in (4, 5, 6, 7)]


def test_a_node_whose_stripe_is_claimed_takes_one_of_the_laggard_s_last_pieces() -> None:
    # four stripes of four; this node (rank 0) holds its own; rank 1's has three unclaimed
    peers = [peer("b", fetching=[4]), peer("c", have=range(8, 12)), peer("d", fetching=[12, 13])]
    me = local(range(4), rank=0, nodes=4)
    taken = set()
    for seed in range(20):
        got = [r for r in pick(me, peers, window=1, seed=seed) if r.source == ORIGIN]
        assert len(got) == 1 and got[0].piece in (6, 7), got  # never the owner's next, 5
        taken.add(got[0].piece)
    assert taken == {6, 7}


def test_no_laggard_piece_while_the_store_serves_this_node() -> None:
    peers = [peer("b", fetching=[4]), peer("c", have=range(8, 12)), peer("d", fetching=[12])]
    busy = local(range(3), inflight={3: {ORIGIN}}, rank=0, nodes=4)
    assert [r for r in pick(busy, peers, window=2) if r.source == ORIGIN] == []


def test_no_laggard_piece_is_an_owner_s_next() -> None:
    # rank 1 has only its next (7) left, rank 3 three (13-15): from rank 3's, not its next
    peers = [peer("b", fetching=[4, 5, 6]), peer("c", have=range(8, 12)), peer("d", fetching=[12])]
    got = [r for r in pick(local(range(4), rank=0, nodes=4), peers, window=1) if r.source == ORIGIN]
    assert len(got) == 1 and got[0].piece in (14, 15)
    peers[2] = peer("d", fetching=[12, 13, 14])  # every stripe down to its owner's next
    assert [r for r in pick(local(range(4), rank=0, nodes=4), peers) if r.source == ORIGIN] == []


def test_nodes_that_run_out_together_take_from_different_laggards() -> None:
    # stripes 2 and 3 (of 4) have as many left: either, at random, never an owner's next
    held = [peer("x", have=range(8)), peer("y"), peer("z")]
    taken = {pick(local(range(8), rank=1, nodes=4), held, window=1, seed=s)[0].piece
             for s in range(40)}  # fmt: skip
    assert taken == {9, 10, 11, 13, 14, 15}


def test_the_owner_keeps_the_pieces_it_may_have_claimed_since_it_advertised() -> None:
    # rank 1's stripe has 5, 6, 7 unclaimed: with `ahead` 2 only 7 may be taken, with 3 none
    peers = [peer("b", fetching=[4]), peer("c", have=range(8, 12)), peer("d", have=range(12, 16))]
    me = local(range(4), rank=0, nodes=4)

    def store(ahead: int | None, seed: int = 1) -> list[Request]:
        return [r for r in pick(me, peers, window=1, ahead=ahead, seed=seed) if r.source == ORIGIN]

    assert {r for s in range(10) for r in store(2, s)} == {Request(7, ORIGIN)}
    assert store(3) == []
    assert store(None) == []  # the store's rate not measured yet


def test_a_partial_view_takes_no_laggard_piece() -> None:
    # five nodes, two in view: a piece unclaimed in view is likely claimed out of it
    peers = [peer("b"), peer("c")]
    assert pick(local(range(3), rank=0, nodes=5), peers, window=1) == []


@pytest.mark.parametrize(
    ("window", "room", "expected"),
    [(1, True, 2), (2, True, 3), (8, True, 8), (7, False, 3), (2, False, 1), (1, False, 1)],
)
def test_store_window_grows_by_one_and_halves(window: int, room: bool, expected: int) -> None:
    assert next_window(window, room, RequestLimits(claims=1, per_origin=8)) == expected


def test_start_with_room_fills_the_store_slots_own_stripe_first_then_the_ring() -> None:
    got = pick(local(rank=3, nodes=4), [], room=True)
    assert got == [Request(p, ORIGIN) for p in (12, 13, 14, 15, 0, 1, 2, 3)]


def test_nodes_started_together_ask_the_store_for_different_pieces() -> None:
    claims = [pick(local(rank=r, nodes=8), [], window=2) for r in range(8)]
    pieces = [r.piece for c in claims for r in c]
    assert len(pieces) == 16 and len(set(pieces)) == 16


def test_a_piece_a_peer_holds_or_fetches_is_not_a_claim() -> None:
    peers = [peer("a", have=[0]), peer("b", fetching=[1])]
    got = pick(local(), peers, window=3)
    assert got == [Request(2, ORIGIN), Request(3, ORIGIN), Request(4, ORIGIN), Request(0, "a")]


def test_rarest_first_from_free_holders() -> None:
    have = range(3, N)
    peers = [peer("a", [0, 1, 2]), peer("b", [1, 2]), peer("c", [2])]
    got = pick(local(have), peers, limits=RequestLimits(per_peer=1))
    assert got == [Request(0, "a"), Request(1, "b"), Request(2, "c")]


def test_rarest_first_is_random_among_equals() -> None:
    peers = [peer("a", range(N))]
    firsts = Counter(pick(local(), peers, seed=s)[0].piece for s in range(400))
    assert set(firsts) == set(range(N))  # every piece is sometimes first
    assert max(firsts.values()) < 3 * 400 / N


def test_least_busy_holder_is_asked() -> None:
    peers = [peer("a", range(N)), peer("b", range(N)), peer("c", range(N), load=5)]
    me = local(inflight={0: {"a"}, 1: {"a"}})
    got = pick(me, peers, limits=RequestLimits(total=3))
    assert got == [Request(got[0].piece, "b")]


def test_one_request_per_peer_first_then_more_only_until_the_link_is_full() -> None:
    def spread(holders: int, **limits: int) -> list[int]:
        peers = [peer(f"p{k}", range(N)) for k in range(holders)]
        got = pick(local(), peers, limits=RequestLimits(per_peer=4, total=16, **limits))
        assert len({r.piece for r in got}) == len(got)
        return sorted(Counter(r.source for r in got).values())

    assert spread(8) == [1] * 8  # every offering peer gets one, even past `fill`
    assert spread(4) == [1] * 4
    assert spread(3) == [1, 1, 2]  # a second for one of them: four fill the link
    assert spread(2) == [2, 2]
    assert spread(1) == [4]  # one holder: `per_peer` keeps its uplink full between pieces
    assert spread(4, fill=16) == [4] * 4  # a link four requests don't fill
    assert spread(1, fill=16) == [4]


def test_a_peer_gets_a_second_request_only_when_fewer_than_fill_are_with_peers() -> None:
    peers = [peer("a", range(N)), peer("b", range(N))]
    me = local(inflight={0: {"a"}, 1: {"c"}, 2: {"d"}, 3: {ORIGIN}})  # three with peers
    got = pick(me, peers, limits=RequestLimits(per_peer=4, fill=4, total=16))
    assert Counter(r.source for r in got) == {"b": 1}  # "b" had none; "a" a second: no
    assert pick(me, peers, limits=RequestLimits(per_peer=4, fill=5, total=16)) != got


def test_saturated_peers_and_a_store_with_room_bring_in_the_store() -> None:
    peers = [peer("a", range(N))]
    limits = RequestLimits(per_peer=2, per_origin=3, total=8)
    got = pick(local(), peers, room=True, limits=limits)
    assert Counter(r.source for r in got) == {"a": 2, ORIGIN: 3}
    # the same without room: the store is left alone (nobody's claim is in question here)
    no_room = pick(local(), [peer("a", range(N))], room=False, limits=limits)
    assert Counter(r.source for r in no_room) == {"a": 2}


def test_busy_node_with_a_full_link_leaves_a_store_with_room_alone() -> None:
    peers = [peer("a", range(N))]
    limits = RequestLimits(per_peer=2, per_origin=3, total=8)
    got = pick(local(spare=False), peers, room=True, limits=limits)
    assert Counter(r.source for r in got) == {"a": 2}


def test_idle_node_uses_a_store_with_room_even_for_a_claimed_piece() -> None:
    peers = [peer("a", fetching=list(range(N)))]  # all claimed, nothing held
    got = pick(local(spare=False), peers, room=True, limits=RequestLimits(per_origin=2))
    assert [r.source for r in got] == [ORIGIN]
    assert pick(local(spare=False), peers, room=False) == []


def test_busy_node_leaves_another_node_s_claim_alone_even_with_room() -> None:
    peers = [peer("a", have=[0], fetching=[1, 2, 3])]
    me = local(range(4, N), {4: {"b"}}, rank=0, nodes=1)
    assert pick(me, peers, room=True) == [Request(0, "a")]


def test_a_partial_view_leaves_pieces_out_of_view_to_their_owners_while_busy() -> None:
    # 8 nodes, 2 peers in view; this node (rank 0) owns pieces 0, 1; it fetches 2 from "a".
    peers = [peer("a", have=[2]), peer("b", fetching=[3])]
    me = local(have=[0, 1], inflight={2: {"a"}}, rank=0, nodes=8)
    got = pick(me, peers, room=True, limits=RequestLimits(per_origin=2))
    # pieces 4.. are unseen, not unclaimed: most likely their owners' or spread to nodes out
    # of view. Asking the store would cost it another copy; the claim on 3 is left alone too.
    assert got == []
    # with every node in view, the same pieces are really unclaimed: the store's, with room
    full = [*peers, *(peer(u) for u in "cdefg")]
    assert pick(me, full, room=True, limits=RequestLimits(per_origin=2)) == [
        Request(4, ORIGIN),
        Request(5, ORIGIN),
    ]


def test_a_partial_view_still_never_leaves_a_node_idle_while_the_store_has_room() -> None:
    peers = [peer("a", fetching=[3])]
    me, limits = local(have=[0, 1], rank=0, nodes=8), RequestLimits(per_origin=4)
    # one unseen piece at a time: more would likely be copies of pieces held out of view
    assert pick(me, peers, room=True, limits=limits) == [Request(2, ORIGIN)]
    full = [*peers, *(peer(u) for u in "bcdefg")]  # really unclaimed: the whole window
    assert pick(me, full, room=True, limits=limits) == [Request(p, ORIGIN) for p in (2, 4, 5, 6)]


def test_endgame_asks_a_second_peer_never_the_same_source_nor_the_store() -> None:
    peers = [peer("a", range(N)), peer("b", range(N))]
    me = local(range(13), {13: {"a"}, 14: {ORIGIN}, 15: {"a", "b"}})
    got = pick(me, peers, room=True)
    assert {r.piece for r in got} == {13, 14}
    assert all(r.source != ORIGIN for r in got)
    assert next(r for r in got if r.piece == 13).source == "b"


def test_endgame_asks_only_an_idle_holder() -> None:
    # 13 is in flight from a; b and c hold it but upload to others: a second copy from them
    # would take their uplink from first copies; d is idle
    peers = [peer("a", range(N), load=3), peer("b", range(N), load=1), peer("c", range(N), load=2)]
    me = local(range(13), {13: {"a"}, 14: {"a"}, 15: {"a"}})
    assert pick(me, peers) == []
    got = pick(me, [*peers, peer("d", range(14), load=0)])
    assert got == [Request(13, "d")]  # d does not hold 14 or 15


def test_no_endgame_while_pieces_remain_or_too_many_are_missing() -> None:
    peers = [peer("a", range(N)), peer("b", range(N))]
    inflight = {k: {"a"} for k in range(4, N)}
    assert pick(local(range(4), inflight), peers, limits=RequestLimits(endgame=8)) == []
    endgame = pick(local(range(4), inflight), peers, limits=RequestLimits(endgame=12))
    assert {r.source for r in endgame} == {"b"}


def test_bounds_already_used_up() -> None:
    peers = [peer("a", range(N))]
    full = local(inflight={k: {"a"} for k in range(4)})
    assert pick(full, peers, room=True, limits=RequestLimits(per_peer=4, total=4)) == []


def test_complete_node_asks_nothing() -> None:
    assert pick(local(range(N)), [peer("a", range(N))], room=True) == []


def test_peer_with_another_piece_count_is_refused() -> None:
    with pytest.raises(BitmapError, match="peer x"):
        pick(local(), [PeerView("x", Bitmap(N + 1), Bitmap(N + 1))])
    with pytest.raises(BitmapError, match="peer x"):
        pick(local(), [PeerView("x", EMPTY, EMPTY, 0, Bitmap(N + 1))])


def test_claims_streamed_by_their_claimants_are_taken_at_the_start() -> None:
    """Four nodes started together: each claims its stripe's first piece from the store and
    streams it; every node takes the others' claims from them while they arrive."""
    peers = [peer(u, fetching=[r * 4], streaming=[r * 4]) for r, u in enumerate("abcd") if r != 1]
    got = pick(local(rank=1, nodes=4), peers, window=1)
    assert sorted(got) == [Request(0, "a"), Request(4, ORIGIN), Request(8, "c"), Request(12, "d")]


def test_a_piece_in_flight_without_streaming_is_not_asked_of_the_peer() -> None:
    got = pick(local(rank=1, nodes=4), [peer("a", fetching=[0], streaming=[])], window=1)
    assert got == [Request(4, ORIGIN)]


def test_a_streamed_piece_comes_from_a_holder_when_one_is_free() -> None:
    peers = [peer("a", fetching=[0], streaming=[0], load=0), peer("b", have=[0], load=3)]
    assert pick(local(range(1, N)), peers) == [Request(0, "b")]
    busy = local(range(1, N - 1), inflight={N - 1: {"b"}})
    assert pick(busy, peers, limits=RequestLimits(per_peer=1)) == [Request(0, "a")]


# -- the choice: properties over random situations ------------------------------------------------


def random_situation(rng: random.Random) -> tuple[Local, list[PeerView], StoreView, RequestLimits]:
    count = rng.randrange(1, 80)
    nodes = rng.randrange(1, 12)
    sources = [f"http://p{i}" for i in range(nodes - 1)]
    peers = []
    for url in sources:
        if rng.random() < 0.9:
            fetching = rng.getrandbits(count) & rng.getrandbits(count) & rng.getrandbits(count)
            streaming = Bitmap(count, fetching & rng.getrandbits(count))
            peers.append(
                PeerView(
                    url,
                    Bitmap(count, rng.getrandbits(count) & rng.getrandbits(count) & ~fetching),
                    Bitmap(count, fetching),
                    rng.randrange(5),
                    streaming if rng.random() < 0.7 else None,
                )
            )
    have = rng.getrandbits(count) if rng.random() < 0.5 else 0
    inflight: dict[int, frozenset[str]] = {}
    for piece in range(count):
        if not have >> piece & 1 and rng.random() < 0.15:
            inflight[piece] = frozenset(rng.sample([ORIGIN, *sources], 1))
    me = Local(Bitmap(count, have), inflight, rng.randrange(nodes), nodes, rng.random() < 0.5)
    limits = RequestLimits(
        per_peer=rng.randrange(1, 5),
        fill=rng.randrange(1, 9),
        per_origin=rng.randrange(1, 9),
        claims=rng.randrange(1, 3),
        total=rng.randrange(1, 20),
        endgame=rng.randrange(0, 10),
    )
    ahead = rng.choice([None, 0, 1, 2, 3])
    return me, peers, StoreView(rng.random() < 0.5, rng.randrange(0, 10), ahead), limits


SEEDS = range(1500)
Situation = tuple[Local, list[PeerView], StoreView, RequestLimits, list[Request]]


@pytest.fixture(scope="module")
def situations() -> list[Situation]:
    out = []
    for seed in SEEDS:
        rng = random.Random(seed)
        me, peers, store, limits = random_situation(rng)
        out.append((me, peers, store, limits, choose(me, peers, store, limits, rng)))
    return out


def test_never_a_held_piece_and_each_piece_once(situations: list[Situation]) -> None:
    for me, _, _, _, got in situations:
        pieces = [r.piece for r in got]
        assert len(pieces) == len(set(pieces))
        assert not any(p in me.have for p in pieces)


def test_in_flight_pieces_only_in_the_endgame_from_a_second_peer(
    situations: list[Situation],
) -> None:
    for me, peers, _, limits, got in situations:
        missing = me.have.count - len(me.have)
        for r in got:
            if r.piece in me.inflight:
                assert missing <= limits.endgame
                assert len(me.inflight[r.piece]) == 1 and r.source not in me.inflight[r.piece]
                assert r.source != ORIGIN
                assert next(p for p in peers if p.url == r.source).load == 0
                wanted = set(range(me.have.count)) - set(me.have) - set(me.inflight)
                assert not wanted - {q.piece for q in got}, "endgame while pieces were unasked"


def test_bounds_per_source_and_in_total(situations: list[Situation]) -> None:
    for me, _, store, limits, got in situations:
        before = Counter(s for sources in me.inflight.values() for s in sources)
        after = before + Counter(r.source for r in got)
        new = Counter(r.source for r in got)
        window = max(limits.claims, min(store.window, limits.per_origin))
        for source in new:
            bound = window if source == ORIGIN else limits.per_peer
            assert after[source] <= max(bound, before[source])
            assert before[source] < bound
        assert not got or after.total() <= max(limits.total, before.total())


def test_peers_are_asked_only_for_pieces_they_advertise(situations: list[Situation]) -> None:
    for _, peers, _, _, got in situations:
        by_url = {p.url: p for p in peers}
        for r in got:
            if r.source != ORIGIN:
                source = by_url[r.source]
                streamed = source.streaming is not None and r.piece in source.streaming
                assert r.piece in source.have or streamed


def test_a_streamer_is_asked_only_when_no_holder_is_free(situations: list[Situation]) -> None:
    """Free: below its limit and no busier than the streamer (one request per peer first)."""
    for me, peers, _, limits, got in situations:
        by_url = {p.url: p for p in peers}
        busy = Counter(s for sources in me.inflight.values() for s in sources)
        for k, r in enumerate(got):
            if r.source == ORIGIN or r.piece in by_url[r.source].have:
                continue
            busy_then = busy + Counter(q.source for q in got[:k])
            free_holders = [
                p
                for p in peers
                if r.piece in p.have
                and busy_then[p.url] < limits.per_peer
                and busy_then[p.url] <= busy_then[r.source]
            ]
            assert not free_holders, (r, free_holders)


def test_every_offering_peer_gets_a_request_before_any_gets_a_second(
    situations: list[Situation],
) -> None:
    """And a second (or more) only while fewer than `Limits.fill` are in flight to peers."""
    for me, peers, _, limits, got in situations:
        busy = Counter(s for sources in me.inflight.values() for s in sources)
        after = busy + Counter(r.source for r in got)
        left = set(range(me.have.count)) - set(me.have) - set(me.inflight)
        left -= {r.piece for r in got}
        unasked = [
            p for p in peers if not after[p.url] and left & set(Bitmap(p.have.count, p.offers()))
        ]
        for k, r in enumerate(got):
            if r.source == ORIGIN or r.piece in me.inflight:  # the store; the endgame
                continue
            busy_then = busy + Counter(q.source for q in got[:k])
            if busy_then[r.source]:  # a second request to this peer
                assert not unasked, (r, unasked)
                to_peers = busy_then.total() - busy_then[ORIGIN]
                assert to_peers < limits.fill, (r, to_peers)


def test_the_store_is_asked_for_claimed_pieces_only_with_room_and_need(
    situations: list[Situation],
) -> None:
    """Without room: only unclaimed pieces, of the own stripe but for one of another's (a
    laggard's) when nothing else is asked of the store, the own stripe is all claimed and
    the view complete, never one of that stripe's lowest `ahead` (at least one: its owner's
    next). With room, others only
    when the node's link is spare or it would be idle, and a piece only claimed (fetched,
    not held) only by an idle node, one."""
    for me, peers, store, _, got in situations:
        held = fetched = 0
        for p in peers:
            held, fetched = held | p.have.bits, fetched | p.fetching.bits
        count = me.have.count
        own = stripe(me.rank, me.nodes, count)
        idle = not me.inflight and all(r.source == ORIGIN for r in got)
        claimed = [r for r in got if (fetched & ~held) >> r.piece & 1 and r.source == ORIGIN]
        assert len(claimed) <= (1 if store.room and idle else 0)
        origin = [r for r in got if r.source == ORIGIN]
        unclaimed = ((1 << count) - 1) & ~(
            held | fetched | me.have.bits | sum(1 << p for p in me.inflight)
        )
        for r in origin:
            assert (store.room and (me.spare or idle)) or unclaimed >> r.piece & 1
        if store.room:
            continue
        others = [r for r in origin if not own >> r.piece & 1]
        assert len(others) <= 1
        for r in others:
            assert len(origin) == 1 and not any(ORIGIN in s for s in me.inflight.values())
            assert not unclaimed & own and not 0 < len(peers) < me.nodes - 1
            theirs = next(stripe(k, me.nodes, count) for k in range(me.nodes)
                          if stripe(k, me.nodes, count) >> r.piece & 1)  # fmt: skip
            assert store.ahead is not None, r
            below = (unclaimed & theirs & ((1 << r.piece) - 1)).bit_count()
            assert below >= max(1, store.ahead), r  # not the owner's next ones


def test_never_idle_while_the_store_has_room(situations: list[Situation]) -> None:
    for me, _, store, _, got in situations:
        if store.room and not me.inflight and not me.have.complete:
            assert got


def test_first_peer_request_is_one_of_the_rarest_available(situations: list[Situation]) -> None:
    for me, peers, _, limits, got in situations:
        peer_requests = [r for r in got if r.source != ORIGIN and r.piece not in me.inflight]
        if not peer_requests:
            continue
        first = peer_requests[0]
        planned_before = {r.piece for r in got[: got.index(first)]}
        busy = Counter(s for sources in me.inflight.values() for s in sources)
        wanted = set(range(me.have.count)) - set(me.have) - set(me.inflight) - planned_before
        holders = Counter(p for q in peers for p in q.have)
        # free at the round `first` was chosen in: no busier than its peer (and below the limit)
        level = busy[first.source]
        free = [q for q in peers if busy[q.url] < limits.per_peer and busy[q.url] <= level]
        available = {p for q in free for p in Bitmap(q.have.count, q.offers()) if p in wanted}
        assert holders[first.piece] == min(holders[p] for p in available)


def test_same_seed_same_choice() -> None:
    for seed in range(50):
        a, b = random.Random(seed), random.Random(seed)
        me, peers, store, limits = random_situation(a)
        random_situation(b)
        assert choose(me, peers, store, limits, a) == choose(me, peers, store, limits, b)
