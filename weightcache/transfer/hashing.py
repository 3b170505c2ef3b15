"""sha256 of objects in the store through parallel ranged GETs, without a local copy.

sha256 is sequential, so each object is read as a window of ranged GETs in flight whose
parts are hashed in order as they complete; several objects are hashed at once (one
thread each, and hashlib releases the GIL, so they use several cores). The data plane is
the one of ranged.py: plain `http.client` on threads with presigned URLs, one keep-alive
connection per worker, the same retries (5xx, 429/503 SlowDown, resets, truncated bodies,
timeouts; full-jitter backoff, resuming at the byte where a GET broke), AIMD on throttling,
and the same stall clock (`--timeout` without PROGRESS_BYTES ends it, exit 6); `--bwlimit`
bounds the bytes per second over all of its GETs.

Memory is bounded by a pool of `max_concurrency` part buffers of `part_size` bytes each
(16 x 16 MiB = 256 MiB by default, whatever the objects' sizes): a GET needs a buffer, and
a buffer comes back to the pool once its part is hashed.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import http.client
import logging
import os
import queue
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from weightcache.config import OriginSettings
from weightcache.errors import Interrupted, SourceError, TransientError
from weightcache.transfer.pacing import AIMDGate, Backoff, TokenBucket
from weightcache.transfer.parts import plan_parts
from weightcache.transfer.ranged import (
    BUFFER,
    PROGRESS_BYTES,
    NullObserver,
    TransferObserver,
    _Response,
)
from weightcache.transfer.s3 import Origin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredObject:
    """One object to hash: `label` names it in messages and keys the result."""

    bucket: str
    key: str
    size: int
    label: str

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


class _Retry(Exception):
    """A retryable failure of one GET; `throttle` if the store asked to slow down."""

    def __init__(self, reason: str, throttle: bool = False) -> None:
        super().__init__(reason)
        self.throttle = throttle


@dataclass(eq=False)
class _Run:
    """One `hash_objects()` call: its stop switch and its stall clock."""

    stop: threading.Event = field(default_factory=threading.Event)
    last_progress: float = field(default_factory=time.monotonic)
    unclocked: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, nbytes: int) -> None:
        with self.lock:
            self.unclocked += nbytes
            if self.unclocked >= PROGRESS_BYTES:
                self.unclocked = 0
                self.last_progress = time.monotonic()

    def stalled_for(self) -> float:
        return time.monotonic() - self.last_progress


class _Buffers:
    """At most `count` buffers of `size` bytes, allocated on first use and reused."""

    def __init__(self, count: int, size: int) -> None:
        self._size = size
        self._free: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(None)

    def take(self, wait: bool, stop: threading.Event) -> bytearray | None:
        """A buffer; None if none is free and not `wait`, or if `stop` is set."""
        while not stop.is_set():
            try:
                buf = self._free.get(timeout=0.2) if wait else self._free.get_nowait()
            except queue.Empty:
                if not wait:
                    return None
                continue
            return buf if buf is not None else bytearray(self._size)
        return None

    def give(self, buf: bytearray) -> None:
        self._free.put(buf)


class ObjectHasher:
    """Hashes objects of one store. One instance per command; not re-entrant."""

    def __init__(
        self,
        store: Origin,
        settings: OriginSettings,
        observer: TransferObserver | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.observer = observer or NullObserver()
        self.gate = AIMDGate(settings.max_concurrency)
        self.backoff = backoff or Backoff()
        self.tokens = TokenBucket(settings.bwlimit) if settings.bwlimit else None
        self._local = threading.local()

    def hash_objects(self, objects: list[StoredObject]) -> dict[str, str]:
        """{label: sha256 hex} of every object, read as it is in the store now.

        Raises SourceError (gone, denied, changed size while read), TransientError (the
        retries or `--timeout` ran out). On KeyboardInterrupt every GET stops at its next
        read before it propagates.
        """
        run = _Run()
        n = self.settings.max_concurrency
        buffers = _Buffers(n, self.settings.part_size)
        todo: queue.SimpleQueue[StoredObject] = queue.SimpleQueue()
        for obj in sorted(objects, key=lambda o: -o.size):  # the longest hash starts first
            todo.put(obj)
        self.observer.expect(sum(o.size for o in objects))
        digests: dict[str, str] = {}
        errors: list[BaseException] = []
        with cf.ThreadPoolExecutor(n, thread_name_prefix="wc-get") as getters:
            threads = [
                threading.Thread(
                    target=self._hash_all,
                    args=(todo, getters, buffers, run, digests, errors),
                    daemon=True,
                )
                for _ in range(min(n, len(objects)))
            ]
            for t in threads:
                t.start()
            try:
                for t in threads:
                    while t.is_alive():
                        t.join(0.5)
            finally:
                run.stop.set()  # KeyboardInterrupt: stop every GET at its next read
        if errors:
            raise errors[0]
        return digests

    # -- one thread per object being hashed ------------------------------------------------

    def _hash_all(
        self,
        todo: queue.SimpleQueue[StoredObject],
        getters: cf.ThreadPoolExecutor,
        buffers: _Buffers,
        run: _Run,
        digests: dict[str, str],
        errors: list[BaseException],
    ) -> None:
        try:
            while not run.stop.is_set():
                try:
                    obj = todo.get_nowait()
                except queue.Empty:
                    return
                digests[obj.label] = self._hash_one(obj, getters, buffers, run)
        except BaseException as e:
            errors.append(e)
            run.stop.set()

    def _hash_one(
        self, obj: StoredObject, getters: cf.ThreadPoolExecutor, buffers: _Buffers, run: _Run
    ) -> str:
        """Keep GETs of the next parts in flight while hashing each completed one in order.

        A buffer is waited for only when none of this object's parts is in flight, so an
        object that holds buffers always hashes (and frees) them: no thread waits forever.
        """
        hasher = hashlib.sha256()
        parts = collections.deque(plan_parts(obj.size, self.settings.part_size))
        inflight: collections.deque[tuple[cf.Future[None], bytearray, int]] = collections.deque()
        try:
            while parts or inflight:
                while parts:
                    buf = buffers.take(not inflight, run.stop)
                    if buf is None:
                        break
                    start, end = parts.popleft()
                    future = getters.submit(self._get_part, obj, start, end, buf, run)
                    inflight.append((future, buf, end - start))
                if run.stop.is_set():
                    raise Interrupted(f"hashing {obj.label} stopped")
                future, buf, length = inflight[0]
                future.result()
                hasher.update(memoryview(buf)[:length])
                inflight.popleft()
                buffers.give(buf)
        finally:
            for future, buf, _ in inflight:  # after an error: let the GETs end, keep no slot
                future.cancel()
                cf.wait([future])
                buffers.give(buf)
        return hasher.hexdigest()

    # -- GET workers -------------------------------------------------------------------------

    def _get_part(self, obj: StoredObject, start: int, end: int, buf: bytearray, run: _Run) -> None:
        """Fill buf[:end-start] with [start, end) of the object, retrying from where a GET broke."""
        view = memoryview(buf)
        pos = start
        failures = 0
        while pos < end:
            if run.stop.is_set():
                raise Interrupted(f"hashing {obj.label} stopped")
            if not self.gate.acquire(run.stop):
                continue
            self.observer.request_started("origin")
            before = pos
            try:
                pos = self._get_range(obj, pos, end, view[pos - start : end - start], run)
                self.gate.on_success()
            except _Retry as e:
                pos = self._local.pos
                failures = 0 if pos > before else failures + 1
                if e.throttle:
                    self.gate.on_throttle()
                    self.observer.throttled()
                self._wait_before_retry(obj, failures, str(e), run)
            finally:
                self.observer.request_finished("origin")
                self.gate.release()

    def _wait_before_retry(self, obj: StoredObject, failures: int, reason: str, run: _Run) -> None:
        stalled = run.stalled_for()
        attempts = self.settings.max_attempts
        if failures >= attempts or stalled >= self.settings.timeout:
            raise TransientError(
                f"giving up on {obj.where} after {failures} attempts and {stalled:.0f}s "
                f"without progress, last: {reason}; run it again when the store recovers"
            )
        delay = min(self.backoff.delay(max(failures, 1)), self.settings.timeout - stalled)
        log.warning(
            "%s: attempt %d/%d failed (%s); retrying in %.1fs",
            obj.label,
            max(failures, 1),
            attempts,
            reason,
            delay,
        )
        run.stop.wait(delay)

    def _get_range(self, obj: StoredObject, pos: int, end: int, into: memoryview, run: _Run) -> int:
        """GET [pos, end) into `into`; returns `end`. Raises _Retry (self._local.pos: the
        byte reached), SourceError."""
        self._local.pos = pos
        if pos == end:
            return end
        url = urllib.parse.urlsplit(self.store.presign_get(obj.bucket, obj.key))
        target = f"{url.path}?{url.query}" if url.query else url.path
        conn = self._connection(url)
        try:
            conn.request("GET", target, headers={"Range": f"bytes={pos}-{end - 1}"})
            resp = conn.getresponse()
            assert isinstance(resp, _Response)
            _check_status(obj, resp, pos, end)
            return self._read_body(obj, resp, pos, end, into, run)
        except (OSError, http.client.HTTPException) as e:
            self._drop_connection()
            raise _Retry(f"{type(e).__name__}: {e}") from e
        except _Retry:
            self._drop_connection()
            raise

    def _read_body(
        self, obj: StoredObject, resp: _Response, pos: int, end: int, into: memoryview, run: _Run
    ) -> int:
        """Read the body socket read by socket read (each one moves the stall clock);
        time spent waiting for --bwlimit tokens is ours, not a stall of the store."""
        filled = 0
        reading_since = time.monotonic()
        while pos + filled < end:
            if run.stop.is_set():
                raise Interrupted(f"hashing {obj.label} stopped")
            want = min(BUFFER, end - pos - filled)
            if self.tokens is not None:
                waited = time.monotonic()
                self.tokens.take(want)
                reading_since += time.monotonic() - waited
            n = resp.recv_into(into[filled : filled + want])
            if not n:
                self._local.pos = pos + filled
                raise _Retry(f"body ended {end - pos - filled} bytes short")
            filled += n
            self._local.pos = pos + filled
            run.note(n)
            self.observer.received(n, "origin")
            stalled = min(run.stalled_for(), time.monotonic() - reading_since)
            if stalled >= self.settings.timeout:
                raise _Retry(f"less than {PROGRESS_BYTES} bytes in {stalled:.0f}s (a trickle)")
        return end

    # -- connections (one keep-alive connection per GET worker) ------------------------------

    def _connection(self, url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        key = (url.scheme, url.netloc)
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "conn_key", None) == key:
            return conn
        self._drop_connection()
        timeout = min(self.settings.timeout, 30.0)
        if url.scheme == "https":
            context = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
            conn = http.client.HTTPSConnection(url.netloc, timeout=timeout, context=context)
        else:
            conn = http.client.HTTPConnection(url.netloc, timeout=timeout)
        conn.response_class = _Response
        self._local.conn, self._local.conn_key = conn, key
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None


def _check_status(obj: StoredObject, resp: http.client.HTTPResponse, pos: int, end: int) -> None:
    """Accept 206 of the listed size (or 200 for a whole-object read); else raise."""
    if resp.status == 206:
        total = resp.getheader("Content-Range", "").rpartition("/")[2]
        if total.isdigit() and int(total) != obj.size:
            raise SourceError(
                f"{obj.where} is {total} bytes now but was {obj.size} when listed: it changed "
                "while being hashed; run the command again once uploads are finished"
            )
        return
    if resp.status == 200 and pos == 0 and end == obj.size:
        return
    body = resp.read(4096)
    if resp.status in (429, 503) or b"SlowDown" in body:
        raise _Retry(f"HTTP {resp.status} SlowDown", throttle=True)
    if resp.status >= 500 or resp.status == 408:
        raise _Retry(f"HTTP {resp.status}")
    if resp.status == 403:
        raise SourceError(f"GET {obj.where}: access denied (403); check the credentials")
    if resp.status in (404, 416):
        raise SourceError(
            f"GET {obj.where}: HTTP {resp.status}: it changed or vanished since it was "
            "listed; run the command again once uploads are finished"
        )
    raise SourceError(f"GET {obj.where}: unexpected HTTP {resp.status}")
