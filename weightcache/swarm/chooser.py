"""What a swarm download (weightcache/swarm/download.py) requests next (design §8, Swarm).

`Chooser.choose` runs the pure policy (`choice.choose`) on the download's current views of
the peers, less their claims that have expired (`Claims`, `claim_wait`: those pieces are the
store's again), then the idle rule: idle for IDLE_GRACE with pieces missing, the store is
asked regardless of its room. With the same views it notes when every piece is claimed
(the job's `all_claimed`).
"""

from __future__ import annotations

import random
import threading
import time

from weightcache.swarm.choice import ORIGIN, Local, PeerView, Request, choose
from weightcache.swarm.inflight import Requests
from weightcache.swarm.pace import Rates, claim_wait
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.storegate import StoreGate
from weightcache.swarm.views import (
    Claims,
    Late,
    PeerViews,
    idle_requests,
    idle_scope,
    in_view,
    unclaim,
)

IDLE_GRACE = 1.0  # seconds idle with pieces missing before the store is asked regardless


class Chooser:
    """The choices of one download, from its `views`, `store` (its limits and piece size
    too), `requests` and `rates`. `choose` is called by the download's loop only; its
    workers read `expired`."""

    def __init__(
        self, views: PeerViews, store: StoreGate, requests: Requests, rates: Rates,
        all_claimed: threading.Event | None,
    ) -> None:  # fmt: skip
        self.views, self.store, self.requests, self.rates = views, store, requests, rates
        self.all_claimed = all_claimed
        self.rng = random.Random()
        self.idle_since = time.monotonic()
        self.late = Late(self.idle_since, requests.count)
        self.claims = Claims()
        self.expired: dict[str, int] = {}  # peer -> its claims expired (`_unclaimed`)

    def choose(self, have: Bitmap) -> list[Request]:
        """The requests to start now, this node holding `have` (`choice.choose` on the
        current views, then the idle rule); with the same views, notes whether every
        piece is claimed (`all_claimed`)."""
        now = time.monotonic()
        inflight = self.requests.in_flight()
        store = self.store.view()
        limits = self.store.limits
        views, rank, members = self.views.current()
        views = self._unclaimed(views, now)
        spare = not inflight or self.rates.rate() < 0.6 * self.rates.best
        local = Local(have, inflight, rank, members, spare)
        fetching = sum(1 << p for p in inflight)
        claimed, held = in_view(views)
        self.late.saw(claimed | local.have.bits | fetching, held | local.have.bits, now)
        requests = choose(local, views, store, limits, self.rng)
        if requests or inflight:
            self.idle_since = now
        elif now - self.idle_since >= IDLE_GRACE:
            # Nobody in view holds or fetches what is missing for a while (views are that
            # stale): the store, whatever its room, rather than waiting for nothing; with a
            # partial view only for pieces nobody could be expected to have (`idle_scope`).
            scope = idle_scope(self.views.partial(), local, self.views.orphans(),
                               self.late.late(now, rank, members))  # fmt: skip
            requests = idle_requests(local, views, store, limits, self.rng, scope)
        if self.store.paused():
            requests = [r for r in requests if r.source != ORIGIN]
        asked = fetching | sum(1 << r.piece for r in requests)
        self._note_claimed(local.have.bits | asked | claimed)
        return requests

    def _unclaimed(self, views: list[PeerView], now: float) -> list[PeerView]:
        """`views` without the claims that have expired (`Claims`, `claim_wait`): those
        pieces are the store's again, and a piece this node is asking of a peer that
        streams it is given up (`pace.judge`)."""
        self.claims.saw(views, now)
        oldest = self.requests.oldest_stream(now)
        wait = claim_wait(self.store.piece_size, self.store.per_request(), now - oldest)
        self.expired = self.claims.expired(now, wait)
        return unclaim(views, self.expired)

    def _note_claimed(self, pieces: int) -> None:
        """Set `all_claimed` once `pieces` (held or asked for, here or by a peer in view)
        are all of them. The store's last pieces of this blob are then in flight to their
        claimants, and the next blob's claims keep it busy meanwhile: waiting until every
        missing piece is in flight here (the end game) left the store's link idle for
        several seconds at each blob (benchmarks/RESULTS.md)."""
        if self.all_claimed is not None and pieces == (1 << self.requests.count) - 1:
            self.all_claimed.set()
