"""Fetches that download without the daemon, registered in the cache dir so it counts them.

A `fetch` downloading alone (`--no-daemon`, no daemon, a daemon that refused the source
or stopped answering) runs outside the daemon's transfer observer, yet it is exactly what
the early-warning ratio exists to see (design §6). So it registers itself for as long as
it runs, in `Layout.fetching`:

    <id>.lock   flocked (exclusive) by the fetch for its whole life
    <id>.json   {"name", "revision", "gets", "pulling", "throttled"}: what it fetches,
                object-store GETs in flight, whether it has had any (it downloads a copy
                rather than waiting on another fetch's revision lock), and the store's
                answers asking it to slow down so far; replaced atomically (rename) at most
                every UPDATE_INTERVAL seconds

Liveness is the flock, never the pid: the daemon and the Pods live in different pid
namespaces, and the kernel drops a flock on any exit, `kill -9` included. A record whose
lock is free (or gone) is a ghost: never counted, and removed by whoever reads it with a
writable cache. Registration is best effort: it never fails or slows a fetch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from weightcache.cache.layout import Layout
from weightcache.errors import UsageError
from weightcache.smallfile import open_new, read_small, replace_atomically

log = logging.getLogger(__name__)

#: Seconds between two rewrites of a record's GET count (only when it changed): the
#: daemon reads at each scrape, so finer would only cost writes.
UPDATE_INTERVAL = 0.5
#: A record is a name, a revision (one path segment each) and a count: well under this.
RECORD_MAX_BYTES = 4096


@dataclass(frozen=True)
class AloneFetch:
    """One live fetch downloading without the daemon, as its record says."""

    name: str
    revision: str
    gets: int
    #: It has had GETs in flight: a copy of the revision is downloading, not waiting on
    #: another fetch's lock. Latched, so a pause between blobs does not hide the copy.
    pulling: bool = False
    #: Object-store answers asking it to slow down (503/429) since it started.
    throttled: int = 0
    #: Its record's name, unique to this fetch: a reader adds up `throttled` per fetch.
    key: str = field(default="", compare=False)


class Registration:
    """This process's record while it fetches alone; `close()` removes it."""

    def __init__(
        self,
        directory: Path,
        name: str,
        revision: str,
        gets: Callable[[], int],
        throttled: Callable[[], int],
    ):
        """Creates and flocks the lock file, then writes the record; raises OSError (the
        caller goes on unregistered)."""
        directory.mkdir(exist_ok=True)
        stem = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._lock_path = directory / f"{stem}.lock"
        self._record = directory / f"{stem}.json"
        self._fields = {"name": name, "revision": revision}
        self._gets = gets
        self._throttled = throttled
        self._pulling = False
        self._written: tuple[int, bool, int] | None = None
        self._stop = threading.Event()
        self._fd = open_new(self._lock_path, os.O_RDWR)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # before the record exists: never a ghost
            self._write()
        except OSError:
            self._remove()
            raise
        self._thread = threading.Thread(target=self._run, name="alone-record", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(UPDATE_INTERVAL):
            try:
                self._write()
            except OSError as e:  # a full disk must not end the fetch; the count goes stale
                log.debug("could not update %s: %s", self._record, e)

    def _write(self) -> None:
        """Replace the record if its counts changed since the last write."""
        gets = self._gets()
        self._pulling = self._pulling or gets > 0
        counts = (gets, self._pulling, self._throttled())
        if counts == self._written:
            return
        fields = dict(zip(("gets", "pulling", "throttled"), counts, strict=True))
        replace_atomically(self._record, json.dumps({**self._fields, **fields}).encode())
        self._written = counts

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._remove()

    def _remove(self) -> None:
        """The record first, then its lock: a reader never sees a record without its
        holder's lock except from a dead process."""
        for path in (self._record, self._lock_path):
            with contextlib.suppress(OSError):
                path.unlink()
        os.close(self._fd)


@contextlib.contextmanager
def registered(
    layout: Layout,
    name: str,
    revision: str,
    gets: Callable[[], int],
    throttled: Callable[[], int] = lambda: 0,
) -> Iterator[None]:
    """Register a fetch alone for the duration of the block; `gets()` and `throttled()`
    (called from another thread) return its object-store GETs in flight and the answers
    asking it to slow down so far. Nothing happens on a read-only cache or when the
    registration cannot be written."""
    registration = None
    if not layout.read_only and _inside(layout):
        try:
            registration = Registration(layout.fetching, name, revision, gets, throttled)
        except OSError as e:
            log.debug("fetching unregistered (%s); the node daemon will not count it", e)
    try:
        yield
    finally:
        if registration is not None:
            registration.close()


def live(layout: Layout) -> list[AloneFetch]:
    """The fetches alone now running on this cache; removes ghosts when it can."""
    if not _inside(layout):
        return []
    try:
        records = sorted(layout.fetching.glob("*.json"))
    except OSError:
        return []
    found = []
    for record in records:
        fetch = _read_live(record, remove_ghost=not layout.read_only)
        if fetch is not None:
            found.append(fetch)
    return found


def _inside(layout: Layout) -> bool:
    """Whether `fetching/` is inside the cache: a symlink planted there leading out would
    have records written, and "ghosts" removed, in a directory not the cache's."""
    try:
        layout.check_inside(layout.fetching)
    except UsageError as e:
        log.warning("not using %s: %s", layout.fetching, e)
        return False
    return True


def _read_live(record: Path, remove_ghost: bool) -> AloneFetch | None:
    """The record's fetch if its holder still holds the lock, else None (removing the
    ghost's files if asked). A record unreadable or malformed counts as nothing."""
    lock = record.with_suffix(".lock")
    try:  # not blocking on a FIFO planted there, nor following a symlink
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError:
        return None
    try:
        if fd is not None and _held(fd):
            return _parse(record)
        if remove_ghost:
            for path in (record, lock):
                with contextlib.suppress(OSError):
                    path.unlink()
        return None
    finally:
        if fd is not None:
            os.close(fd)


def _held(fd: int) -> bool:
    """True if another process holds the flock on fd."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _parse(record: Path) -> AloneFetch | None:
    try:
        data = json.loads(read_small(record, RECORD_MAX_BYTES))
        gets = max(0, int(data["gets"]))
        pulling = bool(data.get("pulling", gets > 0))
        throttled = max(0, int(data.get("throttled", 0)))
        name, revision = str(data["name"]), str(data["revision"])
        return AloneFetch(name, revision, gets, pulling, throttled, key=record.stem)
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None
