"""A fault-injecting HTTP/1.1 reverse proxy for putting between a client and an S3 store.

Stdlib only, one thread per client connection, one keep-alive upstream connection per client
connection. Requests are forwarded byte-faithfully: method, request target (path + query),
every header as the client sent it *including Host* (SigV4 signs the host, also for
presigned URLs), and the body, streamed. Responses are streamed back with their status line
and headers unchanged, so nothing the size of a model is ever buffered.

Faults are set at runtime with `configure()` and apply to GET requests in `scope`:

- "ranged": GETs with a Range header (the data plane of a parallel downloader);
- "data":   GETs of an object other than a SHA256SUMS manifest (no listings);
- "all":    every GET.

Per eligible request one decision is drawn from a seeded `random.Random`: `slowdown`
(answer 503 SlowDown without contacting the store), or, for a 200/206 response with a body,
`reset` (send part of the body, then RST), `truncate` (send the full Content-Length header
but only part of the body, then FIN), `corrupt` (flip one byte), `stall` (send part of the
body, then go silent until the client gives up or the proxy stops). `latency` delays every
eligible request. `script` names faults to inject first, in order, before the random ones
(so a test can be sure each kind happened). `max_consecutive` caps the faults injected in a
row on one path so that a client with a handful of retries is sure to finish.

`unsupported` names query parameters (e.g. "attributes", "partNumber") whose requests are
answered 501 NotImplemented: a store without that API. `head_latency` delays every HEAD
(a far store's round trip), so that HEADs a client sends at once overlap.

`set_down()` makes the store unreachable through the proxy: "refuse" (listener closed,
connections refused), "reset" (accepted then RST) or "hang" (accepted, never answered).
`rate_limit` (bytes/s, all connections together) slows the body bytes sent to clients.
`slow` (in a `script` only) sends that one response's body at `slow_rate` bytes/s, the
others as usual: one starved connection among healthy ones.
`trickle_rate` (bytes/s, per response) sends the body of every eligible response in
pieces of a tenth of a second's worth (one byte at 10 B/s or less), each after its own
pause: a store that keeps a connection busy without ever filling a read buffer. Lifting it
(`trickle_rate=None`) sends the rest of the bodies in flight at once.

Counters (`stats()`): requests received (including those answered with SlowDown), GETs,
GETs with Range, response body bytes sent to clients (in total and per path), injected
faults by kind, and the most HEADs in progress at once (`peak_heads`). `concurrency()` is
the timeline of ranged GETs in progress (each change, with its monotonic time), which shows
a client's concurrency going up and down.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.support.proxy_handler import (
    SLOWDOWN_BODY,
    ProxyHandler,
    close_quietly,
    reset_connection,
    shutdown_quietly,
)

FAULT_KINDS = ("slowdown", "reset", "truncate", "corrupt", "stall")
SCOPES = ("ranged", "data", "all")
DOWN_MODES = ("refuse", "reset", "hang")

_LISTING_PARAMS = frozenset(
    {"list-type", "prefix", "delimiter", "uploads", "acl", "tagging", "location",
     "versioning", "max-keys", "continuation-token", "marker", "policy", "cors"}
)  # fmt: skip


@dataclass
class Faults:
    """What to inject; rates are probabilities per eligible GET (their sum must be <= 1)."""

    slowdown_rate: float = 0.0
    reset_rate: float = 0.0
    truncate_rate: float = 0.0
    corrupt_rate: float = 0.0
    stall_rate: float = 0.0
    latency: float = 0.0  # seconds added before forwarding each eligible request
    scope: str = "ranged"
    script: tuple[str, ...] = ()  # faults injected first, in order ("none" skips one)
    max_consecutive: int | None = None  # per path; None = unbounded
    rate_limit: float | None = None  # bytes/s of response bodies, all connections together
    trickle_rate: float | None = None  # bytes/s of each eligible response body, in pieces
    slow_rate: float = 64 * 1024  # bytes/s of the body of a response the script makes "slow"
    #: Query parameters of requests answered 501 NotImplemented, of any method, without
    #: asking the store: a store without that API ("attributes": GetObjectAttributes).
    unsupported: tuple[str, ...] = ()
    head_latency: float = 0.0  # seconds added before forwarding each HEAD request

    def validate(self) -> None:
        rates = (self.slowdown_rate, self.reset_rate, self.truncate_rate, self.corrupt_rate,
                 self.stall_rate)  # fmt: skip
        if any(r < 0 for r in rates) or sum(rates) > 1.0 + 1e-9:
            raise ValueError(f"fault rates must be >= 0 and sum to <= 1, got {rates}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        for name in self.script:
            if name not in (*FAULT_KINDS, "none", "slow"):
                raise ValueError(f"unknown fault {name!r} in script")
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ValueError("rate_limit must be positive")
        if self.trickle_rate is not None and self.trickle_rate <= 0:
            raise ValueError("trickle_rate must be positive")


@dataclass(frozen=True)
class Stats:
    """A snapshot of the proxy's counters."""

    connections: int = 0  # accepted, whatever the proxy then did with them
    requests: int = 0
    gets: int = 0
    ranged_gets: int = 0
    body_bytes: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    path_bytes: dict[str, int] = field(default_factory=dict)
    path_requests: dict[str, int] = field(default_factory=dict)
    peak_heads: int = 0  # the most HEAD requests in progress at once

    def bytes_for(self, suffix: str) -> int:
        """Body bytes sent for all paths ending with `suffix` (e.g. a file name)."""
        return sum(n for p, n in self.path_bytes.items() if p.endswith(suffix))

    def requests_for(self, suffix: str) -> int:
        return sum(n for p, n in self.path_requests.items() if p.endswith(suffix))


class _Counters:
    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.gets = 0
        self.ranged_gets = 0
        self.body_bytes = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.path_bytes: collections.Counter[str] = collections.Counter()
        self.path_requests: collections.Counter[str] = collections.Counter()
        self.peak_heads = 0


class _TokenBucket:
    """Global pacing of body bytes: `take(n)` sleeps so the long-run rate is `rate` B/s."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0.0

    def take(self, n: int, rate: float | None) -> None:
        if rate is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / rate
        delay = start - now
        if delay > 0:
            time.sleep(delay)


class FaultProxy:
    """A running proxy in front of `upstream` (an http:// URL); use as a context manager."""

    def __init__(self, upstream: str, *, seed: int | str = 0, host: str = "127.0.0.1") -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.host = host
        self.port = 0
        self._rng_seed = seed
        self._lock = threading.Lock()
        self._faults = Faults()
        self._script: collections.deque[str] = collections.deque()
        self._rng = random.Random(seed)
        self._consecutive: collections.Counter[str] = collections.Counter()
        self._counters = _Counters()
        self._bucket = _TokenBucket()
        self._down: str | None = None
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._ranged_inflight = 0
        self._heads_inflight = 0
        self._timeline: list[tuple[float, int]] = []

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        self._stopping.clear()
        self._listen()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._close_listener()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for conn in conns:
            shutdown_quietly(conn)
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.settimeout(0.1)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(sock,), name=f"faultproxy-accept-{self.port}",
            daemon=True,
        )  # fmt: skip
        self._accept_thread.start()

    def _close_listener(self) -> None:
        sock, thread = self._listener, self._accept_thread
        self._listener = self._accept_thread = None
        if sock is not None:
            sock.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set() and self._listener is listener:
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(conn, addr), daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(t)
                self._counters.connections += 1
            t.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        try:
            down = self._down
            if down == "reset":
                reset_connection(conn)
            elif down == "hang":
                self.hold(conn)
            else:
                ProxyHandler(conn, addr, self)
        except OSError:
            pass
        finally:
            close_quietly(conn)
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    # --- runtime control ---------------------------------------------------------------

    def configure(self, faults: Faults | None = None, **changes: Any) -> Faults:
        """Replace the faults (with `faults`) and/or change some fields; returns the result.

        Setting `script` restarts the script; the random sequence continues.
        """
        with self._lock:
            new = dataclasses.replace(faults or self._faults, **changes)
            new.validate()
            self._faults = new
            if faults is not None or "script" in changes:
                self._script = collections.deque(new.script)
            self._consecutive.clear()
            return new

    def clear_faults(self) -> None:
        self.configure(Faults())

    @property
    def faults(self) -> Faults:
        with self._lock:
            return self._faults

    def set_down(self, mode: str | None) -> None:
        """Make the store unreachable ("refuse", "reset", "hang") or reachable again (None).

        Open connections are closed when going down, so keep-alive clients notice too.
        """
        if mode is not None and mode not in DOWN_MODES:
            raise ValueError(f"down mode must be one of {DOWN_MODES} or None")
        previous, self._down = self._down, mode
        if mode is not None:
            with self._lock:
                conns = list(self._conns)
            for conn in conns:
                shutdown_quietly(conn)
        if mode == "refuse" and previous != "refuse":
            self._close_listener()
        elif (
            mode != "refuse"
            and (previous == "refuse" or self._listener is None)
            and not self._stopping.is_set()
        ):
            self._listen()

    @property
    def down(self) -> str | None:
        return self._down

    def stats(self, settle: float = 2.0) -> Stats:
        """The counters, after waiting up to `settle` seconds for requests in progress.

        A client can read the last bytes of a response a moment before the proxy counts
        them; settling closes that race.
        """
        if settle > 0:
            self.wait_idle(settle)
        with self._lock:
            c = self._counters
            return Stats(
                connections=c.connections,
                requests=c.requests,
                gets=c.gets,
                ranged_gets=c.ranged_gets,
                body_bytes=c.body_bytes,
                faults=dict(c.faults),
                path_bytes=dict(c.path_bytes),
                path_requests=dict(c.path_requests),
                peak_heads=c.peak_heads,
            )

    def reset_stats(self) -> None:
        with self._lock:
            self._counters = _Counters()
            self._timeline = []

    def concurrency(self) -> list[tuple[float, int]]:
        """(time.monotonic(), ranged GETs in progress) at each change since the last reset.

        A ranged GET is in progress from its request line until its response ends
        (SlowDown answers included: they take `latency` too).
        """
        with self._lock:
            return list(self._timeline)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no request is being processed; True if that happened in time."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    # --- used by the handler -----------------------------------------------------------

    def _begin(self, method: str, path: str, ranged: bool) -> None:
        with self._lock:
            self._inflight += 1
            c = self._counters
            c.requests += 1
            c.path_requests[path] += 1
            if method == "HEAD":
                self._heads_inflight += 1
                c.peak_heads = max(c.peak_heads, self._heads_inflight)
            if method == "GET":
                c.gets += 1
                if ranged:
                    c.ranged_gets += 1
                    self._ranged_inflight += 1
                    self._timeline.append((time.monotonic(), self._ranged_inflight))

    def _end(self, method: str, ranged: bool) -> None:
        with self._idle:
            if method == "GET" and ranged:
                self._ranged_inflight -= 1
                self._timeline.append((time.monotonic(), self._ranged_inflight))
            if method == "HEAD":
                self._heads_inflight -= 1
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def _sent(self, path: str, n: int) -> None:
        with self._lock:
            self._counters.body_bytes += n
            self._counters.path_bytes[path] += n

    def _pace(self, n: int) -> None:
        self._bucket.take(n, self._faults.rate_limit)

    def _decide(self, path: str) -> str | None:
        """The fault for one eligible request (None for none), counted as injected later."""
        with self._lock:
            f = self._faults
            if self._script:
                choice: str | None = self._script.popleft()
                return None if choice == "none" else choice
            r = self._rng.random()
            choice = None
            edge = 0.0
            for kind, rate in (("slowdown", f.slowdown_rate), ("reset", f.reset_rate),
                               ("truncate", f.truncate_rate), ("corrupt", f.corrupt_rate),
                               ("stall", f.stall_rate)):  # fmt: skip
                edge += rate
                if r < edge:
                    choice = kind
                    break
            capped = f.max_consecutive is not None and self._consecutive[path] >= f.max_consecutive
            if capped:
                choice = None
            if choice is None:
                self._consecutive[path] = 0
            else:
                self._consecutive[path] += 1
            return choice

    def _count_fault(self, kind: str) -> None:
        with self._lock:
            self._counters.faults[kind] += 1

    def _randrange(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n) if n > 0 else 0

    def unsupported(self, target: str) -> bool:
        """Whether to answer this request 501 NotImplemented (`Faults.unsupported`)."""
        query = parse_qs(target.partition("?")[2], keep_blank_values=True)
        return bool(set(query) & set(self._faults.unsupported))

    def eligible(self, method: str, target: str, has_range: bool) -> bool:
        if method != "GET":
            return False
        scope = self._faults.scope
        if scope == "all":
            return True
        if scope == "ranged":
            return has_range
        path, _, query = target.partition("?")
        segments = [s for s in path.split("/") if s]
        if len(segments) < 2 or path.endswith("/"):
            return False
        if set(parse_qs(query, keep_blank_values=True)) & _LISTING_PARAMS:
            return False
        return unquote(segments[-1]) != "SHA256SUMS"

    def hold(self, conn: socket.socket) -> None:
        """Keep `conn` open and silent until the peer closes it or the proxy changes state."""
        while not self._stopping.is_set():
            try:
                readable, _, _ = select.select([conn], [], [], 0.2)
                if readable and not conn.recv(65536):
                    return
            except OSError:
                return


__all__ = ["DOWN_MODES", "FAULT_KINDS", "SCOPES", "SLOWDOWN_BODY", "FaultProxy", "Faults", "Stats"]
