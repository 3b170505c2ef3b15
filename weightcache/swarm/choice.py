"""The swarm's choice of pieces and sources for one node and one blob (pure: no I/O, no clock).

`choose(local, peers, store, limits, rng)` decides which requests to start next, each a
piece and a source (a peer's URL, or `ORIGIN`: the object store), from this node's state of
the blob (`Local`: pieces held, requests in flight, its rank in the membership), its possibly
stale view of its peers (`PeerView`: the pieces each holds, fetches and streams, its uploads),
the store as this node sees it (`StoreView`: room and window, kept with `next_window`) and
the bounds (`RequestLimits`). It remembers nothing between calls: the caller calls it again
whenever something changes, and a stale or wrong view costs at most duplicate or idle
requests, never wrong data (the data plane verifies every piece).

The policy and why it is so is design §8, "Swarm: pieces, source choice and the data
plane", which numbers the rules in the order `choose` applies them: 1 the store's share
(the own stripe, a laggard's stripe), 2 peers, rarest first (with cut-through), 3 the store
when peers cannot keep up, 4 the endgame.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightcache.swarm import bitsets
from weightcache.swarm.pieces import Bitmap, BitmapError

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
class RequestLimits:
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


def next_window(window: int, room: bool, limits: RequestLimits) -> int:
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
    limits: RequestLimits,
    rng: random.Random,
) -> list[Request]:
    """The requests to start now, at most what the limits leave free (policy: design §8).

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
        self, local: Local, peers: Sequence[PeerView], limits: RequestLimits, store_bound: int
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
        requests in flight, only the own stripe, since a piece nobody in a partial view
        has is most likely held or claimed out of it (design §8, A partial view).
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
        left, from the store, so that every node's share of the store stays busy until the
        blob's last piece is claimed (design §8, A laggard's stripe).

        The owner keeps its next `ahead` pieces (at least one), which it may have claimed
        since it last advertised; none is taken before `ahead` is measured, nor without
        every node in view; nodes that run out together pick stripes and pieces at random.
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
        (up to `RequestLimits.per_peer`) only while fewer than `RequestLimits.fill` are in flight to
        peers: enough requests to fill this node's link, over as many uplinks as possible
        (design §8, One request per peer first).
        """
        for bound in range(1, self.limits.per_peer + 1):
            self._peers_up_to(bound, rng)

    def _peers_up_to(self, bound: int, rng: random.Random) -> None:
        """Rule 2 with at most `bound` requests per peer (after the first round, until
        `RequestLimits.fill` are in flight to peers)."""
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
