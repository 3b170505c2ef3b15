"""What the daemon's listeners admit (design §5, Bounds): pure bookkeeping, the clock passed
in, used on the loop thread only (weightcache/listeners/http.py does the I/O).

- `Connections`: a cap on open connections; a new connection at the cap closes the oldest
  one that is not in the middle of a request (so a flood of idle connections never locks
  out the kubelet's probes or a Pod's fetch), and is refused only when every one is busy;
  plus an idle and a header deadline, so one byte every few seconds keeps nothing open.
- `Requests`: on an HTTP port, a cap on requests in progress, decided when a request's head
  has been read, with the kubelet's probes (PROBES) counted apart. A connection's path is
  unknown when it opens, so a reserve of connections cannot tell a probe from a scraper:
  scrapers' new connections would fill it, or close a probe's before its request is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SWEEP = 0.5  # seconds between checks of the idle and header deadlines
#: The kubelet's probes: requests admitted on slots of their own (`ConnectionLimits.probes`).
PROBES = frozenset({"/healthz", "/readyz"})


@dataclass(frozen=True)
class ConnectionLimits:
    """How one server bounds its connections and requests."""

    connections: int  # open at once, busy or not
    idle: float  # seconds a connection may wait without starting a request
    header: float  # seconds from a request's first byte to its complete head (or line)
    requests: int = 0  # served at once (0: as many as connections); more are answered 503
    probes: int = 0  # PROBES served at once, apart from `requests` (0: counted with them)


@dataclass(eq=False)
class Conn:
    """One open connection as the bookkeeping sees it; `close` ends it from the loop."""

    close: Callable[[], None]
    idle_since: float
    head_since: float | None = None  # a request's first byte arrived, its head did not
    busy: bool = False  # a request is being served


@dataclass
class Connections:
    """The open connections of one server: the cap and the deadlines. The caller closes
    what the methods return."""

    limits: ConnectionLimits
    open: list[Conn] = field(default_factory=list)

    def admit(self, conn: Conn) -> Conn | None:
        """Take `conn` in. At the cap, return the connection to close to make room (the
        one idle longest), or `conn` itself (refused) when every connection is busy."""
        victim = None
        if len(self.open) >= self.limits.connections:
            idle = [c for c in self.open if not c.busy]
            if not idle:
                return conn
            victim = min(idle, key=lambda c: c.idle_since)
            self.open.remove(victim)
        self.open.append(conn)
        return victim

    def forget(self, conn: Conn) -> None:
        with contextlib.suppress(ValueError):
            self.open.remove(conn)

    @staticmethod
    def received(conn: Conn, now: float) -> None:
        if not conn.busy and conn.head_since is None:
            conn.head_since = now

    @staticmethod
    def started(conn: Conn) -> None:
        conn.busy, conn.head_since = True, None

    @staticmethod
    def finished(conn: Conn, now: float) -> None:
        conn.busy, conn.idle_since, conn.head_since = False, now, None

    def expired(self, now: float) -> list[Conn]:
        """Connections past their idle or header deadline (removed from the books)."""
        late = [
            c
            for c in self.open
            if not c.busy
            and (
                now - c.idle_since > self.limits.idle
                or (c.head_since is not None and now - c.head_since > self.limits.header)
            )
        ]
        for c in late:
            self.open.remove(c)
        return late


@dataclass
class Requests:
    """The requests in progress on one HTTP server, counted in two kinds: PROBES (when
    `limits.probes` gives them slots of their own) and the rest."""

    limits: ConnectionLimits
    probes: int = 0
    others: int = 0

    def _probe(self, path: str) -> bool:
        return self.limits.probes > 0 and path in PROBES

    def take(self, path: str) -> bool:
        """Count a request for `path` in, or return False (answer 503) when its kind is at
        its cap: scrapers at theirs never refuse a probe."""
        if self._probe(path):
            if self.probes >= self.limits.probes:
                return False
            self.probes += 1
            return True
        if 0 < self.limits.requests <= self.others:
            return False
        self.others += 1
        return True

    def done(self, path: str) -> None:
        """Count out a request `take` counted in."""
        if self._probe(path):
            self.probes -= 1
        else:
            self.others -= 1


def close_all(conns: list[Conn]) -> None:
    for c in conns:
        with contextlib.suppress(Exception):
            c.close()


async def sweep(books: Connections, stop: asyncio.Event) -> None:
    """Close connections past their deadlines until `stop` is set."""
    while not stop.is_set():
        close_all(books.expired(time.monotonic()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SWEEP)
