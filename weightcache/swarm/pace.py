"""How fast a swarm download's pieces arrive, and when a peer's piece is too slow (design §8,
Swarm).

A piece from a peer is given up (the peer left out as for a failure: views.py) if it
has not arrived after PEER_TIMEOUT, nor within its size at PEER_MIN_RATE bytes/s or, if
lower, at a SLOW_SHARE-th of this node's download rate per request in flight (of the
store's rate per request, for a piece a peer streams from the store), but never below
TRICKLE_RATE (`slow_floor`, `too_slow`, `judge`). A peer trickling its pieces would hold them for
ever, its bytes keeping the download from stalling, and the store never asked for them.
Not a fixed rate alone: on a slow or crowded link every honest request is slow, and a fixed
floor would cut honest peers' pieces and shun their peers (design §8, Data plane).

A peer's claim of a piece (in flight there, not held) expires after `claim_wait`: CLAIM_FACTOR
times as long as a piece takes from the store here, at least CLAIM_GRACE. A stuck or hostile
peer claiming pieces it never gets would otherwise have every other node leave them to it
and never ask the store (views.Claims).
"""

from __future__ import annotations

import collections
import threading
import time

from weightcache.transfer.sources import RetryRange

PEER_TIMEOUT = 5.0  # seconds one read from a peer may block: a dead peer's piece goes elsewhere
PEER_MIN_RATE, TRICKLE_RATE, SLOW_SHARE = 64 << 10, 8 << 10, 4
RATE_WINDOW = 1.0  # seconds of received bytes the rates are measured over
CLAIM_GRACE, CLAIM_FACTOR = 4.0, 4.0


class Rates:
    """Bytes received in the last RATE_WINDOW seconds, and the best rate seen (this node's
    link, as far as it has shown). Thread-safe."""

    def __init__(self) -> None:
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._total = 0  # the bytes of `_events` (a sum kept, not recomputed: one per read)
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self.best = 0.0

    def note(self, nbytes: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), nbytes))
            self._total += nbytes

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - RATE_WINDOW:
                self._total -= self._events.popleft()[1]
            total = self._total
        rate = total / max(0.2, min(RATE_WINDOW, now - self._start))
        self.best = max(self.best, rate)
        return rate


def slow_floor(
    rate: float, requests: int, store_per_request: float | None, streamed: bool
) -> float:
    """The bytes/s below which a piece from a peer is given up (module doc), for a node
    receiving `rate` bytes/s over `requests` in flight; a `streamed` piece comes no faster
    than the store sends one request (`store_per_request`, None while unmeasured)."""
    share = rate / max(1, requests)
    if streamed:
        share = min(share, store_per_request or share)
    return max(TRICKLE_RATE, min(PEER_MIN_RATE, share / SLOW_SHARE))


def too_slow(elapsed: float, size: int, floor: float) -> bool:
    """A piece of `size` bytes asked `elapsed` seconds ago should have arrived by now."""
    return elapsed > max(PEER_TIMEOUT, size / floor)


class TooSlow(RetryRange):
    """A peer's piece given up for its pace (`too_slow`, or its claim expired meanwhile),
    after arriving at `rate` bytes/s."""

    def __init__(self, reason: str, rate: float) -> None:
        super().__init__(reason)
        self.rate = rate


def judge(pos: int, size: int, elapsed: float, floor: float, claim_expired: bool) -> None:
    """Raise TooSlow if a peer's piece, `pos` of `size` bytes after `elapsed` seconds, is
    too slow (it must average `floor` bytes/s, `too_slow`), or if it is streamed and the
    peer's claim of it has expired (`claim_expired`): the store is asked for it instead."""
    if too_slow(elapsed, size, floor):
        raise TooSlow(f"too slow: {pos} of {size} bytes, less than "
                      f"{floor / 1024:.0f} KiB/s", pos / elapsed)  # fmt: skip
    if claim_expired:
        raise TooSlow(f"its claim expired: {pos} of {size} bytes in {elapsed:.0f}s",
                      pos / elapsed)  # fmt: skip


def claim_wait(piece_size: int, store_rate: float | None, store_oldest: float) -> float:
    """Seconds a peer's claim of a piece may last before it expires (module doc): the time
    a piece takes from the store here is `piece_size` at `store_rate` bytes/s per request
    (None: not measured yet), and at least `store_oldest`, the age of the oldest request in
    flight to it (the store may be slower than measured, or not measured: the start)."""
    took = max(store_oldest, piece_size / store_rate if store_rate else 0.0)
    return max(CLAIM_GRACE, CLAIM_FACTOR * took)
