"""The daemon's coordination role (design §5, Roles and The fetch socket): one download per
revision for every Pod on the node, and the daemon's side of the fetch socket.

`Coordinator` is the single-flight: callers asking for the same revision from the same
source share one fetch, each counted as its own fetch in the metrics. `FetchSocketHandler`
serves the Pods' request lines (weightcache/daemon/fetchsocket.py is the protocol and its client):
it refuses sources outside `--allow-source`, accepts, heartbeats and answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightcache.cache import alone
from weightcache.cache.index import Index
from weightcache.cache.layout import check_revision
from weightcache.cache.store import Cache
from weightcache.daemon import fetchsocket
from weightcache.daemon.fetchsocket import socket_address
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.models import DesiredState
from weightcache.errors import NoSpaceError, UsageError, WeightcacheError
from weightcache.fetch import FetchResult
from weightcache.listeners.admission import Conn, ConnectionLimits, Connections, close_all, sweep
from weightcache.listeners.http import ACCEPT_BURST, BACKLOG
from weightcache.smallfile import chmod_own
from weightcache.sourceurl import Source, SourcePrefix

log = logging.getLogger(__name__)


#: Fetches the daemon runs at once (distinct revisions; joined requests take no worker).
WORKERS = 4
#: Revisions one Pod may hold leases on through the daemon: a Pod runs a model or a few
#: (and their adapters); beyond that, one Pod would keep the cache from evicting anything.
LEASES_PER_POD = 64

FetchFn = Callable[[Source, str | None], FetchResult]
Send = Callable[[dict[str, Any]], None]


class Coordinator:
    """Single-flight fetches of revisions into one cache.

    Contract:
    - `submit(source, pod_uid)` starts the fetch of `source`, or joins the one running for
      the same (name, revision, source URL): `fetch` runs once for all of them. Another
      source under the same name and revision is a separate fetch (the Fetcher settles
      it: same manifest, or exit 2), never handed the first source's result.
    - A Pod's lease is committed before anything else, so that the marker check that
      follows sees a revision no evictor can remove any more; a Pod holds leases on at
      most LEASES_PER_POD revisions (past that, its fetch is served unleased, logged).
    - `wait()` returns only a result whose revision is still ready after its lease (a
      fetch joined before the lease may have been evicted since: it fetches again, and
      after three evictions raises NoSpaceError), and counts every caller's fetch
      (hit, miss or error) and its own wait in the metrics.
    - Once `stopping` is set, no new fetch starts (UsageError); joining one still works.
    """

    def __init__(
        self,
        fetch: FetchFn,
        cache: Cache,
        index: Index,
        metrics: Metrics,
        stopping: threading.Event,
        workers: int = WORKERS,
    ) -> None:
        self.fetch = fetch
        self.cache = cache
        self.index = index
        self.metrics = metrics
        self.stopping = stopping
        self._inflight: dict[tuple[str, str, str], Future[FetchResult]] = {}
        self._lock = threading.Lock()
        self._alone_throttled: dict[str, int] = {}  # fetch alone's record -> throttles seen
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch")

    def submit(self, source: Source, pod_uid: str | None = None) -> Future[FetchResult]:
        """Start (or join) the fetch of a revision; every caller shares one download."""
        if pod_uid:
            self._lease(source, pod_uid)
        key = (source.name, source.revision, source.url)
        with self._lock:
            future = self._inflight.get(key)
            started = future is None
            if future is None:
                if self.stopping.is_set():
                    raise UsageError("the node daemon is shutting down")
                future = self._pool.submit(self.fetch, source, pod_uid)
                self._inflight[key] = future
        if started:  # outside the lock: a fetch done already runs its callback right here
            future.add_done_callback(lambda done: self._forget(key, done))
        return future

    def _forget(self, key: tuple[str, str, str], future: Future[FetchResult]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def wait(self, source: Source, pod_uid: str | None = None, beat: Any = None) -> FetchResult:
        """Submit and wait, calling `beat()` every HEARTBEAT seconds; counts this caller's
        fetch (hit, miss or error) and its own wait in the metrics, so six Pods joining one
        download are six fetches with six durations."""
        start = time.monotonic()
        try:
            result = self._wait_ready(source, pod_uid, beat)
        except Exception:  # any failure is this caller's failed fetch
            self.metrics.fetches.labels("error").inc()
            self.metrics.duration.labels("error").observe(time.monotonic() - start)
            raise
        outcome = "hit" if result.hit else "miss"
        self.metrics.fetches.labels(outcome).inc()
        self.metrics.duration.labels(outcome).observe(time.monotonic() - start)
        return result

    def _wait_ready(self, source: Source, pod_uid: str | None, beat: Any) -> FetchResult:
        """The result of a fetch whose revision is still there after our lease: a fetch
        we joined may have found it before we leased it, and an evictor removed it since."""
        for _ in range(3):
            future = self.submit(source, pod_uid)
            while True:
                try:
                    result = future.result(timeout=fetchsocket.HEARTBEAT)
                    break
                except TimeoutError:
                    if beat is not None:
                        beat()
            if self.cache.ready(source.name, source.revision) is not None:
                return result
            log.warning("%s was evicted as it became ready; fetching it again", source.label)
            # Its done-callback may not have run yet: do not join it again.
            self._forget((source.name, source.revision, source.url), future)
        raise NoSpaceError(
            f"{source.label} was evicted three times as soon as it was ready; the cache is "
            "too small for what runs on this node: raise --capacity"
        )

    def record_hit(self, source: Source, pod_uid: str | None = None) -> None:
        """Count a Pod's hit and lease the revision for it: a Pod on a read-only mount of
        the cache (initcontainer/, design §5) cannot write its lease itself, and
        without one its revision could be evicted under the running engine. Only a hit
        on the source the revision was fetched from (its marker's) is leased: any Pod can
        name any source, and a lease on every revision would keep the cache from evicting
        anything. The caller leaves out `pod_uid` for a source outside --allow-source."""
        marker = self.cache.read_marker(source.name, source.revision)
        if pod_uid and marker is not None and marker.source == source.url:
            self._lease(source, pod_uid)
        self.metrics.fetches.labels("hit").inc()
        self.metrics.duration.labels("hit").observe(0.0)
        if marker is not None:
            self.metrics.bytes.labels("local").inc(marker.size)

    def _lease(self, source: Source, pod_uid: str) -> None:
        if not self.index.lease(source.name, source.revision, pod_uid, limit=LEASES_PER_POD):
            log.warning(
                "Pod %s holds leases on %d revisions already: %s is not leased to it and "
                "may be evicted while it runs", pod_uid, LEASES_PER_POD, source.label)  # fmt: skip

    def count_fetches(self) -> None:
        """Bring the node-wide gauges up to date with the fetches running alone on the cache
        dir (outside our observer: read from their records at each scrape), the distinct
        revisions being fetched and the copies of them downloading, by us or by them, and
        add their new throttles to ours."""
        running = alone.live(self.cache.layout)
        self.metrics.fetches_alone(len(running), sum(f.gets for f in running))
        with self._lock:
            revisions = {(name, revision) for name, revision, _ in self._inflight}
            ours = len(self._inflight)
            # Their throttles since the last read: a record only says its total so far.
            throttled = sum(
                max(0, f.throttled - self._alone_throttled.get(f.key, 0)) for f in running
            )
            self._alone_throttled = {f.key: f.throttled for f in running}
        revisions |= {(f.name, f.revision) for f in running}
        self.metrics.downloads_inflight.set(len(revisions))
        self.metrics.copies_inflight.set(ours + sum(f.pulling for f in running))
        self.metrics.throttles.inc(throttled)

    def shutdown(self) -> None:
        """Drop the fetches not started yet; running ones end when interrupted."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class FetchSocketHandler:
    """The daemon's side of the fetch socket: one request line in, JSON events out.

    Contract of `handle_line(line, send)`: any bytes are accepted; a request that cannot
    be read is one warning line and an error event; a source outside the allowed prefixes
    is `refused` (the Pod fetches alone, with its own credentials); otherwise `accepted`,
    `waiting` every HEARTBEAT seconds, then `done` or `error`. A stopping daemon answers
    no error (the Pod falls back). Nothing a Pod sends raises, except OSError when the
    connection is gone.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        allow_sources: tuple[SourcePrefix, ...] | None,
        desired: Callable[[], DesiredState],
    ) -> None:
        """`allow_sources`: `--allow-source`, or None for the parent of every source of
        the models file (`desired()`, read at each request)."""
        self.coordinator = coordinator
        self.allow_sources = allow_sources
        self.desired = desired

    @property
    def metrics(self) -> Metrics:
        return self.coordinator.metrics

    @property
    def stopping(self) -> threading.Event:
        return self.coordinator.stopping

    def handle_line(self, line: bytes, send: Send) -> None:
        """One request line from the socket (any bytes): a bad one is one warning line and
        an error event (the Pod falls back); nothing a Pod sends stops the daemon."""
        try:
            msg = fetchsocket.parse_request(line)
        except ValueError as e:
            log.warning("bad request on the fetch socket: %s", e)
            self._answer_error(send, UsageError(f"bad request: {e}"))
            return
        gone = threading.Event()

        def sending(event: dict[str, Any]) -> None:
            try:
                send(event)
            except OSError:
                gone.set()
                raise

        try:
            self.handle_fetch(msg, sending)
        except WeightcacheError as e:
            self._answer_error(send, e)
        except OSError as e:
            if gone.is_set():
                raise  # the connection is gone: nothing to answer
            # The fetch's own (a disk's EIO, a file planted in the cache): no verdict, so
            # the Pod falls back to fetching alone; said here, where the operator looks.
            log.error("fetching %s for a Pod failed: %r; the Pod fetches alone",
                      msg.get("source"), e)  # fmt: skip
        except Exception as e:  # a bug must not end the socket; the Pod falls back
            log.error("internal error serving a fetch of %s: %r", msg.get("source"), e)

    def _answer_error(self, send: Send, e: WeightcacheError) -> None:
        """A stopping daemon gives no verdict (the download was interrupted by us, not
        failed): its socket closes and the Pod falls back to fetching alone."""
        if not self.stopping.is_set():
            send({"event": "error", "exit_code": e.exit_code, "message": str(e)})

    def allowed_sources(self) -> tuple[SourcePrefix, ...]:
        """Where the daemon fetches for Pods: `--allow-source`, else the parent of every
        source of the models file (so any revision of a listed model)."""
        if self.allow_sources is not None:
            return self.allow_sources
        models = self.desired().models
        return tuple(sorted({SourcePrefix.parent_of(m.source) for m in models}))

    def refusal(self, source: Source) -> str | None:
        """Why the daemon will not fetch `source` for a Pod, or None. Its credentials
        serve only the allowed prefixes, so a Pod cannot make it read any bucket it can."""
        if any(prefix.covers(source) for prefix in self.allowed_sources()):
            return None
        return (
            f"the node daemon does not fetch {source.url} for Pods: it is not under its "
            "--allow-source prefixes"
        )

    def handle_fetch(self, msg: dict[str, Any], send: Send) -> None:
        """Serve one Pod's fetch over the socket: refuse, or accept, heartbeat, answer."""
        source = Source.parse(msg["source"], msg.get("name"), msg.get("revision"))
        check_revision(source.name, source.revision)  # before either op writes a lease
        pod_uid = msg.get("pod_uid")
        if msg.get("op") == "hit":  # leased only under the allowed prefixes
            self.coordinator.record_hit(source, pod_uid if self.refusal(source) is None else None)
            return
        refusal = self.refusal(source)
        if refusal is not None:
            allowed = " ".join(map(str, self.allowed_sources())) or "none"
            log.info("refused a Pod's fetch of %s (allowed: %s)", source.url, allowed)
            send({"event": "refused", "message": refusal})
            return
        send({"event": "accepted"})
        self.metrics.replica_waiting(+1)
        try:
            beat = lambda: send({"event": "waiting"})  # noqa: E731
            result = self.coordinator.wait(source, pod_uid, beat=beat)
            send({"event": "done", "result": result.to_dict()})
        except WeightcacheError as e:
            self._answer_error(send, e)
        finally:
            self.metrics.replica_waiting(-1)


LineHandler = Callable[[bytes, Send], None]  # blocking: runs in a worker thread
SEND_TIMEOUT = 30.0  # a Pod that does not read its socket for this long is dropped


class SocketServer:
    """The Unix socket: one request line per connection (at most `line_limit` bytes,
    within `limits.header` seconds), then `handle(line, send)` in a worker thread, which
    answers through `send` (thread-safe) as long as it likes. The connection closes when
    `handle` returns."""

    def __init__(
        self, path: Path, handle: LineHandler, limits: ConnectionLimits, line_limit: int
    ) -> None:
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
