"""The swarm's piece and source choice for one node and one blob (pure: no I/O, no clock).

A blob is exchanged in pieces (pieces.py: their sizes, and the `Bitmap` of a set of them).
Every node advertises a `Bitmap` of the pieces it holds and one of the pieces it has in
flight; `choose` decides, from this node's state and its (possibly stale) view of its peers,
which requests to start next: a piece and a source, a peer's URL or `ORIGIN` (the object
store). The caller calls it again whenever something changes (a piece arrived, a request
failed, fresh advertisements); nothing here remembers anything between calls, so a stale or
wrong view costs at most duplicate or idle requests, never wrong data (the data plane
verifies every piece).

The policy, in the order `choose` applies it (design §8, "Swarm: pieces and source choice"):

1. **The store's share, one copy.** A piece no peer in view holds or fetches (nobody claims
   it) is fetched from the store by one node. Which node: the blob is cut into as many
   contiguous stripes as there are known nodes (`Local.rank` of `Local.nodes`, this node's
   rank in the sorted membership that every node discovers alike), and a node takes the
   unclaimed pieces of its own stripe from the store, lowest first. Nodes started together
   thus ask the store for different pieces from the first instant, when nobody has advertised
   anything yet, and the store sends about one copy when it is the bottleneck.
   A node whose own stripe is all claimed and that asks nothing of a store without room
   takes, one at a time, one of the last unclaimed pieces of the stripe with the most left
   (never its owner's next ones, `StoreView.ahead`): the store then keeps serving every
   node until the blob's last piece is claimed, not only the slowest owner while the others
   wait for its stripe.
   Requests to the store (by any rule) are at most `StoreView.window` in flight: one at the
   start, more as the store shows room (`next_window`, additive increase, multiplicative
   decrease). Requests to a saturated store share its egress, so k at once make each piece
   arrive k times later without making the node's share larger; few at a time, each piece
   arrives, and spreads to the peers, while the store sends the next (a pipeline).
2. **Peers, rarest first.** Every other missing piece that a peer with a free slot holds is
   asked of a peer, the pieces held by the fewest peers first (random among equals, so that
   nodes diverge and every piece spreads), each from its least busy holder: rare pieces are
   the ones whose holders would become the bottleneck (BitTorrent's rule). A peer also
   offers the pieces it is receiving from the store (`PeerView.streaming`), passed on as
   their bytes arrive (cut-through): held by nobody yet, they are the rarest, so every node
   takes each claim from its claimant while the store is still sending it, and the store's
   one copy reaches every node at the store's pace instead of one piece-time per hop. Such
   a piece is asked of a holder if any has one free, else of its streamer. Only pieces from
   the store are streamed, so a streamed piece has one hop and no cycle.
3. **The store when peers cannot keep up.** If the store has shown room (`StoreView.room`)
   and this node's link has room that peers are not filling (`Local.spare`), or the node
   would otherwise have nothing in flight, more pieces are asked of the store: unclaimed ones
   outside the own stripe first (an owner that is slow, gone or unseen), then the rarest of
   those peers hold (relieving them). A piece another node is fetching from the store and
   nobody holds yet is its claim: it is asked of the store again only by a node that would
   otherwise be idle, one at a time. A node therefore never waits idle while the store could
   serve it, and the swarm is never slower than every node pulling from the store alone. A
   store without room is left to the claimants, even by an idle node: it is sending at
   capacity already, another request would only share that, and a copy of a piece that a
   peer is about to have (the view may be stale) costs the store a second copy.
   With a partial view (a node watches some of its peers, not all: a thousand nodes), a
   piece nobody in view holds or fetches is most likely its owner's, or held by nodes out
   of view, not unclaimed: asking the store for it would cost the store another copy just
   when, having sent its copy, it shows room (benchmarks/swarmsim.py: 1.54 copies at 1,000
   nodes, view 32). So a node with requests in flight leaves such pieces to its peers, and
   an idle one asks the store for one at a time.
4. **Endgame.** When every missing piece is already in flight and at most `Limits.endgame`
   are missing, each is also asked of a second peer holding it that is idle (advertises no
   upload: `PeerView.load` 0; never of more than two sources), so that the last pieces do
   not wait on a slow sender. Only an idle one: a second copy from a busy holder takes a
   share of its uplink from the first copies other nodes wait for, and the copy that loses
   is thrown away (benchmarks/RESULTS.md: 8-18 MB of each node's 269 MB at N = 8, the last
   node ready 3-5% later than with idle peers only). Not of the store: a second copy from it
   is what rule 1 avoids, and with few pieces per node that tail alone would cost a
   noticeable share of a copy (8 nodes x 1 piece of 64 = 1/8).

Bounds (`Limits`): requests in flight per peer (one each first, more only while fewer than
`Limits.fill` are with peers), to the store (the window, at most `Limits.per_origin`), and
in total. A piece this
node holds is never chosen; a piece in flight is chosen only by the endgame rule.

Bitmaps are Python ints (bit i = piece i; their arithmetic is in bitsets.py) so that a
choice over thousands of pieces and dozens of peers costs a few hundred big-integer
operations (the simulator in benchmarks/ calls this for a thousand nodes).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightcache.node import bitsets
from weightcache.node.pieces import Bitmap, BitmapError

ORIGIN = "origin"  # the source name of the object store in a `Request`


@dataclass(frozen=True)
class PeerView:
    """What this node last heard from one peer about the blob (possibly stale)."""

    url: str
    have: Bitmap
    fetching: Bitmap  # in flight at the peer, from anyone; from the store = its claims
    load: int = 0  # uploads the peer is serving (to anyone), as it advertised
    #: In flight at the peer from the store, which it passes on as the bytes arrive
    #: (cut-through; a subset of `fetching`); None: it advertises none.
    streaming: Bitmap | None = None

    def offers(self) -> int:
        """The pieces the peer serves now: held, or streamed from the store as they come."""
        return self.have.bits | (self.streaming.bits if self.streaming is not None else 0)


@dataclass(frozen=True)
class Local:
    """This node's own state for the blob; `inflight` maps a piece to its sources.

    `spare`: this node's download link has room that its requests are not using (the
    caller measures: received rate well below the best it has seen, or nothing in flight).
    """

    have: Bitmap
    inflight: Mapping[int, frozenset[str]]
    rank: int = 0  # this node's index in the sorted membership (its stripe)
    nodes: int = 1  # how many nodes the membership has, this one included
    spare: bool = True


@dataclass(frozen=True)
class StoreView:
    """The object store as this node sees it.

    `room`: the store has shown spare capacity: recent requests to it got at least a
    request's share of this node's link, and no 503/SlowDown. Until then (False, the start)
    it is assumed to be the bottleneck, where asking it for pieces that someone else claims
    or holds would only slow the claimant and cost the store another copy.

    `window`: how many requests to the store (by any rule) to keep in flight at most, kept
    by the caller with `next_window` at each new measurement of `room`.

    `ahead`: how many pieces a node takes from the store, at this node's measured rate and
    window, in the time a peer's view of it may lag (None: not measured yet). A node may
    have claimed that many more of its stripe than its advertisement shows.
    """

    room: bool = False
    window: int = 1
    ahead: int | None = None


@dataclass(frozen=True)
class Limits:
    """Requests in flight this node allows; the defaults suit pieces of a few MiB."""

    per_peer: int = 4  # to one peer at most: enough to fill its uplink over one RTT
    fill: int = 4  # to peers, enough to fill this node's link: see `_Plan.peers_rarest_first`
    per_origin: int = 8  # the store window's top: the ranged GETs one fetch runs in parallel
    claims: int = 1  # the store window's bottom and start: see `choose`, rule 1
    total: int = 16  # in all: bounds memory and open connections
    endgame: int = 8  # missing pieces at most, for a second source to be tried

    def __post_init__(self) -> None:
        if min(self.per_peer, self.fill, self.per_origin, self.claims, self.total) < 1 or (
            self.endgame < 0
        ):
            raise ValueError(f"request limits must be positive: {self}")


def next_window(window: int, room: bool, limits: Limits) -> int:
    """The store window after a measurement: one more request while the store has room,
    half as many when it has none (additive increase, multiplicative decrease, as TCP's
    congestion window), between `limits.claims` and `limits.per_origin`.

    A window that jumped to the maximum at the first sign of room would make all those
    pieces arrive together, late; one that fell back to the minimum at once would leave the
    store idle until the next measurement.
    """
    grown = window + 1 if room else window // 2
    return max(limits.claims, min(limits.per_origin, grown))


@dataclass(frozen=True, order=True)
class Request:
    piece: int
    source: str  # a peer's URL or ORIGIN


def stripe(rank: int, nodes: int, count: int) -> int:
    """The bits of the contiguous stripe of `count` pieces that node `rank` of `nodes` owns."""
    if nodes < 1 or not 0 <= rank < nodes:
        raise ValueError(f"rank {rank} is not one of {nodes} nodes")
    start, end = rank * count // nodes, (rank + 1) * count // nodes
    return ((1 << end) - 1) ^ ((1 << start) - 1)


def choose(
    local: Local,
    peers: Sequence[PeerView],
    store: StoreView,
    limits: Limits,
    rng: random.Random,
) -> list[Request]:
    """The requests to start now, at most what the limits leave free (policy: module doc).

    Guarantees: no piece in `local.have`; a piece in `local.inflight` only in the endgame,
    from a source it is not in flight from; at most `limits` requests in flight per peer, to
    the store and in total, counting those already in flight; each piece at most once.
    """
    plan = _Plan(local, peers, limits, max(limits.claims, min(store.window, limits.per_origin)))
    plan.origin_unclaimed(plan.stripe)
    if not store.room:  # with room, rule 3 asks for the unclaimed pieces of other stripes
        plan.origin_laggard(store.ahead, rng)
    plan.peers_rarest_first(rng)
    if store.room and (local.spare or not plan.busy()):
        scope = plan.beyond_view()
        plan.origin_unclaimed(scope, 1 if plan.partial and scope == -1 else limits.per_origin)
        plan.origin_rarest(rng, limits.per_origin, plan.held)
        if not plan.busy():
            plan.origin_rarest(rng, 1, scope)
    plan.endgame(rng)
    return plan.requests


class _Plan:
    """The requests `choose` is building, with the slots and pieces they use up."""

    def __init__(
        self, local: Local, peers: Sequence[PeerView], limits: Limits, store_bound: int
    ) -> None:
        count = local.have.count
        for peer in peers:
            streaming = peer.fetching if peer.streaming is None else peer.streaming
            if {peer.have.count, peer.fetching.count, streaming.count} != {count}:
                raise BitmapError(f"peer {peer.url} advertises a bitmap of another piece count")
        self.local, self.peers, self.limits, self.store_bound = local, peers, limits, store_bound
        self.requests: list[Request] = []
        self.slots: dict[str, int] = {}  # requests in flight or planned, by source
        for sources in local.inflight.values():
            for source in sources:
                self.slots[source] = self.slots.get(source, 0) + 1
        self.total = sum(self.slots.values())
        inflight = sum(1 << piece for piece in local.inflight)
        self.wanted = ((1 << count) - 1) & ~local.have.bits & ~inflight
        self.holders = bitsets.counts(peer.have.bits for peer in peers)
        self.held = 0
        for peer in peers:
            self.held |= peer.have.bits
        self.stripe = stripe(local.rank, local.nodes, count) if count else 0
        self.partial = 0 < len(peers) < local.nodes - 1

    def beyond_view(self) -> int:
        """The pieces rule 3 may ask the store for besides those peers hold: all when the
        view has every node (or none yet: the first decision) or when this node is idle
        (`choose` then asks for one at a time with a partial view); with a partial view and
        requests in flight, only the own stripe.

        In a partial view, a piece nobody in view holds or fetches is most likely claimed,
        or held, by nodes out of view (its stripe's owner and those it spread to), not
        unclaimed: asking the store for it costs the store another copy, typically just
        after the store has sent its copy and shows room. A busy node gets it from its peers
        as soon as one in view has it; an idle one still asks the store (never idle while
        the store has room).
        """
        return self.stripe if self.partial and self.busy() else -1

    def _seen(self) -> int:
        """The pieces some peer in view holds or fetches (claimed)."""
        seen = 0
        for peer in self.peers:
            seen |= peer.have.bits | peer.fetching.bits
        return seen

    def busy(self) -> bool:
        return bool(self.local.inflight or self.requests)

    def _free(self, source: str, bound: int = 0) -> bool:
        """`source` may get one more request: below `bound` (default: its limit) and the total."""
        bound = bound or (self.store_bound if source == ORIGIN else self.limits.per_peer)
        return self.total < self.limits.total and self.slots.get(source, 0) < bound

    def _add(self, piece: int, source: str) -> None:
        self.requests.append(Request(piece, source))
        self.slots[source] = self.slots.get(source, 0) + 1
        self.total += 1
        self.wanted &= ~(1 << piece)

    def origin_unclaimed(self, within: int, at_most: int = 1 << 30) -> None:
        """Rules 1, 3: pieces of `within` nobody in view holds or fetches, from the store.

        In ring order from the own stripe's start: beyond it lie the stripes of the next
        nodes, the likeliest to be claimed already if their owners are alive.
        """
        unclaimed = self.wanted & ~self._seen() & within
        for piece in itertools.islice(bitsets.ring(unclaimed, self.stripe), at_most):
            if not self._free(ORIGIN):
                return
            self._add(piece, ORIGIN)

    def origin_laggard(self, ahead: int | None, rng: random.Random) -> None:
        """Rule 1, once the own stripe is claimed: with nothing asked of the store (which has
        shown no room), one of the last unclaimed pieces of the stripe that has the most
        left, from the store.

        Every node's share of the store then stays busy until the blob's last piece is
        claimed, instead of the store serving only the slowest owner (whose stream shares
        its downlink with its peers' pieces) while the others wait for its stripe. It costs
        no copy as long as views are fresh enough: the piece is unclaimed; the owner, who
        takes its stripe lowest first, keeps the next `ahead` pieces (at least one), which
        it may have claimed since it last advertised (none is taken before the store's rate
        is measured); nodes that run out together take from different stripes among those
        with the most left, and different pieces among their last, at random. Only while
        every node is in view with the blob: a piece unclaimed in a partial view is most
        likely claimed out of it, and a node early at a blob would otherwise take it all,
        one piece at a time, from under owners about to start (benchmarks/swarmsim.py: 1.4
        to 1.6 store copies with small shards).
        """
        if len(self.peers) < self.local.nodes - 1 or self.slots.get(ORIGIN, 0):
            return
        if ahead is None or not self._free(ORIGIN):
            return
        unclaimed = self.wanted & ~self._seen()
        count, nodes = self.local.have.count, self.local.nodes
        left = [unclaimed & stripe(rank, nodes, count) for rank in range(nodes)]
        most = max(bits.bit_count() for bits in left)
        if most <= max(1, ahead):  # the owner's next ones: it may be at them already
            return
        laggard = rng.choice([bits for bits in left if bits.bit_count() == most])
        last = itertools.islice(bitsets.descending(laggard), min(nodes, most - max(1, ahead)))
        self._add(rng.choice(list(last)), ORIGIN)

    def peers_rarest_first(self, rng: random.Random) -> None:
        """Rule 2: the rarest pieces that peers with a free slot offer (hold, or stream from
        the store as it arrives), each from its least busy holder, else from its streamer.

        One request per peer first, as many peers as offer something; a peer gets a second
        (up to `Limits.per_peer`) only while fewer than `Limits.fill` are in flight to peers.
        Every request shares this node's link with the others, so each one more makes every
        piece in flight arrive later, and a piece helps the other nodes only once it is
        here: enough requests to fill the link, over as many uplinks as possible (one
        holder's four would take its whole uplink from the others), and no more. With one
        or two peers offering, a few requests each keep the link full between pieces.
        """
        for bound in range(1, self.limits.per_peer + 1):
            self._peers_up_to(bound, rng)

    def _peers_up_to(self, bound: int, rng: random.Random) -> None:
        """Rule 2 with at most `bound` requests per peer (after the first round, until
        `Limits.fill` are in flight to peers)."""
        while bound == 1 or self._to_peers() < self.limits.fill:
            free = [p for p in self.peers if self._free(p.url, bound) and p.offers() & self.wanted]
            available = 0
            for peer in free:
                available |= peer.offers() & self.wanted
            if not available:
                return
            piece = bitsets.pick(bitsets.rarest(available, self.holders), rng)
            offering = [p for p in free if p.offers() >> piece & 1]
            self._add(piece, min(offering, key=lambda p: self._rank(p, piece, rng)).url)

    def _to_peers(self) -> int:
        return self.total - self.slots.get(ORIGIN, 0)

    def _rank(self, peer: PeerView, piece: int, rng: random.Random) -> tuple[bool, int, int, float]:
        """A holder before a streamer (whose piece comes no faster than the store sends it
        to the streamer), then the least busy."""
        return (not peer.have.bits >> piece & 1, *self._load(peer, rng))

    def _load(self, peer: PeerView, rng: random.Random) -> tuple[int, int, float]:
        return self.slots.get(peer.url, 0), peer.load, rng.random()

    def origin_rarest(self, rng: random.Random, at_most: int, within: int) -> None:
        """Rule 3: up to `at_most` of the rarest pieces of `within` still wanted, from the store."""
        for _ in range(at_most):
            if not (self.wanted & within and self._free(ORIGIN)):
                return
            rarest = bitsets.rarest(self.wanted & within, self.holders)
            self._add(bitsets.pick(rarest, rng), ORIGIN)

    def endgame(self, rng: random.Random) -> None:
        """Rule 4: a second source, an idle peer, for the last pieces in flight (one each)."""
        missing = self.local.have.count - len(self.local.have)
        if self.wanted or not 0 < missing <= self.limits.endgame:
            return
        planned = {r.piece for r in self.requests}
        for piece, sources in sorted(self.local.inflight.items()):
            if len(sources) != 1 or piece in planned:
                continue
            idle = [
                p
                for p in self.peers
                if p.have.bits >> piece & 1
                and p.url not in sources
                and p.load == 0
                and self._free(p.url)
            ]
            if idle:
                self._add(piece, min(idle, key=lambda p: self._load(p, rng)).url)
