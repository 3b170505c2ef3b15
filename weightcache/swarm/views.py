"""What a node's swarm download knows of its peers for one blob (design §8, Swarm): their
views (pieces held and in flight, uploads), the membership whose stripes split the store's
copy, and the peers to leave out for a while. The inputs `choice.choose` takes from peers;
the download loop is weightcache/swarm/download.py.

Views come from HEAD rounds (`refresh`, every VIEW_EVERY seconds, skipping peers that
answered a piece request since the last round: that answer carried the same headers; not
one that starts a streamed piece, which lasts as long as the store takes: its headers go
stale meanwhile) and from every answer to a piece request (`heard`). A peer that asks this
node about the blob joins the membership at once (`joined`), before it claims anything, so
that stripes agree.

A bounded view: a node watches (HEADs) at most `PeerSettings.view` peers, a random sample
of the membership discovery gives when it lists more (`watch`). A watched peer that is
shunned is replaced by another; one that does not advertise the blob for MEMBER_TTL (dead,
or not downloading it) too, its stripe counted orphaned (`orphaned`); and one that is not
serving this node pieces is rotated out each round, so that every node is watched by some.
The stripes are then cut over that whole membership (every node's discovery gives the same
list), not over the advertisers in view (each node's differ: each group would take its own
copy from the store), and an idle node asks the store only for the pieces `idle_scope`
says. With the whole membership in view (N <= view + 1) everything is as without a bound.

A peer's claims (pieces in flight there, not held) expire when they do not become pieces in
time (`Claims`, `unclaim`): the policy then sees those pieces as nobody's.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from weightcache.fetch.blobs import SwarmMembers
from weightcache.swarm.bitsets import iter_bits
from weightcache.swarm.choice import (
    ORIGIN,
    Local,
    PeerView,
    Request,
    RequestLimits,
    StoreView,
    choose,
    stripe,
)
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.wire import PIECES, parse_view

if TYPE_CHECKING:
    from weightcache.swarm.client import Peers

log = logging.getLogger(__name__)

VIEW_EVERY = 0.5  # seconds between HEAD rounds (an answer to a piece request stands for one)
VIEW_LAG = 2 * VIEW_EVERY  # how old a peer's view of this node may be: a round, and one skipped
MEMBER_TTL = 3.0  # seconds without an answer before a peer leaves the membership
SHUN_SECONDS = 2.0  # a peer that failed a piece is left out this long, or until it answers
#: A peer failing pieces again before one landed from it is left out twice as long each
#: time, and not back at its next answer (it answers HEADs but cuts every piece short: a
#: bad disk, a broken link), at most this long.
SHUN_MAX = 60.0
GONE_SECONDS = 10.0  # a watched peer replaced as dead or absent is not watched again this long
#: Watched peers replaced by others each round (a partial view), so that every node is
#: watched by some (one watched by nobody has its pieces stuck until they are late): not one
#: serving this node pieces, nor one watched for less than MEMBER_TTL (not yet shown gone).
ROTATE = 1
#: A piece unseen in a partial view is late (`Late.late`) after LATE_FACTOR times as long as
#: the swarm took to show a first piece, and at least LATE_GRACE seconds.
LATE_GRACE, LATE_FACTOR = 4.0, 2.0


P = TypeVar("P", str, int)  # a peer: its URL (the daemons), its index (the simulator)


def watch(
    members: Sequence[P],
    watched: Sequence[P],
    drop: Collection[P],
    size: int,
    rng: random.Random,
    rotate: int = 0,
    busy: Collection[P] = (),
) -> list[P]:
    """The peers to watch: all `members` when there are at most `size`; else those of
    `watched` still members and not in `drop`, but `rotate` random ones not `busy` (serving
    this node pieces), topped up to `size` with a random sample of the other members not
    in `drop` (fewer if there are not enough)."""
    if len(members) <= size:
        return list(members)
    listed, dropped = set(members), set(drop)
    keep = [u for u in watched if u in listed and u not in dropped][:size]
    idle = [u for u in keep if u not in busy]
    rotated = set(rng.sample(idle, min(rotate, len(idle)))) if len(keep) == size else set()
    keep = [u for u in keep if u not in rotated]
    kept = set(keep)
    others = [u for u in members if u not in kept and u not in dropped and u not in rotated]
    return keep + rng.sample(others, min(size - len(keep), len(others)))


@dataclass
class Late:
    """When each piece of a blob was last seen claimed (held or in flight, here or at a
    peer in view), for the idle rule with a partial view (`idle_scope`). Pure: the caller
    passes the clock."""

    began: float
    count: int
    last_seen: list[float] = field(default_factory=list)
    first_held: float | None = None  # when a piece was first seen held anywhere in view

    def __post_init__(self) -> None:
        self.last_seen = [self.began] * self.count

    def saw(self, seen: int, held: int, now: float) -> None:
        """`seen`: the pieces claimed now; `held`: those held (here or in view)."""
        if held and self.first_held is None:
            self.first_held = now
        for piece in iter_bits(seen):
            self.last_seen[piece] = now

    def late(self, now: float, rank: int, nodes: int) -> int:
        """The pieces unseen for long that node `rank` of `nodes` may ask the store for.

        A piece is late once unseen for `wait` since the swarm showed its first piece
        (LATE_FACTOR times as long as that took, at least LATE_GRACE; none before: the
        store is still sending the first pieces to their owners): for the node after its
        stripe's owner in rank order, after 2 x `wait` for the next two, after 3 x `wait`
        the next four, and so on. A piece stuck at a dead or slow owner out of everyone's
        view is then asked for by about one node, then by more only as it stays unseen
        (design §8, A partial view).
        """
        if self.first_held is None or not self.count:
            return 0
        wait = max(LATE_GRACE, LATE_FACTOR * (self.first_held - self.began))
        bits = 0
        for piece, seen in enumerate(self.last_seen):
            periods = min(64.0, (now - max(seen, self.first_held)) / wait)
            owner = -(-(piece + 1) * nodes // self.count) - 1  # its stripe's
            if periods >= 1 and (rank - owner) % nodes <= 2 ** (periods - 1):
                bits |= 1 << piece
        return bits


@dataclass
class Claims:
    """Since when each peer has claimed each piece it advertises in flight and not held, for
    their expiry (pace.claim_wait): a claim that does not become a piece in time is
    a stuck or hostile peer's (or one whose link to the store trickles), and the piece is
    asked of the store (`unclaim`). Per peer: a fresh claim of the same piece by another
    node (which took it from the store once the first expired) is its own. Pure: the
    caller passes the clock."""

    since: dict[str, dict[int, float]] = field(default_factory=dict)

    def saw(self, views: Sequence[PeerView], now: float) -> None:
        """The claims in `views` now (those of peers out of view are kept as they were)."""
        for view in views:
            old = self.since.get(view.url, {})
            claims = view.fetching.bits & ~view.have.bits
            self.since[view.url] = {p: old.get(p, now) for p in iter_bits(claims)}

    def expired(self, now: float, wait: float) -> dict[str, int]:
        """The claims older than `wait`, by peer (peers without one left out)."""
        out: dict[str, int] = {}
        for url, claims in self.since.items():
            bits = sum(1 << p for p, t in claims.items() if now - t >= wait)
            if bits:
                out[url] = bits
        return out


def unclaim(views: Sequence[PeerView], expired: Mapping[str, int]) -> list[PeerView]:
    """`views` without their `expired` claims: not in flight, not streamed, for the policy."""
    out = []
    for view in views:
        gone = expired.get(view.url, 0)
        if gone:
            count = view.fetching.count
            streaming = view.streaming
            if streaming is not None:
                streaming = Bitmap(count, streaming.bits & ~gone)
            view = replace(
                view, fetching=Bitmap(count, view.fetching.bits & ~gone), streaming=streaming
            )
        out.append(view)
    return out


def in_view(views: Sequence[PeerView]) -> tuple[int, int]:
    """(the pieces peers in view hold or fetch, those they hold)."""
    claimed = held = 0
    for view in views:
        claimed |= view.fetching.bits | view.have.bits
        held |= view.have.bits
    return claimed, held


def orphaned(members: Sequence[P], gone: Collection[P], count: int) -> int:
    """The stripes of the `members` (sorted, as for ranks) that are `gone` (dead, or not
    in the blob's swarm): nobody takes those pieces from the store as its own."""
    bits = 0
    for rank, url in enumerate(members):
        if url in gone:
            bits |= stripe(rank, len(members), count)
    return bits


def idle_scope(partial: bool, local: Local, orphans: int, late: int) -> int:
    """The pieces an idle node may ask the store for whatever its room (after IDLE_GRACE
    idle): any with the whole membership in view; with a partial view only its own stripe,
    the stripes of members known gone, and pieces unseen for long (`Late.late`). A piece
    nobody in a partial view holds or fetches is most likely its owner's, or held out of
    view: asking for it would cost the store another copy (design §8, A partial view)."""
    if not partial:
        return -1
    return stripe(local.rank, local.nodes, local.have.count) | orphans | late


def idle_requests(
    local: Local,
    views: Sequence[PeerView],
    store: StoreView,
    limits: RequestLimits,
    rng: random.Random,
    scope: int,
) -> list[Request]:
    """The store's requests of an idle node: `choose` as if the store had room, over the
    pieces of `scope` that nobody in view holds or fetches (another node's claim is not
    asked for again)."""
    claimed, _ = in_view(views)
    count = local.have.count
    eligible = scope & ~claimed & ((1 << count) - 1)
    masked = Local(
        Bitmap(count, local.have.bits | ((1 << count) - 1) & ~eligible),
        local.inflight,
        local.rank,
        local.nodes,
        local.spare,
    )
    room = StoreView(True, store.window)
    return [r for r in choose(masked, views, room, limits, rng) if r.source == ORIGIN]


class PeerViews:
    """The peers of one blob's swarm as this node sees them. Thread-safe."""

    def __init__(
        self,
        peers: Peers,
        sha256: str,
        size: int,
        piece_size: int,
        members: SwarmMembers | None = None,
    ) -> None:
        self.peers, self.sha256, self.size, self.piece_size = peers, sha256, size, piece_size
        self.count = -(-size // piece_size)
        self.lock = threading.Lock()
        self.began = time.monotonic()
        #: Peers that hold or download the blob (they advertise pieces): with this node,
        #: the membership whose stripes split the store's copy (with the whole membership
        #: in view; with a partial view, the stripes are over `listed`).
        self.views: dict[str, PeerView] = {}
        #: ... and the peers seen swarming the revision's other blobs, which come to this
        #: one too (`SwarmMembers`), while they answer (MEMBER_TTL, as views).
        self.members = members if members is not None else SwarmMembers()
        self.heard_at: dict[str, float] = {}  # peer -> when it last answered anything
        self.answered_at: dict[str, float] = {}  # peer -> when it last answered a piece request
        self.fresh_at: dict[str, float] = {}  # ... one that was not a streamed piece
        self.advertised_at: dict[str, float] = {}  # peer -> when it last advertised the blob
        self.shunned: dict[str, float] = {}  # peer -> until when it is left out
        self.strikes: dict[str, int] = {}  # peer -> times shunned since a piece landed from it
        self.refreshing = threading.Event()  # a HEAD round is running
        self.bound = peers.settings.view
        self.listed: list[str] = []  # the membership (but this node) at the last round
        self.watched: list[str] = []  # the peers HEAD rounds ask (`watch`)
        self.watched_at: dict[str, float] = {}  # peer -> since when it is watched
        self.gone: dict[str, float] = {}  # watched peer found dead or absent -> until when
        self.rng = random.Random()

    def partial(self) -> bool:
        """Whether the membership has more peers than this node watches."""
        with self.lock:
            return len(self.listed) > self.bound

    def current(self) -> tuple[list[PeerView], int, int]:
        """(the views of the peers not left out, this node's rank, the membership size)."""
        own, now = self.peers.own_url(), time.monotonic()
        with self.lock:
            views = [v for u, v in self.views.items() if self.shunned.get(u, 0.0) <= now]
            if len(self.listed) > self.bound:
                members = sorted(set(self.listed) | {own})
            else:
                self.members.add(self.views)
                members = sorted(self.views.keys() | self._coming(now) | {own})
        return views, members.index(own), len(members)

    def _coming(self, now: float) -> set[str]:
        """The peers seen swarming the revision's other blobs that have not shown
        themselves dead (no answer for MEMBER_TTL since this blob began): they will swarm
        this one, and their stripes are theirs (under the lock)."""
        fresh = now - self.began < MEMBER_TTL
        return {
            u
            for u in self.members.get()
            if fresh or now - self.heard_at.get(u, -MEMBER_TTL) < MEMBER_TTL
        }

    def watching(self) -> tuple[int, int]:
        """(the peers HEAD rounds ask now, the peers discovery lists)."""
        with self.lock:
            return len(self.watched), len(self.listed)

    def orphans(self) -> int:
        """The stripes of the members found gone (`orphaned`); none with a whole view."""
        own = self.peers.own_url()
        with self.lock:
            if len(self.listed) <= self.bound:
                return 0
            return orphaned(sorted(set(self.listed) | {own}), self.gone.keys(), self.count)

    def holds(self, peer: str, piece: int) -> bool:
        """Whether `peer` advertised `piece` as held, last we heard."""
        with self.lock:
            view = self.views.get(peer)
            return view is not None and piece in view.have

    def offers(self, peer: str, piece: int) -> bool:
        """Whether `peer` advertised `piece` as held or streamed, last we heard."""
        with self.lock:
            view = self.views.get(peer)
            return view is not None and bool(view.offers() >> piece & 1)

    def alone(self) -> bool:
        with self.lock:
            return not self.views

    def _rewatch(self, listed: list[str], now: float) -> frozenset[str]:
        """Choose the peers this round asks (under the lock): all of `listed`, or, past
        the bound, the watched ones but those shunned, dead or absent, topped up."""
        self.listed = listed
        if len(listed) <= self.bound:
            self.watched = list(listed)
            return frozenset()
        for url in self.watched:
            since = max(self.advertised_at.get(url, -1e9), self.watched_at.get(url, now))
            if now - since >= MEMBER_TTL:  # dead, or not in this blob's swarm
                self.gone[url] = now + GONE_SECONDS
        self.gone = {u: t for u, t in self.gone.items() if t > now}
        drop = self.gone.keys() | {u for u, t in self.shunned.items() if t > now}
        busy = {u for u, t in self.answered_at.items() if now - t < VIEW_EVERY}
        busy |= {u for u, t in self.watched_at.items() if now - t < MEMBER_TTL}  # on trial
        watched = watch(listed, self.watched, drop, self.bound, self.rng, ROTATE, busy)
        self.watched_at = {u: self.watched_at.get(u, now) for u in watched}
        self.watched = watched
        return frozenset(watched)

    def refresh(self) -> None:
        """One HEAD round (call with `refreshing` set; it is cleared here)."""
        now = time.monotonic()
        try:
            listed = self.peers.discovery.peers()
            with self.lock:
                within = self._rewatch(listed, now)
                fresh = frozenset(u for u, t in self.fresh_at.items() if now - t < VIEW_EVERY)
            answers = self.peers.probe_all(self.sha256, fresh, within)
        except Exception:  # a view is an optimisation: never let it end the download
            log.exception("refreshing the swarm's view of %s", self.sha256)
            return
        finally:
            self.refreshing.clear()
        answered = {u for u, a in answers.items() if a is not None}
        with self.lock:
            now = time.monotonic()
            for url in answered:
                self.heard_at[url] = now
            # A peer stays a member until it has not answered for MEMBER_TTL: a HEAD that
            # timed out on a busy host must not reshuffle everyone's stripes.
            alive = {u for u, t in self.heard_at.items() if now - t < MEMBER_TTL}
            self.views = {u: v for u, v in self.views.items() if u in alive}
            # an answer ends a first failure's leave (a timeout on a busy host), not a repeat's
            again = {u for u, n in self.strikes.items() if n > 1}
            self.shunned = {
                u: t
                for u, t in self.shunned.items()
                if t > now and (u not in answered or u in again)
            }
        for url, answer in answers.items():
            if answer is not None:
                self.heard(url, answer[1])

    def heard(
        self,
        url: str,
        headers: Mapping[str, str],
        piece_answer: bool = False,
        streamed: bool = False,
    ) -> None:
        """A peer's answer: its view, or (no pieces advertised: 404) none. A `piece_answer`
        spares the peer the next HEAD round unless `streamed` (module docstring)."""
        try:
            view: PeerView | None = parse_view(url, headers, self.size, self.piece_size)
        except ValueError as e:
            log.debug("peer %s advertised %s badly (%s)", url, self.sha256, e)
            view = None
        with self.lock:
            if piece_answer:
                self.heard_at[url] = self.answered_at[url] = time.monotonic()
                if not streamed:
                    self.fresh_at[url] = self.answered_at[url]
            if view is None or PIECES not in headers:
                self.views.pop(url, None)
            else:
                self.views[url] = view
                self.advertised_at[url] = time.monotonic()

    def joined(self, peer: str) -> None:
        """A peer asked about the blob: a member from now on, holding nothing yet, until
        its own advertisement says more."""
        empty = Bitmap(self.count)
        with self.lock:
            self.views.setdefault(peer, PeerView(peer, empty, empty))
            self.advertised_at[peer] = time.monotonic()

    def shun(self, peer: str) -> None:
        """Leave out a peer that failed a piece (cut, timed out) for SHUN_SECONDS, or until
        it answers; if it failed one before and none landed from it since, for twice as
        long as then (at most SHUN_MAX), whether it answers or not. Requests in flight
        when it was left out that fail too do not count again."""
        now = time.monotonic()
        with self.lock:
            if self.shunned.get(peer, 0.0) <= now:
                self.strikes[peer] = self.strikes.get(peer, 0) + 1
            strikes = self.strikes.setdefault(peer, 1)
            self.shunned[peer] = now + min(SHUN_MAX, SHUN_SECONDS * 2 ** (strikes - 1))
        self.peers.failed(peer)

    def served(self, peer: str) -> None:
        """A piece from `peer` landed: its next failure is a first one again."""
        with self.lock:
            self.strikes.pop(peer, None)
