"""The daemon's listeners, on one asyncio event loop thread (design §5, Bounds).

Three servers share the loop: the metrics/health HTTP port, the peer port (both aiohttp)
and the Unix socket the Pods' `fetch` talks to (JSON lines, weightcache/node/coord.py). None
of them trusts a client to behave, so every connection and request is bounded by the books
of weightcache/node/admission.py:

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
import json
import logging
import resource
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from weightcache.errors import UsageError
from weightcache.node.admission import (
    PROBES,
    Conn,
    Connections,
    Limits,
    Requests,
    close_all,
    sweep,
)
from weightcache.node.coord import socket_address
from weightcache.smallfile import chmod_own

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


# -- HTTP (aiohttp's low-level server, with the books) ----------------------------------------

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
        self, handler: Handler, limits: Limits, refused: Callable[[], None] = lambda: None
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


# -- the Unix fetch socket (JSON lines) -------------------------------------------------------

Send = Callable[[dict[str, Any]], None]
LineHandler = Callable[[bytes, Send], None]  # blocking: runs in a worker thread
SEND_TIMEOUT = 30.0  # a Pod that does not read its socket for this long is dropped


class SocketServer:
    """The Unix socket: one request line per connection (at most `line_limit` bytes,
    within `limits.header` seconds), then `handle(line, send)` in a worker thread, which
    answers through `send` (thread-safe) as long as it likes. The connection closes when
    `handle` returns."""

    def __init__(self, path: Path, handle: LineHandler, limits: Limits, line_limit: int) -> None:
        self.path = path
        self.books = Connections(limits)
        self._handle = handle
        self._line_limit = line_limit
        self._pool = ThreadPoolExecutor(max_workers=limits.connections, thread_name_prefix="socket")
        self._server: asyncio.AbstractServer | None = None
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._stop = asyncio.Event()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with socket_address(self.path) as address:  # a deep cache dir's too long a path
            sock.bind(address)
        try:
            chmod_own(self.path, 0o666, stat.S_IFSOCK)  # Pods may run as another uid
        except ValueError as e:
            sock.close()
            raise UsageError(
                f"the fetch socket {self.path} was replaced while the daemon made it ({e}); "
                "another process writes the cache directory: stop it, then start the daemon"
            ) from e
        self._server = await asyncio.start_unix_server(
            self._client, sock=sock, limit=self._line_limit, backlog=ACCEPT_BURST
        )
        sock.listen(BACKLOG)
        self._sweeper = asyncio.create_task(sweep(self.books, self._stop))

    @property
    def listening(self) -> bool:
        """Started and not closed: Pods can connect."""
        return self._server is not None and self._server.is_serving()

    async def close(self) -> None:
        """Stop accepting, remove the socket file and close every connection (no answer)."""
        self._stop.set()
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        close_all(list(self.books.open))
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        now = time.monotonic()
        conn = Conn(close=writer.transport.abort, idle_since=now, head_since=now)
        victim = self.books.admit(conn)
        if victim is not None:
            victim.close()
        if victim is conn:
            return
        try:
            line = await self._read_line(reader, writer)
            if line is not None and not self._stop.is_set():
                Connections.started(conn)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._pool, self._run, line, self._sender(writer))
        except (ConnectionError, RuntimeError) as e:  # RuntimeError: the pool is shut down
            log.debug("fetch socket connection ended: %s", e)
        finally:
            self.books.forget(conn)
            writer.close()  # sends what is buffered (a last answer), then closes

    async def _read_line(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes | None:
        """The request line, or None: cut off (by the header timeout, a close) or too long."""
        try:
            line = await reader.readline()
        except ValueError:  # over the limit: asyncio says "Separator is not found..."
            message = f"bad request: a request line over {self._line_limit} bytes"
            log.warning("fetch socket: %s", message)
            writer.write(
                json.dumps({"event": "error", "exit_code": 2, "message": message}).encode() + b"\n"
            )
            return None
        return line if line.endswith(b"\n") else None

    def _run(self, line: bytes, send: Send) -> None:
        try:
            self._handle(line, send)
        except OSError as e:  # the Pod went away, or the daemon closed the connection
            log.debug("fetch socket: %s", e)

    def _sender(self, writer: asyncio.StreamWriter) -> Send:
        loop = asyncio.get_running_loop()

        async def write(data: bytes) -> None:
            if writer.transport.is_closing():
                raise ConnectionResetError("the connection is closed")
            writer.write(data)
            await writer.drain()

        def send(msg: dict[str, Any]) -> None:
            if not loop.is_running():
                raise ConnectionResetError("the daemon stopped serving")
            future = asyncio.run_coroutine_threadsafe(write(json.dumps(msg).encode() + b"\n"), loop)
            try:
                future.result(SEND_TIMEOUT)
            except (TimeoutError, RuntimeError) as e:
                raise ConnectionResetError(f"cannot answer the Pod: {e!r}") from e

        return send
