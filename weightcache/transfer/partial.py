"""One partial blob being downloaded: the preallocated file, its part state, its sha256.

Parts are written at their offsets in any order; sha256 is computed while the download
runs, over the contiguous written prefix (read back from the page cache by whichever
worker extends it), so there is no second pass after the last byte and the digest is
ready when the last part lands. The part state (the written start of every part) is
updated after each write and saved at most every SAVE_INTERVAL and when a download stops
short (parts.py says what a kill can lose).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from weightcache.errors import Interrupted, WeightcacheError, no_space
from weightcache.smallfile import open_own, open_regular
from weightcache.transfer.checksums import Hasher, new_hasher
from weightcache.transfer.parts import PartState

log = logging.getLogger(__name__)
#: How often a file's part state is written, at most: a kill loses at most the bytes in
#: flight and those written in the last interval (they are fetched again), never correctness.
SAVE_INTERVAL = 0.25
#: Bytes of a partial hashed per mapping when its written prefix is read back
#: (`_hash_mapped`); also what a mapping adds to the resident size while it is hashed.
HASH_WINDOW = 2 << 20
#: Shared, read-only, its pages mapped by the mmap call (which holds the GIL on Python
#: 3.11): faulted in from hashlib's update instead, the workers' concurrent writes to the
#: file cost more kernel time.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _never() -> bool:
    return False


def state_path(partial: Path) -> Path:
    """Where the part state of `partial` is kept: beside it, `<name>.json`. The cache names
    it the same way (`Layout.part_state`, which cannot be imported from here: the cache and
    the transfer layers are independent); a unit test holds the two together."""
    return partial.with_name(partial.name + ".json")


class PartialFile:
    """An open partial blob, shared by the download's worker threads (its lock guards
    the part state and the hash frontier). `open` it, `write` parts (`wrote` after each
    write), `mark_done` each, `advance_hash` after each, `close` it; `digest` is set once
    every byte is hashed and the file is fsynced, and with it `check_digest`, the file's
    digest by the `check` algorithm (checksums.py) when one was asked for."""

    def __init__(
        self, path: Path, label: str, fd: int, state: PartState, check: str | None = None,
        check_parts: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        self.path, self.label, self.fd, self.state = path, label, fd, state
        self.size = state.size
        self.hasher = hashlib.sha256()
        # A source's own checksum, computed over the same read-back as the sha256.
        self.checker: Hasher | None = new_hasher(check, self.size, check_parts) if check else None
        self.hashed = 0
        self.digest: str | None = None
        self.check_digest: str | None = None
        self.lock = threading.Lock()
        self._hashing = False
        self._saved_at = 0.0  # when the part state was last written

    @classmethod
    def open(
        cls, path: Path, label: str, size: int, part_size: int, check: str | None = None,
        check_parts: tuple[int, ...] = (),
    ) -> PartialFile:  # fmt: skip
        """Open (or create and preallocate) `path` for a `size`-byte blob, resuming the
        bytes its saved state records (and rehashing them: both digests start at byte 0).
        Raises NoSpaceError when the disk cannot hold it."""
        state = PartState.load(state_path(path), size, part_size)
        fd = _open_partial(path)
        try:
            if not state.bytes_done() or os.fstat(fd).st_size != size:
                # A state that claimed bytes is replaced now; where none did (a new
                # partial), the first write saves one: one file less before the first GET.
                if state.bytes_done():
                    _save_state(PartState(size, part_size), path, label)
                state = PartState(size, part_size)
                os.ftruncate(fd, 0)
                _preallocate(fd, size, label)
            elif state.bytes_done():
                log.info("resuming %s: %d of %d bytes already on disk", label,
                         state.bytes_done(), size)  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        return cls(path, label, fd, state, check, check_parts)

    def close(self) -> None:
        """Persist the bytes written since the last periodic save if the download stopped
        short (SIGTERM, a failure), so that the next one resumes after every one of them;
        then close the file."""
        with self.lock:
            complete, snapshot = all(self.state.done), self.state.snapshot()
        if not complete:
            with contextlib.suppress(OSError):  # the error that stopped us matters more
                self.state.save(state_path(self.path), snapshot)
        os.close(self.fd)

    def write(self, data: memoryview, offset: int) -> None:
        """Write `data` at `offset`; raises NoSpaceError on ENOSPC, OSError otherwise."""
        try:
            while data:
                n = os.pwrite(self.fd, data, offset)
                data, offset = data[n:], offset + n
        except OSError as e:
            full = no_space(e, self.label)
            if full is not None:
                raise full from e
            raise

    def wrote(self, index: int, upto: int) -> None:
        """Record that part `index` is written up to blob offset `upto` (call it after
        the write returned, never before); persist the state at most every SAVE_INTERVAL."""
        with self.lock:
            self.state.note_written(index, upto)
            snapshot = self._snapshot_if_due()
        self._save(snapshot)

    def mark_done(self, index: int) -> None:
        """Record a finished part and start its writeback; persist the state at most every
        SAVE_INTERVAL, outside the lock (profiled: saving under the lock stalled workers)."""
        start, end = self.state.parts[index]
        _start_writeback(self.fd, start, end - start)
        with self.lock:
            self.state.done[index] = True
            snapshot = self._snapshot_if_due()
        self._save(snapshot)

    def save(self) -> None:
        """Persist the part state now, whatever SAVE_INTERVAL says (the swarm records each
        piece as it lands: a kill then loses only the pieces in flight). Callers that save
        from several threads serialise their calls: a stale snapshot renamed last would
        under-report."""
        with self.lock:
            snapshot = self.state.snapshot()
            self._saved_at = time.monotonic()
        self._save(snapshot)

    def _snapshot_if_due(self) -> list[int] | None:
        """The state to save now, if SAVE_INTERVAL has passed since the last one; call it
        under the lock."""
        now = time.monotonic()
        if now - self._saved_at < SAVE_INTERVAL:
            return None
        self._saved_at = now
        return self.state.snapshot()

    def _save(self, snapshot: list[int] | None) -> None:
        """Raises NoSpaceError when the disk has no room for the small state file (the
        partial itself is preallocated: this is where a disk filled since then shows)."""
        if snapshot is not None:
            _save_state(self.state, self.path, self.label, snapshot)

    def hash_landed(self, data: memoryview, offset: int) -> None:
        """Hash `data`, just written at `offset` (after `wrote`), straight from the caller's
        buffer if it extends the hashed prefix and no other thread hashes this file; else
        nothing (`advance_hash` reads it back later). The part at the hash frontier is so
        hashed as it lands, not once it is done: less is left to hash after the last byte."""
        with self.lock:
            if self._hashing or self.hashed != offset or not data:
                return
            self._hashing = True
        hashed = 0
        try:
            self.hasher.update(data)
            if self.checker is not None:
                self.checker.update(data)
            hashed = len(data)
        finally:
            with self.lock:
                self.hashed += hashed
                self._hashing = False

    def advance_hash(self, buf: bytearray, stop: Callable[[], bool] = _never) -> None:
        """Hash the newly contiguous prefix, reading it back through `buf`; only one
        thread hashes a file at a time (the others return at once). Raises Interrupted
        when `stop()` turns true between two reads: a resumed partial's rehash can be
        long, and SIGTERM must not wait for it (the partial stays for resume)."""
        with self.lock:
            if self._hashing:
                return
            self._hashing = True
        try:
            while True:
                with self.lock:
                    end = self.state.contiguous_end()
                    if end <= self.hashed:
                        if self.hashed == self.size and self.digest is None:
                            os.fsync(self.fd)  # here, in a worker, while others download
                            if self.checker is not None:
                                self.check_digest = self.checker.hexdigest()
                            self.digest = self.hasher.hexdigest()
                        self._hashing = False
                        return
                self._hash_to(end, memoryview(buf), stop)
        except BaseException:
            with self.lock:
                self._hashing = False
            raise

    def _hash_to(self, end: int, view: memoryview, stop: Callable[[], bool]) -> None:
        while self.hashed < end:
            if stop():
                raise Interrupted()
            if self._hash_mapped(min(end, self.hashed + HASH_WINDOW)):
                continue
            n = os.preadv(self.fd, [view[: min(len(view), end - self.hashed)]], self.hashed)
            if not n:
                raise WeightcacheError(f"internal error: {self.path} is short")
            self.hasher.update(view[:n])
            if self.checker is not None:
                self.checker.update(view[:n])
            self.hashed += n

    def _hash_mapped(self, end: int) -> bool:
        """Hash [hashed, end) through a mapping of the file: the page cache is read in
        place, not copied into a buffer first. False, having hashed nothing, where the file
        cannot be mapped there (mmap refuses a range past the file's end: a partial cut
        short reads back through `preadv`, which says so)."""
        base = self.hashed - self.hashed % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(self.fd, end - base, flags=_MAP_FLAGS, prot=mmap.PROT_READ,
                               offset=base)  # fmt: skip
        except (OSError, ValueError):
            return False
        try:
            with memoryview(mapped) as whole, whole[self.hashed - base :] as data:
                self.hasher.update(data)
                if self.checker is not None:
                    self.checker.update(data)
        finally:
            mapped.close()
        self.hashed = end
        return True

    def rehash(self, buf: bytearray, stop: Callable[[], bool] = _never) -> str:
        """The sha256 of the whole file as it is now, read back through `buf` (after parts
        were rewritten in place: the running hash no longer describes them). Raises
        Interrupted when `stop()` turns true between two reads."""
        os.fsync(self.fd)
        hasher, pos, view = hashlib.sha256(), 0, memoryview(buf)
        while pos < self.size:
            if stop():
                raise Interrupted()
            n = os.preadv(self.fd, [view[: min(len(buf), self.size - pos)]], pos)
            if not n:
                raise WeightcacheError(f"internal error: {self.path} is short")
            hasher.update(view[:n])
            pos += n
        return hasher.hexdigest()

    def finish(self, buf: bytearray) -> str:
        """The sha256 of the complete file (every part must be done)."""
        self.advance_hash(buf)
        if self.digest is None:  # every part done, so only a bug can get here
            raise WeightcacheError(f"internal error: {self.label} hashed {self.hashed} bytes")
        return self.digest


def _save_state(
    state: PartState, partial: Path, label: str, snapshot: list[int] | None = None
) -> None:
    """`state.save` beside `partial`; a full disk is NoSpaceError, as for the data."""
    try:
        state.save(state_path(partial), snapshot)
    except OSError as e:
        full = no_space(e, f"the part state of {label}")
        if full is not None:
            raise full from e
        raise


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (None off Linux), loaded when the first part is done: ctypes
    costs milliseconds to import, and a cold fetch's first GET would wait for them."""
    if os.uname().sysname != "Linux":
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # libc, already loaded
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a finished part to disk now (async), so that the fsync before the
    blob is published finds little left to do. Best effort: a no-op off Linux."""
    sync_file_range = _sync_file_range()
    if sync_file_range is not None and length > 0:
        sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _open_partial(partial: Path) -> int:
    """`partial` opened for writing (created if absent), a regular file of tmp/ and
    nothing else (`open_own`: no byte of a download is written through a symlink planted
    at its name)."""
    try:
        return open_own(partial, trees=True)
    except PermissionError:
        _make_writable(partial)
        return open_own(partial, trees=True)


def _make_writable(partial: Path) -> None:
    """A kill between publishing's chmod 0444 of a verified partial and its rename leaves
    it read-only: as the non-root uid that wrote it, O_RDWR fails with EACCES until tmp/
    is cleaned a day later. It is ours to write again (changed through its own fd: a
    symlink put in its place meanwhile is not followed; the open after this removes it)."""
    try:
        fd = open_regular(partial)
    except (FileNotFoundError, ValueError):
        return  # none to make writable (the EACCES was creating it), or nothing of ours
    try:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | stat.S_IWUSR)
    finally:
        os.close(fd)


def _preallocate(fd: int, size: int, label: str) -> None:
    """Reserve the blob's space now, so a full disk fails before the download, not after."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        full = no_space(e, f"{label} ({size} bytes)")
        if full is not None:
            raise full from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
