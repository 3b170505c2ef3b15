"""The store as one source of a swarm download (design §8, Swarm).

`SwarmDownload` (download.py) asks the pure policy (`choice.choose`) what to request, given
a `StoreView`: how many pieces may be in flight to the store (its window) and whether the
store has room beyond the pieces no peer holds. `StoreGate` keeps that view as pieces from
the store land and fail: the window grows while the store keeps up (`choice.next_window`)
and shrinks when it throttles; a failure pauses the store for the downloader's backoff, and
too many in a row, or a refusal, end the download.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from weightcache.errors import TransientError
from weightcache.swarm.choice import RequestLimits, StoreView, next_window
from weightcache.transfer.sources import RetryRange

if TYPE_CHECKING:
    from weightcache.transfer.downloader import RangedDownloader

log = logging.getLogger(__name__)

ROOM_FACTOR = 5.0  # a store request this much faster than a peer's: the store has room
ALONE_GRACE = 1.0  # seconds alone before the store window may grow
THROTTLE_MEMORY = 2.0  # seconds after a throttle during which the store has no room
EWMA = 0.3  # weight of a new piece in a source's per-request rate


class StoreGate:
    """What one swarm download knows of the store (see the module docstring). Thread-safe:
    the download's loop reads it, its workers report to it."""

    def __init__(
        self,
        limits: RequestLimits,
        downloader: RangedDownloader,
        where: str,
        label: str,
        piece_size: int,
        lag: float,
    ) -> None:
        """`lag`: how long a peer's view of this node may be out of date (`StoreView.ahead`)."""
        self.limits, self.downloader, self.where, self.label = limits, downloader, where, label
        self.piece_size, self.lag = piece_size, lag
        self.bytes = 0  # received from the store by this download
        self._view = StoreView()
        self._per_request: dict[str, float] = {}  # bytes/s of one request, by kind (EWMA)
        self._throttled_at = float("-inf")
        self._failures = 0  # in a row
        self._pause_until = 0.0
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def view(self) -> StoreView:
        with self._lock:
            return self._view

    def per_request(self) -> float | None:
        """Bytes/s one request to the store delivers (a moving average), if measured."""
        with self._lock:
            return self._per_request.get("origin")

    def paused(self) -> bool:
        """True while the store waits out the backoff after a failed request."""
        return time.monotonic() < self._pause_until

    def received(self, nbytes: int) -> None:
        """A piece's bytes came from the store: count them; its failures are forgiven."""
        with self._lock:
            self.bytes += nbytes
            self._failures = 0

    def measured(self, kind: str, rate: float, alone: bool) -> None:
        """A piece from `kind` ("origin" or "peer") arrived at `rate` bytes/s per request.
        After one from the store, its room and window: it has room when a request to it
        delivers at least ROOM_FACTOR times as fast as one to a peer (it is not what limits
        this node, the peers are). Until a peer delivered a piece, the peers are assumed
        to be the bottleneck, unless this node has been `alone` (no peer holds or fetches
        the blob) for ALONE_GRACE: then nothing is lost by asking the store more."""
        with self._lock:
            self._average(kind, rate)
            if kind != "origin":
                return
            alone = alone and time.monotonic() - self._started >= ALONE_GRACE
            room = self._room(rate, self._per_request.get("peer"), alone)
            window = next_window(self._view.window, room, self.limits)
            ahead = math.ceil(self.lag * self._per_request["origin"] * window / self.piece_size)
            self._view = StoreView(room, window, ahead)

    def peer_failed(self, rate: float) -> None:
        """A peer's piece was given up after arriving at `rate` bytes/s (too slow: what
        came; cut, refused or otherwise failed: 0, it delivered nothing): the peers' pace
        counts it (not only the pieces that landed), and if a request to the store is
        ROOM_FACTOR times as fast as one to a peer now, the store has room at once, not at
        its next piece: the node may have none in flight to it, and would wait for slow
        peers rather than ask it (a trickling peer was asked its pieces again and again).
        A failure counts as a slow piece: else a peer failing every piece would leave the
        store without room, its window at one piece, as if that peer were the faster source.
        """
        with self._lock:
            peer = self._average("peer", rate)
            store = self._per_request.get("origin")
            if store is not None and self._room(store, peer, alone=False):
                self._view = StoreView(True, self._view.window, self._view.ahead)

    def _room(self, store: float, peer: float | None, alone: bool) -> bool:
        """Whether a store request at `store` bytes/s shows room (`measured`): no throttle
        in the last THROTTLE_MEMORY seconds, and ROOM_FACTOR times a peer's `peer` (not
        measured yet: if `alone`)."""
        faster = store >= ROOM_FACTOR * peer if peer is not None else alone
        return faster and time.monotonic() - self._throttled_at >= THROTTLE_MEMORY

    def _average(self, kind: str, rate: float) -> float:
        """Count a request's rate into its kind's moving average; returns the average."""
        old = self._per_request.get(kind)
        self._per_request[kind] = rate if old is None else old + EWMA * (rate - old)
        return self._per_request[kind]

    def failed(self, error: BaseException) -> BaseException | None:
        """A request to the store failed: what ends the download, if anything. A refusal
        (403, 404, size changed: anything but RetryRange and OSError) does at once; a
        throttle shrinks the window; every failure pauses the store for the backoff, and
        the downloader's max attempts in a row give up."""
        if not isinstance(error, (RetryRange, OSError)):
            return error
        throttled = isinstance(error, RetryRange) and error.throttle
        with self._lock:
            self._failures += 1
            failures = self._failures
            if throttled:
                self._throttled_at = time.monotonic()
                window = next_window(self._view.window, False, self.limits)
                self._view = StoreView(False, window, self._view.ahead)
            self._pause_until = time.monotonic() + self.downloader.backoff.delay(failures)
        if throttled:
            self.downloader.observer.throttled()
        attempts = self.downloader.settings.max_attempts
        log.warning(
            "%s: a piece from the store failed, attempt %d/%d (%s)",
            self.label,
            failures,
            attempts,
            error,
        )
        if failures < attempts:
            return None
        return TransientError(
            f"giving up on {self.label} ({self.where}) after {failures} failed requests to "
            f"the store, last: {error}; partial data is kept, run the fetch again when the "
            "store recovers"
        )
