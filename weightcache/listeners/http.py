"""The listeners the daemon and the swarm's peer server run, on one asyncio event loop
thread (design §5, Bounds): the metrics/health HTTP port, the peer port (both aiohttp)
and the fetch socket (its server: weightcache/daemon/coordinator.py). None of them
trusts a client to behave, so every connection is bounded:
The daemon's listeners, on one asyncio event loop thread (design §5, Bounds).

Three servers share the loop: the metrics/health HTTP port, the peer port (both aiohttp)
and the Unix socket the Pods' `fetch` talks to (JSON lines, weightcache/daemon/fetchsocket.py). None
of them trusts a client to behave, so every connection and request is bounded by the books
of weightcache/listeners/admission.py:

- a connection cap per server, an idle timeout and a header timeout;
- on the HTTP ports, a cap on requests in progress, checked when a request's head is read;
  on the metrics port the kubelet's probes have slots of their own, their pages rendered
  on threads of their own: scrapers at their cap slow /metrics but never fail liveness (a
  failed liveness probe restarts the daemon, downloads and all);
- a real listen backlog, so a burst of connections is queued by the kernel, not dropped.

Work that may block (disk reads, /metrics rendering, a fetch waiting on a download) runs
in threads; the loop thread only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from weightcache.listeners.admission import (
    PROBES,
    Conn,
    ConnectionLimits,
    Connections,
    Requests,
    close_all,
    sweep,
)

log = logging.getLogger(__name__)


T = TypeVar("T")

BACKLOG = 1024  # connections the kernel queues before we accept them (somaxconn caps it)
#: Connections asyncio accepts in one go. Its default (the backlog) would open 1024 fds
#: before the cap gets a chance to close any: EMFILE at the container's default limit.
ACCEPT_BURST = 16
PROBE_THREADS = 2  # the probes' pages render on these, never queued behind /metrics
_BUSY_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 5\r\nConnection: close\r\n\r\nbusy\n"
)


class LoopThread:
    """An asyncio event loop running on its own daemon thread."""

    def __init__(self, name: str = "serve") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run `coro` on the loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard one (containers start at 1024 soft);
    the connection caps keep the daemon far below it anyway. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket for HOST:PORT (v4 or v6; "" or "0.0.0.0" for every address).
    Raises OSError (EADDRINUSE, EADDRNOTAVAIL, ...)."""
    family = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0][0]
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class _Protocol(web_protocol.RequestHandler):
    """aiohttp's connection handler, telling the books when request bytes arrive."""

    conn: Conn | None = None

    def data_received(self, data: bytes) -> None:
        if self.conn is not None and data:
            Connections.received(self.conn, time.monotonic())
        super().data_received(data)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A malformed request is one warning line, never a traceback in the log; a client
        that left before its answer (a peer that dropped a piece it got elsewhere, a scraper
        that gave up) is routine, not an error."""
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            log.warning("bad HTTP request: %s", exc)
        elif isinstance(exc, ConnectionError):
            log.debug("a client left before its answer: %r", exc)
        else:
            log.error("error serving an HTTP request: %r", exc if exc is not None else args)


class _Server(web.Server):
    def __init__(
        self, handler: Handler, books: Connections, refused: Callable[[], None], **kw: Any
    ) -> None:
        super().__init__(handler, **kw)
        self.books = books
        self.refused = refused

    def __call__(self) -> web_protocol.RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: web_protocol.RequestHandler, transport: Any) -> None:
        super().connection_made(handler, transport)
        conn = Conn(close=handler.force_close, idle_since=time.monotonic())
        victim = self.books.admit(conn)
        if victim is conn:
            transport.write(_BUSY_503)
            handler.force_close()
            self.refused()
            return
        if victim is not None:
            victim.close()
        if isinstance(handler, _Protocol):
            handler.conn = conn

    def connection_lost(self, handler: web_protocol.RequestHandler, exc: Any = None) -> None:
        if isinstance(handler, _Protocol) and handler.conn is not None:
            self.books.forget(handler.conn)
        super().connection_lost(handler, exc)


class HttpServer:
    """One bounded HTTP listener; `handler` gets every request (no routing table)."""

    def __init__(
        self, handler: Handler, limits: ConnectionLimits, refused: Callable[[], None] = lambda: None
    ) -> None:
        """`refused()` is called for each connection or request turned away (a 503)."""
        self.books = Connections(limits)
        self.requests = Requests(limits)
        self._handler = handler
        self._refused = refused
        self._server: asyncio.Server | None = None
        self._web: _Server | None = None
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen (raises OSError, e.g. EADDRINUSE); returns the bound address."""
        self._stop = asyncio.Event()
        self._web = _Server(
            self._track,
            self.books,
            self._refused,
            access_log=None,
            keepalive_timeout=self.books.limits.idle,
        )
        sock = tcp_listener(host, port)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._web, sock=sock, backlog=ACCEPT_BURST)
        sock.listen(BACKLOG)  # asyncio listened with ACCEPT_BURST; the kernel queues more
        self._sweeper = asyncio.create_task(sweep(self.books, self._stop))
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def _track(self, request: web.BaseRequest) -> web.StreamResponse:
        if not self.requests.take(request.path):
            self._refused()
            busy = web.Response(status=503, text="busy\n")
            busy.force_close()
            return busy
        conn = getattr(request.protocol, "conn", None)
        if conn is not None:
            Connections.started(conn)
        try:
            return await self._handler(request)
        finally:
            self.requests.done(request.path)
            if conn is not None:
                Connections.finished(conn, time.monotonic())

    async def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
        close_all(list(self.books.open))
        if self._web is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._web.shutdown(1.0), 2.0)


Page = Callable[[], tuple[int, bytes, str]]  # blocking: (status, body, content type)


def page_handler(pages: dict[str, Page]) -> Handler:
    """GET (or HEAD) of a fixed set of paths, each page rendered in a worker thread: the
    PROBES on PROBE_THREADS of their own, the others on the loop's default executor."""
    probes = ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="probe")

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        page = pages.get(request.path)
        if request.method not in ("GET", "HEAD"):
            return web.Response(
                status=405, text="method not allowed\n", headers={"Allow": "GET, HEAD"}
            )
        if page is None:
            return web.Response(status=404, text="not found\n")
        if request.path in PROBES:
            loop = asyncio.get_running_loop()
            status, body, ctype = await loop.run_in_executor(probes, page)
        else:
            status, body, ctype = await asyncio.to_thread(page)
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})

    return handle
