"""sha256 of objects in the store through parallel ranged GETs, without a local copy.

sha256 is sequential, so each object is read as a window of ranged GETs in flight whose
parts are hashed in order as they complete; several objects are hashed at once (one
thread each, and hashlib releases the GIL, so they use several cores). Bytes come through
the blob-source seam (weightcache/transfer/sources.py; design §4, Blob sources), so any
source a fetch reads can be hashed in place: the same retries (RetryRange: resuming at the
byte where a read broke, full-jitter backoff), AIMD when the source throttles, and the same
stall clock (`--timeout` without PROGRESS_BYTES ends it, exit 6); `--bwlimit` bounds the
bytes per second over all of its reads.

Memory is bounded by a pool of `max_concurrency` part buffers of `part_size` bytes each
(16 x 16 MiB = 256 MiB by default, whatever the objects' sizes): a GET needs a buffer, and
a buffer comes back to the pool once its part is hashed.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from weightcache.config import OriginSettings
from weightcache.errors import Interrupted, TransientError
from weightcache.transfer.downloader import (
    BUFFER,
    PROGRESS_BYTES,
    NullObserver,
    Run,
    TransferObserver,
)
from weightcache.transfer.pacing import AIMDGate, Backoff, TokenBucket
from weightcache.transfer.parts import plan_parts
from weightcache.transfer.sources import (
    READ_TIMEOUT,
    BlobSource,
    RangeReader,
    RetryRange,
    whole_only,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredObject:
    """One object to hash: `label` names it in messages and keys the result."""

    source: BlobSource
    size: int
    label: str


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
        settings: OriginSettings,
        observer: TransferObserver | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.settings = settings
        self.observer = observer or NullObserver()
        self.gate = AIMDGate(settings.max_concurrency)
        self.backoff = backoff or Backoff()
        self.tokens = TokenBucket(settings.bwlimit) if settings.bwlimit else None
        self._counter_lock = threading.Lock()

    def hash_objects(self, objects: list[StoredObject]) -> dict[str, str]:
        """{label: sha256 hex} of every object, read as it is in the store now.

        Raises SourceError (gone, denied, changed size while read), TransientError (the
        retries or `--timeout` ran out). On KeyboardInterrupt every GET stops at its next
        read before it propagates.
        """
        run = Run()
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
        run: Run,
        digests: dict[str, str],
        errors: list[BaseException],
    ) -> None:
        try:
            while not run.stop.is_set():
                try:
                    obj = todo.get_nowait()
                except queue.Empty:
                    return
                if whole_only(obj.source):
                    digests[obj.label] = self._hash_whole(obj, run)
                else:
                    digests[obj.label] = self._hash_one(obj, getters, buffers, run)
        except BaseException as e:
            errors.append(e)
            run.stop.set()

    def _hash_one(
        self, obj: StoredObject, getters: cf.ThreadPoolExecutor, buffers: _Buffers, run: Run
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

    def _hash_whole(self, obj: StoredObject, run: Run) -> str:
        """An object its source sends only whole (`whole_only`): one GET streamed through
        one BUFFER into the hash; a broken read resumes at its byte (the source drops the
        bytes before it), so memory stays one buffer whatever the object's size."""
        hasher = hashlib.sha256()
        buf = memoryview(bytearray(BUFFER))
        pos = failures = 0
        timeout = min(self.settings.timeout, READ_TIMEOUT)
        while pos < obj.size:
            before = pos
            try:
                with obj.source.open_range(pos, obj.size, obj.size, timeout) as reader:
                    while pos < obj.size:
                        end = min(pos + BUFFER, obj.size)
                        try:
                            self._fill(obj, reader, pos, end, buf, pos, run)
                        except _Broke as e:
                            hasher.update(buf[: e.pos - pos])
                            pos = e.pos
                            raise e.why from e
                        hasher.update(buf[: end - pos])
                        pos = end
            except RetryRange as e:
                failures = 0 if pos > before else failures + 1
                self._wait_before_retry(obj, failures, str(e), run)
        return hasher.hexdigest()

    # -- GET workers -------------------------------------------------------------------------

    def _get_part(self, obj: StoredObject, start: int, end: int, buf: bytearray, run: Run) -> None:
        """Fill buf[:end-start] with [start, end) of the object, resuming where a read broke."""
        view = memoryview(buf)
        pos = start
        failures = 0
        while pos < end:
            if run.stop.is_set():
                raise Interrupted(f"hashing {obj.label} stopped")
            if not self.gate.acquire(run.stop):
                continue
            self.observer.request_started(obj.source.kind)
            before = pos
            try:
                pos, failure = self._read_range(obj, pos, end, view[: end - start], start, run)
            finally:
                self.observer.request_finished(obj.source.kind)
                self.gate.release()
            if failure is None:
                self.gate.on_success()
                continue
            failures = 0 if pos > before else failures + 1
            if failure.throttle and obj.source.throttles:
                self.gate.on_throttle()
                self.observer.throttled()
            self._wait_before_retry(obj, failures, str(failure), run)

    def _wait_before_retry(self, obj: StoredObject, failures: int, reason: str, run: Run) -> None:
        stalled = run.stalled_for()
        attempts = obj.source.attempts or self.settings.max_attempts
        if failures >= attempts or stalled >= self.settings.timeout:
            raise TransientError(
                f"giving up on {obj.source.where} after {failures} attempts and {stalled:.0f}s "
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

    def _read_range(
        self, obj: StoredObject, pos: int, end: int, into: memoryview, base: int, run: Run
    ) -> tuple[int, RetryRange | None]:
        """Read [pos, end) into into[pos-base:]; (the byte reached, None) or, when the read
        broke, (the byte reached, why) so the caller resumes there."""
        timeout = min(self.settings.timeout, READ_TIMEOUT)
        try:
            with obj.source.open_range(pos, end, obj.size, timeout) as reader:
                pos = self._fill(obj, reader, pos, end, into, base, run)
            return pos, None
        except _Broke as e:
            return e.pos, e.why
        except RetryRange as e:
            return pos, e

    def _fill(
        self, obj: StoredObject, reader: RangeReader, pos: int, end: int, into: memoryview,
        base: int, run: Run,
    ) -> int:  # fmt: skip
        """Read socket read by socket read (each one moves the stall clock); time spent
        waiting for --bwlimit tokens is ours, not a stall of the source."""
        reading_since = time.monotonic()
        while pos < end:
            if run.stop.is_set():
                raise Interrupted(f"hashing {obj.label} stopped")
            want = min(BUFFER, end - pos)
            if self.tokens is not None:
                waited = time.monotonic()
                self.tokens.take(want)
                reading_since += time.monotonic() - waited
            try:
                n = reader.readinto(into[pos - base : pos - base + want])
            except RetryRange as e:
                raise _Broke(pos, e) from e
            if not n:
                raise _Broke(pos, RetryRange(f"body ended {end - pos} bytes short"))
            pos += n
            with self._counter_lock:
                run.note(n, obj.source.kind)
            self.observer.received(n, obj.source.kind)
            stalled = min(run.stalled_for(), time.monotonic() - reading_since)
            if stalled >= self.settings.timeout:
                why = RetryRange(f"less than {PROGRESS_BYTES} bytes in {stalled:.0f}s (a trickle)")
                raise _Broke(pos, why)
        return end


class _Broke(Exception):
    """A read that broke at `pos`: the range is resumed there."""

    def __init__(self, pos: int, why: RetryRange) -> None:
        super().__init__(str(why))
        self.pos, self.why = pos, why
