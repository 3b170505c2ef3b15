"""The data plane: parallel ranged GETs written at their offsets, hashed as they land.

Why plain `http.client` on threads rather than aiohttp or boto3 `get_object`: each worker
`readinto`s a fixed 256 KiB buffer and `pwrite`s it, both releasing the GIL, so memory stays
at workers x 256 KiB whatever the model size and no per-request botocore machinery runs
(benchmarks/cold_fetch.py measures the result against s5cmd). boto3 still signs: every GET
uses a presigned URL from `Origin.presign_get`.

sha256 is computed while the download runs, over the contiguous prefix of completed parts
(read back from the page cache by whichever worker extends it), so there is no second
pass after the last byte and the digest is ready when the last part lands.

Retries (design §4): 5xx, 429/503 SlowDown, resets, truncated bodies and socket timeouts are
retried with full-jitter exponential backoff, resuming the part at the byte where it broke.
Throttling halves the concurrency (AIMD). A part gives up after `max_attempts` failures
without progress; the whole download gives up when less than PROGRESS_BYTES arrived in
`timeout` seconds. The stall clock is checked after every socket read, not every buffer:
a store trickling a byte a second never fills a buffer, and would otherwise hang the
fetch forever while each read still beats the socket timeout (design §4, Stall bound).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import http.client
import logging
import os
import queue
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from weightcache.config import OriginSettings
from weightcache.errors import (
    IntegrityError,
    Interrupted,
    NoSpaceError,
    SourceError,
    TransientError,
    WeightcacheError,
)
from weightcache.transfer.pacing import AIMDGate, Backoff, TokenBucket
from weightcache.transfer.parts import PartState
from weightcache.transfer.s3 import Origin

log = logging.getLogger(__name__)
#: Bytes per worker read and per hashing read-back, into one preallocated buffer per
#: thread: no large allocation per chunk, so RSS stays flat (glibc arenas per thread
#: otherwise hoard freed chunks). 256 KiB stays in the CPU cache between recv and pwrite:
#: measured on 4 GiB, kernel time 2.1 s vs 5.7-7.8 s with 1 MiB, wall 5.5 s vs 7.7-8.8 s.
BUFFER = 256 << 10
#: Bytes that move the stall clock: less than this in `--timeout` seconds (over all of a
#: download's connections) is a trickle, not progress, and ends the download with exit 6.
#: A slow but real link delivers whole TCP segments (~1.4 KB), so it always moves it.
PROGRESS_BYTES = 1 << 10
#: Files one download keeps open at once: jobs are downloaded in batches of this many, so
#: a manifest of 50k small files needs 64 fds, not 50k (EMFILE at the usual 1024).
MAX_OPEN_FILES = 64
#: How often a file's part state is written, at most: a kill loses at most the parts that
#: completed in the last interval (they are fetched again), never correctness.
SAVE_INTERVAL = 0.25


class TransferObserver(Protocol):
    """Hooks for progress and metrics; called from worker threads."""

    def expect(self, nbytes: int) -> None: ...
    def request_started(self, source: str) -> None: ...
    def request_finished(self, source: str) -> None: ...
    def received(self, nbytes: int, source: str) -> None: ...
    def throttled(self) -> None: ...
    def verify_failed(self) -> None: ...


class NullObserver:
    def expect(self, nbytes: int) -> None: ...
    def request_started(self, source: str) -> None: ...
    def request_finished(self, source: str) -> None: ...
    def received(self, nbytes: int, source: str) -> None: ...
    def throttled(self) -> None: ...
    def verify_failed(self) -> None: ...


@dataclass
class BlobJob:
    """One object to bring into `partial`; `sha256` None means "compute, don't check".

    With `peer` set ("http://host:port"), the bytes come from that node's daemon
    (GET /blobs/sha256/<hex> with the shared token) instead of the object store, and a
    failing peer is given up on after `attempts` tries so the caller can fall back.
    """

    bucket: str
    key: str
    size: int
    sha256: str | None
    partial: Path
    label: str  # the manifest path, for messages
    peer: str | None = None
    token: str | None = None
    attempts: int | None = None  # None: the store settings' max_attempts

    @property
    def state_path(self) -> Path:
        return self.partial.with_name(self.partial.name + ".json")

    @property
    def source(self) -> str:
        """Where the bytes come from, for metrics: "origin" or "peer"."""
        return "origin" if self.peer is None else "peer"

    @property
    def where(self) -> str:
        if self.peer is None:
            return f"s3://{self.bucket}/{self.key}"
        return f"{self.peer}/blobs/sha256/{self.sha256}"

    def request(self, store: Origin) -> tuple[str, dict[str, str]]:
        """(URL, extra headers) for a GET of this object."""
        if self.peer is None:
            return store.presign_get(self.bucket, self.key), {}
        return self.where, {"Authorization": f"Bearer {self.token}"}


class _Retry(Exception):
    """A retryable failure of one request; `throttle` if the store asked to slow down."""

    def __init__(self, reason: str, throttle: bool = False) -> None:
        super().__init__(reason)
        self.throttle = throttle


@dataclass(eq=False)
class _Run:
    """One `download()` call: its stop switch, its stall clock, the bytes it received."""

    stop: threading.Event = field(default_factory=threading.Event)
    last_progress: float = field(default_factory=time.monotonic)
    unclocked: int = 0  # bytes received since the stall clock last moved
    received: collections.Counter[str] = field(default_factory=collections.Counter)

    def note(self, nbytes: int, source: str) -> None:
        """Count bytes just received; call under the downloader's counter lock."""
        self.received[source] += nbytes
        self.unclocked += nbytes
        if self.unclocked >= PROGRESS_BYTES:
            self.unclocked = 0
            self.last_progress = time.monotonic()

    def stalled_for(self) -> float:
        return time.monotonic() - self.last_progress


@dataclass(frozen=True)
class Downloaded:
    """What one `download()` call did: each job's actual sha256 by label, and the bytes
    this call received by source ("origin", "peer"), whatever other calls do meanwhile."""

    digests: dict[str, str]
    received: dict[str, int]


class _Response(http.client.HTTPResponse):
    """An HTTP response that can read what one recv brings, into a caller's buffer."""

    def recv_into(self, b: memoryview) -> int:
        """Up to len(b) bytes with at most one socket read (HTTPResponse.readinto waits
        for the whole buffer, however slowly it fills)."""
        if self.fp is None or self.chunked or self.length is None:
            data = self.read1(len(b))  # peers and odd stores: a copy, but rare
            b[: len(data)] = data
            return len(data)
        n = self.fp.readinto1(b[: self.length])
        if not n and b:
            self._close_conn()  # type: ignore[attr-defined]
        else:
            self.length -= n
            if not self.length:
                self._close_conn()  # type: ignore[attr-defined]
        return n


@dataclass
class _File:
    job: BlobJob
    fd: int
    state: PartState
    run: _Run
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    hashed: int = 0
    hashing: bool = False
    digest: str | None = None  # set, after an fsync, once every byte is hashed
    saved_at: float = 0.0  # when the part state was last written
    lock: threading.Lock = field(default_factory=threading.Lock)


class RangedDownloader:
    """Downloads blobs into resumable partial files. One instance per process."""

    def __init__(
        self,
        store: Origin,
        settings: OriginSettings,
        observer: TransferObserver | None = None,
        limiter: TokenBucket | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.observer = observer or NullObserver()
        self.tokens = limiter or (TokenBucket(settings.bwlimit) if settings.bwlimit else None)
        self.gate = AIMDGate(settings.max_concurrency)
        self.backoff = backoff or Backoff()
        self._local = threading.local()
        self._runs: set[_Run] = set()
        self._closing = False
        self._counter_lock = threading.Lock()

    def download(self, jobs: list[BlobJob]) -> Downloaded:
        """Fill every job's partial file; return each one's actual sha256 and the bytes
        this call received (exact with concurrent calls on one downloader, as in the daemon).

        The partials are fsynced when this returns. A digest differing from the expected
        one is reported, not raised: the caller decides whether to try again. Raises
        TransientError, SourceError, NoSpaceError, Interrupted.
        """
        run = _Run()
        with self._counter_lock:
            if self._closing:
                raise Interrupted("shutting down; the download was not started")
            self._runs.add(run)
        try:
            digests: dict[str, str] = {}
            for i in range(0, len(jobs), MAX_OPEN_FILES):
                digests.update(self._download_batch(jobs[i : i + MAX_OPEN_FILES], run))
            return Downloaded(digests, dict(run.received))
        finally:
            run.stop.set()
            with self._counter_lock:
                self._runs.discard(run)

    def _download_batch(self, jobs: list[BlobJob], run: _Run) -> dict[str, str]:
        files: list[_File] = []
        try:
            for job in jobs:
                files.append(self._open(job, run))
            return self._download(files, run)
        finally:
            for f in files:
                self._save_unfinished(f)
                os.close(f.fd)

    def _save_unfinished(self, f: _File) -> None:
        """Persist the parts finished since the last periodic save when a download stops
        short (SIGTERM, a failure), so that the next one resumes after every one of them."""
        with f.lock:
            snapshot = list(f.state.done)
        if not all(snapshot):
            with contextlib.suppress(OSError):  # the error that stopped us matters more
                f.state.save(f.job.state_path, snapshot)

    def _download(self, files: list[_File], run: _Run) -> dict[str, str]:
        tasks: queue.SimpleQueue[tuple[_File, int]] = queue.SimpleQueue()
        # Round-robin over files: every file advances its hash frontier at once, so the
        # hashing left after the last byte is split over files (and cores), not one tail.
        pending = [f.state.pending() for f in files]
        for round_ in range(max((len(p) for p in pending), default=0)):
            for f, parts in zip(files, pending, strict=True):
                if round_ < len(parts):
                    tasks.put((f, parts[round_]))
        for f in files:
            self._advance_hash(f)  # a resumed file rehashes its completed prefix
        self.observer.expect(sum(f.job.size - f.state.bytes_done() for f in files))
        errors: list[BaseException] = []
        workers = [
            threading.Thread(target=self._work, args=(run, tasks, errors), daemon=True)
            for _ in range(min(self.settings.max_concurrency, max(1, tasks.qsize())))
        ]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():
                w.join(0.5)
        if errors:
            raise errors[0]
        if run.stop.is_set():
            raise Interrupted("download interrupted; partial files are kept for resume")
        return {f.job.label: self._finish(f) for f in files}

    def interrupt(self) -> None:
        """Stop every download after its current read, now and for good (SIGTERM)."""
        with self._counter_lock:
            self._closing = True
            for run in self._runs:
                run.stop.set()

    # -- files ---------------------------------------------------------------------------------

    def _open(self, job: BlobJob, run: _Run) -> _File:
        state = PartState.load(job.state_path, job.size, self.settings.part_size)
        _make_writable(job.partial)
        fd = os.open(job.partial, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not any(state.done) or os.fstat(fd).st_size != job.size:
                state = PartState(job.size, self.settings.part_size)
                os.ftruncate(fd, 0)
                _preallocate(fd, job)
                state.save(job.state_path)
            elif state.bytes_done():
                log.info(
                    "resuming %s: %d of %d bytes already on disk",
                    job.label,
                    state.bytes_done(),
                    job.size,
                )
        except BaseException:
            os.close(fd)
            raise
        return _File(job, fd, state, run)

    def _finish(self, f: _File) -> str:
        self._advance_hash(f)
        if f.digest is None:  # every part done, so only a bug can get here
            raise WeightcacheError(f"internal error: {f.job.label} hashed {f.hashed} bytes")
        return f.digest

    def _advance_hash(self, f: _File) -> None:
        """Hash the newly contiguous prefix; only one thread hashes a file at a time."""
        with f.lock:
            if f.hashing:
                return
            f.hashing = True
        try:
            while True:
                with f.lock:
                    end = f.state.contiguous_end()
                    if end <= f.hashed:
                        if f.hashed == f.job.size and f.digest is None:
                            os.fsync(f.fd)  # here, in a worker, while others download
                            f.digest = f.hasher.hexdigest()
                        f.hashing = False
                        return
                view = memoryview(self._buffer())
                while f.hashed < end:
                    n = os.preadv(f.fd, [view[: min(BUFFER, end - f.hashed)]], f.hashed)
                    if not n:
                        raise WeightcacheError(f"internal error: {f.job.partial} is short")
                    f.hasher.update(view[:n])
                    f.hashed += n
        except BaseException:
            with f.lock:
                f.hashing = False
            raise

    # -- workers -------------------------------------------------------------------------------

    def _work(
        self, run: _Run, tasks: queue.SimpleQueue[tuple[_File, int]], errors: list[BaseException]
    ) -> None:
        try:
            while True:
                try:
                    f, index = tasks.get_nowait()
                except queue.Empty:
                    return
                if run.stop.is_set():
                    return
                self._fetch_part(f, index)
                start, end = f.state.parts[index]
                _start_writeback(f.fd, start, end - start)
                self._mark_done(f, index)
                self._advance_hash(f)
        except BaseException as e:
            errors.append(e)
            run.stop.set()

    def _mark_done(self, f: _File, index: int) -> None:
        """Record a finished part; persist the state at most every SAVE_INTERVAL per file,
        outside the file's lock (profiled: saving under the lock stalled other workers)."""
        now = time.monotonic()
        with f.lock:
            f.state.done[index] = True
            snapshot = list(f.state.done) if now - f.saved_at >= SAVE_INTERVAL else None
            if snapshot is not None:
                f.saved_at = now
        if snapshot is not None:
            f.state.save(f.job.state_path, snapshot)

    def _fetch_part(self, f: _File, index: int) -> None:
        start, end = f.state.parts[index]
        pos = start
        failures = 0
        while pos < end:
            if f.run.stop.is_set():
                raise Interrupted("download interrupted; partial files are kept for resume")
            if not self.gate.acquire(f.run.stop):
                continue
            self.observer.request_started(f.job.source)
            before = pos
            try:
                pos = self._get_range(f, pos, end)
                self.gate.on_success()
            except _Retry as e:
                pos = self._local.pos  # the byte where it broke
                failures = 0 if pos > before else failures + 1
                if e.throttle and f.job.peer is None:
                    self.gate.on_throttle()
                    self.observer.throttled()
                self._wait_before_retry(f, failures, str(e))
            finally:
                self.observer.request_finished(f.job.source)
                self.gate.release()

    def _wait_before_retry(self, f: _File, failures: int, reason: str) -> None:
        attempts = f.job.attempts or self.settings.max_attempts
        stalled = f.run.stalled_for()
        if failures >= attempts or stalled >= self.settings.timeout:
            raise TransientError(
                f"giving up on {f.job.label} ({f.job.where}) after {failures} attempts and "
                f"{stalled:.0f}s without progress, last: {reason}; partial data is kept, run "
                "the fetch again when the store recovers"
            )
        delay = min(self.backoff.delay(max(failures, 1)), self.settings.timeout - stalled)
        log.warning(
            "%s: attempt %d/%d failed (%s); retrying in %.1fs",
            f.job.label,
            max(failures, 1),
            attempts,
            reason,
            delay,
        )
        f.run.stop.wait(delay)

    def _get_range(self, f: _File, pos: int, end: int) -> int:
        """GET [pos, end) and write it at its offset; returns `end`. Raises _Retry."""
        self._local.pos = pos
        if pos == end:
            return end
        location, headers = f.job.request(self.store)
        url = urllib.parse.urlsplit(location)
        target = f"{url.path}?{url.query}" if url.query else url.path
        conn = self._connection(url)
        try:
            conn.request("GET", target, headers={**headers, "Range": f"bytes={pos}-{end - 1}"})
            resp = conn.getresponse()
            assert isinstance(resp, _Response)
            self._check_status(f.job, resp, pos, end)
            return self._write_body(f, resp, pos, end)
        except (OSError, http.client.HTTPException) as e:
            self._drop_connection()
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise
            raise _Retry(f"{type(e).__name__}: {e}") from e
        except _Retry:
            self._drop_connection()
            raise

    def _write_body(self, f: _File, resp: _Response, pos: int, end: int) -> int:
        view = memoryview(self._buffer())
        while pos < end:
            want = min(BUFFER, end - pos)
            if self.tokens is not None:
                self.tokens.take(want)
            got = self._fill(f, resp, view[:want])
            if not got and f.run.stop.is_set():
                raise Interrupted("download interrupted; partial files are kept for resume")
            if not got:
                raise http.client.IncompleteRead(b"", end - pos)
            try:
                _pwrite_all(f.fd, view[:got], pos)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise NoSpaceError(
                        f"no space left on the cache disk while writing {f.job.label}; free "
                        "space or lower --capacity"
                    ) from e
                raise
            pos += got
            self._local.pos = pos
            if f.run.stop.is_set() and pos < end:
                raise Interrupted("download interrupted; partial files are kept for resume")
        return pos

    def _fill(self, f: _File, resp: _Response, view: memoryview) -> int:
        """Read into `view` until it is full, the body ends or the run stops; every
        socket read moves the stall clock, and a stalled run gives up here (_Retry).

        Time spent before this call (waiting for --bwlimit tokens) is ours, not the
        store's: only a run stalled while this worker was reading gives up."""
        filled = 0
        reading_since = time.monotonic()
        while filled < len(view) and not f.run.stop.is_set():
            n = resp.recv_into(view[filled:])
            if not n:
                break
            filled += n
            with self._counter_lock:
                f.run.note(n, f.job.source)
            self.observer.received(n, f.job.source)
            stalled = min(f.run.stalled_for(), time.monotonic() - reading_since)
            if stalled >= self.settings.timeout:
                raise _Retry(f"less than {PROGRESS_BYTES} bytes in {stalled:.0f}s (a trickle)")
        return filled

    def _check_status(
        self, job: BlobJob, resp: http.client.HTTPResponse, pos: int, end: int
    ) -> None:
        where = job.where
        if resp.status == 206:
            total = resp.getheader("Content-Range", "").rpartition("/")[2]
            if total.isdigit() and int(total) != job.size:
                raise IntegrityError(
                    f"{job.label}: {where} is {total} bytes now but was {job.size} when listed; "
                    "the object changed during the fetch, run it again"
                )
            return
        if resp.status == 200 and pos == 0 and end == job.size:
            return  # a store that ignores Range for a whole-object read
        body = resp.read(4096)
        if resp.status in (429, 503) or b"SlowDown" in body:
            raise _Retry(f"HTTP {resp.status} SlowDown", throttle=True)
        if resp.status >= 500 or resp.status == 408:
            raise _Retry(f"HTTP {resp.status}")
        if resp.status == 403:
            raise SourceError(f"GET {where}: access denied (403); check the credentials")
        if resp.status in (404, 416):
            raise SourceError(f"GET {where}: HTTP {resp.status}; the object changed or vanished")
        raise SourceError(f"GET {where}: unexpected HTTP {resp.status}")

    # -- connections ---------------------------------------------------------------------------

    def _connection(self, url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        """This thread's keep-alive connection to the URL's host."""
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

    def _buffer(self) -> bytearray:
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(BUFFER)
        return buf


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # libc, already loaded
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):
        return None


_sync_file_range = _load_sync_file_range() if os.uname().sysname == "Linux" else None
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a finished part to disk now (async), so that the fsync before the
    blob is published finds little left to do. Best effort: a no-op off Linux."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _make_writable(partial: Path) -> None:
    """A kill between publishing's chmod 0444 of a verified partial and its rename leaves
    it read-only: as the non-root uid that wrote it, O_RDWR would fail with EACCES until
    tmp/ is cleaned a day later. It is ours to write again."""
    try:
        mode = partial.stat().st_mode
    except FileNotFoundError:
        return
    if not mode & stat.S_IWUSR:
        os.chmod(partial, mode | stat.S_IWUSR)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _preallocate(fd: int, job: BlobJob) -> None:
    """Reserve the blob's space now, so a full disk fails before the download, not after."""
    if job.size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, job.size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise NoSpaceError(
                f"no space left on the cache disk for {job.label} ({job.size} bytes); free "
                "space or lower --capacity"
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, job.size)
