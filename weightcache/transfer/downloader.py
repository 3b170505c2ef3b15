"""The downloader: parallel range reads of blob sources, written at their offsets, hashed
as they land (partial.py), resumable byte by byte within each part (parts.py).

It reads every blob through the `BlobSource` seam (sources.py) and knows nothing of what
is behind it: the origin store, a peer, a file. One policy for all (design §4): retryable
failures (5xx, 429/503 SlowDown, resets, truncated bodies, timeouts) are retried with
full-jitter exponential backoff, resuming the part at the byte where it broke; a source's
throttling halves the concurrency (AIMD) if the source says it means "slow down". A part
gives up after its source's `attempts` (or `max_attempts`) failures without progress; the
whole download gives up when less than PROGRESS_BYTES arrived in `timeout` seconds. The
stall clock is checked after every read, not every buffer: a store trickling a byte a
second never fills a buffer, and would otherwise hang the fetch forever while each read
still beats the read timeout (design §4, Stall bound). A starved reader at a file's hash
frontier has its part's tail read by a faster worker (design §4, Stragglers).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from weightcache.config import OriginSettings
from weightcache.errors import Interrupted, TransientError
from weightcache.transfer.pacing import AIMDGate, Backoff, TokenBucket, tries
from weightcache.transfer.partial import PartialFile
from weightcache.transfer.sources import (
    READ_TIMEOUT,
    BlobSource,
    RangeReader,
    RetryRange,
    part_size_for,
    whole_only,
)

log = logging.getLogger(__name__)
#: Bytes per worker read (and per hashing read-back where a file cannot be mapped), into
#: one preallocated buffer per thread: no large allocation per chunk, so RSS stays flat
#: (glibc arenas per thread otherwise hoard freed chunks). 256 KiB stays in the CPU cache
#: between recv and pwrite: measured on 4 GiB, kernel time 2.1 s vs 5.7-7.8 s with 1 MiB,
#: wall 5.5 s vs 7.7-8.8 s.
BUFFER = 256 << 10
#: Bytes that move the stall clock: less than this in `--timeout` seconds (over all of a
#: download's connections) is a trickle, not progress, and ends the download with exit 6.
#: A slow but real link delivers whole TCP segments (~1.4 KB), so it always moves it.
PROGRESS_BYTES = 1 << 10
#: Files one download keeps open at once: jobs are downloaded in batches of this many, so
#: a manifest of 50k small files needs 64 fds, not 50k (EMFILE at the usual 1024).
MAX_OPEN_FILES = 64
#: A straggler: the part at a file's hash frontier, read for at least STRAGGLER_AFTER
#: seconds at less than 1/STRAGGLER_RATIO of the rate a free worker's connection just had,
#: with at least STRAGGLER_MIN bytes left. The free worker takes its tail (`_take_tail`):
#: a starved connection otherwise holds every later byte of the file unhashed until the
#: end (seen: ~800 MiB left to hash after the last byte of a link-bound 1 GiB fetch).
STRAGGLER_AFTER, STRAGGLER_RATIO, STRAGGLER_MIN = 1.0, 3.0, 2 * BUFFER
#: Seconds a worker with no part left to start waits before it looks for a straggler again.
STRAGGLER_POLL = 0.1


class TransferObserver(Protocol):
    """Hooks for progress and metrics; called from worker threads. `source` is the
    `BlobSource.kind` of the bytes: "origin" or "peer"."""

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
    """One blob to bring from `source` into `partial`; `label` (the manifest path) names
    it in messages and in `Downloaded.digests`. With `check` (an algorithm of
    checksums.py; a composite one with its `check_parts`), its digest by that algorithm is
    computed too (`Downloaded.checks`)."""

    source: BlobSource
    size: int
    partial: Path
    label: str
    check: str | None = None
    check_parts: tuple[int, ...] = ()


@dataclass(eq=False)
class Run:
    """One transfer call (`download()`, `ObjectHasher.hash_objects()`): its stop switch,
    its stall clock, the bytes it received by source kind."""

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
    this call received by source kind ("origin", "peer"), whatever other calls do meanwhile;
    `checks`: the actual digest by its `check` algorithm of each job that asked for one."""

    digests: dict[str, str]
    received: dict[str, int]
    checks: dict[str, str] = field(default_factory=dict)


class _Cut(Exception):
    """Raised inside a source's range context to stop reading before the range's end."""


@dataclass
class _Flight:
    """A part being read by the worker that took it: since when and from where its rate is
    measured (its current attempt's start, moved on every 1-2 s), where it ends now
    (lowered when another worker takes its tail), and how many of its ranges are still
    being read (its own and each tail taken)."""

    began: float
    start: int
    end: int
    ranges: int = 1


@dataclass
class _File:
    """A job of one download with its open partial file, and its parts in flight."""

    job: BlobJob
    partial: PartialFile
    run: Run
    flights: dict[int, _Flight] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def end_of(self, index: int) -> int:
        """Where the reader of part `index` stops now (its end, or where a tail begins)."""
        with self.lock:
            flight = self.flights.get(index)
        return self.partial.state.parts[index][1] if flight is None else flight.end


class RangedDownloader:
    """Downloads blobs from their sources into resumable partial files. One instance per
    process (one token bucket, one AIMD gate); `download` may run in several threads."""

    def __init__(
        self,
        settings: OriginSettings,
        observer: TransferObserver | None = None,
        limiter: TokenBucket | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.settings = settings
        self.observer = observer or NullObserver()
        self.tokens = limiter or (TokenBucket(settings.bwlimit) if settings.bwlimit else None)
        self.gate = AIMDGate(settings.max_concurrency)
        self.backoff = backoff or Backoff()
        #: How long one read from a source may block (`BlobSource.open_range`).
        self.read_timeout = min(settings.timeout, READ_TIMEOUT)
        self._buffers = threading.local()
        self._runs: set[Run] = set()
        self._closing = False
        self._counter_lock = threading.Lock()

    def download(self, jobs: list[BlobJob]) -> Downloaded:
        """Fill every job's partial file; return each one's actual sha256 and the bytes
        this call received (exact with concurrent calls on one downloader, as in the daemon).

        The partials are fsynced when this returns. A digest differing from the expected
        one is reported, not raised: the caller decides whether to try again. Raises
        TransientError, SourceError, IntegrityError (the object changed size), NoSpaceError,
        Interrupted.
        """
        run = Run()
        with self._counter_lock:
            if self._closing:
                raise Interrupted("shutting down; the download was not started")
            self._runs.add(run)
        try:
            digests: dict[str, str] = {}
            checks: dict[str, str] = {}
            for i in range(0, len(jobs), MAX_OPEN_FILES):
                digests.update(self._download_batch(jobs[i : i + MAX_OPEN_FILES], run, checks))
            return Downloaded(digests, dict(run.received), checks)
        finally:
            run.stop.set()
            with self._counter_lock:
                self._runs.discard(run)

    @property
    def closing(self) -> bool:
        """True once `interrupt()` was called: downloads outside `download()` (the
        swarm's, weightcache/swarm/) stop as this one's do."""
        return self._closing

    def interrupt(self) -> None:
        """Stop every download after its current read, now and for good (SIGTERM)."""
        with self._counter_lock:
            self._closing = True
            for run in self._runs:
                run.stop.set()

    def _download_batch(
        self, jobs: list[BlobJob], run: Run, checks: dict[str, str]
    ) -> dict[str, str]:
        """The batch's sha256 digests; the `check` digests go into `checks`."""
        files: list[_File] = []
        try:
            for job in jobs:
                part_size = part_size_for(job.source, job.size, self.settings.part_size)
                partial = PartialFile.open(job.partial, job.label, job.size, part_size,
                                           job.check, job.check_parts)  # fmt: skip
                files.append(_File(job, partial, run))
            digests = self._download(files, run)
            for f in files:
                if f.partial.check_digest is not None:
                    checks[f.job.label] = f.partial.check_digest
            return digests
        finally:
            for f in files:
                f.partial.close()

    def _download(self, files: list[_File], run: Run) -> dict[str, str]:
        # A deque, not a queue.Queue: filled before the workers start, then only taken
        # from (popleft is atomic); the queue module's import delayed the first GET.
        tasks: collections.deque[tuple[_File, int]] = collections.deque()
        # Round-robin over files: every file advances its hash frontier at once, so the
        # hashing left after the last byte is split over files (and cores), not one tail.
        pending = [f.partial.state.pending() for f in files]
        for round_ in range(max((len(p) for p in pending), default=0)):
            for f, parts in zip(files, pending, strict=True):
                if round_ < len(parts):
                    tasks.append((f, parts[round_]))
        for f in files:
            # A resumed file rehashes its prefix: long for a large one, so SIGTERM stops it.
            f.partial.advance_hash(self._buffer(), run.stop.is_set)
        self.observer.expect(sum(f.job.size - f.partial.state.bytes_done() for f in files))
        errors: list[BaseException] = []
        workers = [
            threading.Thread(target=self._work, args=(run, files, tasks, errors), daemon=True)
            for _ in range(min(self.settings.max_concurrency, max(1, len(tasks))))
        ]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():
                w.join(0.5)
        if errors:
            raise errors[0]
        if run.stop.is_set():
            raise Interrupted()
        return {f.job.label: f.partial.finish(self._buffer()) for f in files}

    def _work(
        self, run: Run, files: list[_File], tasks: collections.deque[tuple[_File, int]],
        errors: list[BaseException],
    ) -> None:  # fmt: skip
        try:
            rate = 0.0  # bytes/s of this worker's last range: what its connection can do
            while not run.stop.is_set():
                tail = self._take_tail(files, rate)
                if tail is not None:
                    f, index, start, end = tail
                    rate = self._fetch(f, index, start, end, tail=True)
                else:
                    try:
                        f, index = tasks.popleft()
                    except IndexError:
                        if not any(g.flights for g in files):
                            return
                        run.stop.wait(STRAGGLER_POLL)  # the last parts may yet straggle
                        continue
                    pos, end = f.partial.state.resume_at(index), f.partial.state.parts[index][1]
                    with f.lock:
                        f.flights[index] = _Flight(time.monotonic(), pos, end)
                    rate = self._fetch(f, index, pos, end, tail=False)
                with f.lock:
                    flight = f.flights[index]
                    flight.ranges -= 1
                    if flight.ranges:
                        continue  # the part's other range is still being read
                    del f.flights[index]
                f.partial.mark_done(index)
                f.partial.advance_hash(self._buffer(), run.stop.is_set)
        except BaseException as e:
            errors.append(e)
            run.stop.set()

    def _take_tail(self, files: list[_File], rate: float) -> tuple[_File, int, int, int] | None:
        """(file, part, start, end) of a straggler's tail for a worker whose connection
        just read at `rate`, now the straggler's end; None if no part at a hash frontier
        straggles. The straggler keeps the bytes it would read, at its rate, in the time
        this worker takes for the rest."""
        if rate <= 0:
            return None
        now = time.monotonic()
        for f in files:
            state = f.partial.state
            frontier = f.partial.hashed  # read without the partial's lock: a hint
            if frontier >= f.job.size or whole_only(f.job.source):
                continue
            index = frontier // state.part_size
            with f.lock:
                flight = f.flights.get(index)
                if flight is None or now - flight.began < STRAGGLER_AFTER:
                    continue
                pos = state.parts[index][0] + state.filled(index)
                slow = max(pos - flight.start, 0) / (now - flight.began)
                # Judged on its recent rate: the store may have been slow for every reader.
                if now - flight.began >= 2 * STRAGGLER_AFTER:
                    flight.began, flight.start = now, pos
                if slow * STRAGGLER_RATIO > rate or flight.end - pos < STRAGGLER_MIN:
                    continue
                start = pos + int((flight.end - pos) * slow / (slow + rate))
                start = max(start, pos + BUFFER)  # past what its current read may bring
                end, flight.end = flight.end, start
                flight.ranges += 1
            log.debug("%s: part %d at %.0f B/s, another connection at %.0f B/s reads [%d, %d)",
                      f.job.label, index, slow, rate, start, end)  # fmt: skip
            return f, index, start, end
        return None

    # -- one range of a part ---------------------------------------------------------------

    def _fetch(self, f: _File, index: int, pos: int, end: int, tail: bool) -> float:
        """Bring [pos, end) of part `index` from the job's source, resuming where each
        attempt broke; the part's own reader (not a `tail`) records its progress in the part
        state and stops where a tail taken from it begins. Returns the rate of the last
        attempt (bytes/s)."""
        source = f.job.source
        failures, rate = 0, 0.0
        while True:
            limit = end if tail else f.end_of(index)
            if pos >= limit:
                return rate
            if f.run.stop.is_set():
                raise Interrupted()
            if not self.gate.acquire(f.run.stop):
                continue
            self.observer.request_started(source.kind)
            began = time.monotonic()
            if not tail:
                with f.lock:
                    f.flights[index].began, f.flights[index].start = began, pos
            try:
                reached, broke = self._copy_range(f, index, pos, limit, tail)
                if broke is None:
                    self.gate.on_success()
            finally:
                self.observer.request_finished(source.kind)
                self.gate.release()
            rate = (reached - pos) / max(time.monotonic() - began, 1e-6)
            if broke is not None:
                failures = 0 if reached > pos else failures + 1
                if broke.throttle and source.throttles:
                    self.gate.on_throttle()
                    self.observer.throttled()
                self._wait_before_retry(f, failures, str(broke))
            pos = reached

    def _copy_range(
        self, f: _File, index: int, start: int, end: int, tail: bool
    ) -> tuple[int, RetryRange | None]:
        """Copy [start, end) of part `index` from the source into the partial file; the
        part's own reader records each write in the part state and stops early where a
        tail taken from it begins (the connection is then dropped). Returns the byte
        reached and, if the read broke before the end, the retryable failure that broke
        it: the bytes read before the break are written, so the next attempt (or
        download) starts there."""
        pos, asked = start, end
        view = memoryview(self._buffer())
        try:
            with f.job.source.open_range(start, end, f.job.size, self.read_timeout) as reader:
                while True:
                    if not tail:
                        end = min(end, f.end_of(index))
                    if pos >= end:
                        break
                    want = min(BUFFER, end - pos)
                    if self.tokens is not None:
                        self.tokens.take(want)
                    got, broke = self._fill(f, reader, view[:want])
                    self._write(f, view[:got], pos)
                    if not tail:  # a tail's bytes are past the part's written start
                        f.partial.wrote(index, pos + got)
                    f.partial.hash_landed(view[:got], pos)
                    pos += got
                    if broke is not None:
                        raise broke  # through the source's context: it drops the connection
                    if f.run.stop.is_set() and pos < end:
                        raise Interrupted()
                    if not got:
                        raise RetryRange(f"the body ended {end - pos} bytes short")
                if pos < asked:  # a tail begins here: the rest of the response is not read
                    raise _Cut()  # through the source's context: it drops the connection
        except RetryRange as e:
            return pos, e
        except _Cut:
            pass
        return pos, None

    @staticmethod
    def _write(f: _File, data: memoryview, pos: int) -> None:
        try:
            f.partial.write(data, pos)
        except OSError as e:  # not ENOSPC (NoSpaceError): retried, as a read error would be
            raise RetryRange(f"{type(e).__name__}: {e}") from e

    def _fill(
        self, f: _File, reader: RangeReader, view: memoryview
    ) -> tuple[int, RetryRange | None]:
        """Read into `view` until it is full, the range ends or the run stops; return the
        bytes read and the failure that broke the read, if one did. Every read moves the
        stall clock, and a stalled run breaks the read here.

        Time spent before this call (waiting for --bwlimit tokens) is ours, not the
        source's: only a run stalled while this worker was reading gives up."""
        filled = 0
        reading_since = time.monotonic()
        kind = f.job.source.kind
        while filled < len(view) and not f.run.stop.is_set():
            try:
                n = reader.readinto(view[filled:])
            except RetryRange as e:
                return filled, e
            if not n:
                break
            filled += n
            with self._counter_lock:
                f.run.note(n, kind)
            self.observer.received(n, kind)
            stalled = min(f.run.stalled_for(), time.monotonic() - reading_since)
            if stalled >= self.settings.timeout:
                why = f"less than {PROGRESS_BYTES} bytes in {stalled:.0f}s (a trickle)"
                return filled, RetryRange(why)
        return filled, None

    def _wait_before_retry(self, f: _File, failures: int, reason: str) -> None:
        source = f.job.source
        attempts = source.attempts or self.settings.max_attempts
        stalled = f.run.stalled_for()
        if failures >= attempts or stalled >= self.settings.timeout:
            raise TransientError(
                f"giving up on {f.job.label} ({source.where}) after {tries(max(failures, 1))} "
                f"and {stalled:.0f}s without progress, last: {reason}; partial "
                "data is kept, run the fetch again when the store recovers"
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

    def _buffer(self) -> bytearray:
        """This thread's read buffer (BUFFER bytes, allocated once per thread)."""
        buf: bytearray | None = getattr(self._buffers, "buf", None)
        if buf is None:
            buf = self._buffers.buf = bytearray(BUFFER)
        return buf
