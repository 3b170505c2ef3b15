"""state.db: what the cache holds, when each revision was last used, pins and leases.

SQLite in WAL mode so that the daemon and many `fetch` processes write concurrently.
The index is advisory bookkeeping for eviction and `ls`; the truth about what is ready
is the marker on disk (a lost index costs LRU precision, never correctness).

Leases are the exception that makes eviction safe (design §3 invariant 8): a fetch commits its
Pod's lease *before* it checks the marker, and the evictor removes a revision only inside
a write transaction that finds no lease (`remove_unless_protected`). Write transactions
are serialized, so either the evictor sees the lease, or the fetch finds the revision gone
and fetches it again.

The file is checked before every use: a state.db replaced or deleted under a long-lived
process is reopened (its leases carried over), and a corrupt one is moved aside to
`state.db.corrupt-<time>` and rebuilt from the markers on disk (design §3, the index).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from weightcache.cache.layout import Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.store import Cache
from weightcache.errors import UsageError

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    name TEXT NOT NULL, revision TEXT NOT NULL, source TEXT NOT NULL DEFAULT '',
    size INTEGER NOT NULL DEFAULT 0, last_access REAL NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (name, revision)
);
-- The daemon's pins, kept apart from entries: a pin exists before its revision does.
CREATE TABLE IF NOT EXISTS pins (
    name TEXT NOT NULL, revision TEXT NOT NULL, PRIMARY KEY (name, revision)
);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT NOT NULL, revision TEXT NOT NULL, pod_uid TEXT NOT NULL, since REAL NOT NULL,
    PRIMARY KEY (name, revision, pod_uid)
);
"""


@dataclass(frozen=True)
class Entry:
    name: str
    revision: str
    source: str
    size: int
    last_access: float
    leases: tuple[str, ...] = ()


#: (name, revision, source, size, last access) of a revision found on disk, for a rebuild.
Rebuilt = tuple[str, str, str, int, float]
#: How a database is told apart from the one a connection holds: (st_dev, st_ino).
Identity = tuple[int, int]


class Index:
    """state.db; cheap to construct, connects on first use, one connection per thread.

    `rebuild()` lists the revisions on disk; it is called after a corrupt database was
    moved aside, to start the new one with what can be known (see `for_cache`).
    `read_only` (a cache on a read-only mount) reads what the file holds and writes nothing,
    not even the WAL's shared-memory file: a missing file reads as empty.
    """

    def __init__(
        self,
        path: Path,
        timeout: float = 5.0,
        rebuild: Callable[[], Iterable[Rebuilt]] | None = None,
        read_only: bool = False,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self._rebuild = rebuild
        self.read_only = read_only
        self._local = threading.local()
        #: Connections to a database that is no longer at `path`. Never closed: closing
        #: the last connection to a WAL database unlinks `state.db-wal` and `-shm` by
        #: name, which are by now the files of the database that replaced it.
        self._abandoned: list[sqlite3.Connection] = []
        #: Bumped whenever this process found another database at `path` than the one it
        #: had open (replaced, deleted or recovered); the daemon then writes its pins again.
        self.generation = 0

    @property
    def db(self) -> sqlite3.Connection:
        """This thread's connection to the database that is at `path` now."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if self.read_only:
            if db is None:
                db = self._local.db = _connect_read_only(self.path)
            return db
        if db is not None and _identity(self.path) == self._local.identity:
            return db
        if db is not None:
            self._abandon(db)
        fresh = self._connect()
        if db is not None:
            log.warning(
                "%s was replaced or deleted under this process; reopened it and carried "
                "the leases over",
                self.path,
            )
            _carry_over(db, fresh)
        return fresh

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        self._local.identity = _identity(self.path)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed: {verdict}")
            db.executescript(_SCHEMA)
        except sqlite3.Error as e:
            if isinstance(e, sqlite3.DatabaseError) and _is_corrupt(e):
                self._abandoned.append(db)  # not closed: see `_abandoned`
            else:
                db.close()  # e.g. busy: still the file at `path`, retried on next use
            raise
        self._local.db = db
        return db

    def _abandon(self, db: sqlite3.Connection) -> None:
        with contextlib.suppress(sqlite3.Error):
            # Fold the old WAL into the old file, so that a database put in its place
            # (the main file only) is not read through the old WAL.
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._abandoned.append(db)
        self._local.db = None
        self.generation += 1

    def _using(self, op: Callable[[], T]) -> T:
        """Run `op`; if the database turns out corrupt, recover it and run `op` once more
        on the new one."""
        try:
            return op()
        except sqlite3.DatabaseError as e:
            if not _is_corrupt(e):
                raise
            self._recover(e)
            return op()

    def _recover(self, error: sqlite3.DatabaseError) -> None:
        """Move the corrupt database aside (kept for a post-mortem), start a new one and
        fill it with the revisions on disk. Raises UsageError if it cannot be moved."""
        bad = getattr(self._local, "identity", None)
        old = getattr(self._local, "db", None)
        if old is not None:
            self._abandon(old)
        lock = FileLock(self.path.with_name(self.path.name + ".lock"), str(self.path))
        try:
            lock.acquire()
        except OSError as e:
            raise UsageError(
                f"{self.path} is corrupt ({error}) and cannot be repaired here ({e.strerror}); "
                "run `weightcache ls` where the cache is writable, or delete the file"
            ) from e
        try:
            if bad is None or _identity(self.path) == bad:  # no other process did it yet
                aside = self._move_aside(error)
                self.generation += 1
                log.warning(
                    "%s is corrupt (%s): moved it to %s and rebuilt the index from the "
                    "revisions on disk; pins come back from the models file, leases of "
                    "running Pods are lost",
                    self.path,
                    error,
                    aside,
                )
                self._refill()
        finally:
            lock.release()

    def _move_aside(self, error: sqlite3.DatabaseError) -> Path:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            for suffix in ("-wal", "-shm", ""):  # the main file last: it is what others check
                with contextlib.suppress(FileNotFoundError):
                    os.rename(f"{self.path}{suffix}", f"{aside}{suffix}")
        except OSError as e:
            raise UsageError(
                f"{self.path} is corrupt ({error}) and cannot be moved aside ({e.strerror}); "
                "delete it (the index is rebuilt from the revisions on disk)"
            ) from e
        return aside

    def _refill(self) -> None:
        if self._rebuild is None:
            return
        rows = list(self._rebuild())
        with self._transaction() as db:
            db.executemany(
                "INSERT OR IGNORE INTO entries (name, revision, source, size, last_access, "
                "created) VALUES (?, ?, ?, ?, ?, ?)",
                [(n, r, src, size, last, last) for n, r, src, size, last in rows],
            )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE .. COMMIT on the database that is at `path` once the write lock
        is held (autocommit mode makes `with db:` a no-op, and readers must never see pins
        cleared but not yet set again)."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        while _identity(self.path) != self._local.identity:  # replaced while we waited
            db.execute("ROLLBACK")
            db = self.db
            db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def record_access(
        self,
        name: str,
        revision: str,
        *,
        source: str = "",
        size: int | None = None,
        pod_uid: str | None = None,
        now: float | None = None,
    ) -> None:
        """Note a hit or a completed miss (and the Pod's lease). Never fails the caller."""
        now = time.time() if now is None else now

        def op() -> None:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO entries (name, revision, source, size, last_access, created) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name, revision) DO UPDATE SET "
                    "last_access = excluded.last_access, "
                    "source = CASE WHEN excluded.source = '' THEN source ELSE excluded.source END,"
                    "size = CASE WHEN ? IS NULL THEN size ELSE excluded.size END",
                    (name, revision, source, size or 0, now, now, size),
                )
                if pod_uid:
                    db.execute(
                        "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?)",
                        (name, revision, pod_uid, now),
                    )

        self._never_failing(op, f"the access to {name}/{revision}")

    def lease(self, name: str, revision: str, pod_uid: str, now: float | None = None) -> None:
        """Lease the revision to the Pod, committed when this returns; call it before
        checking the marker (see `remove_unless_protected`). Never fails the caller: a
        cache mounted read-only still serves hits, unleased (logged)."""
        now = time.time() if now is None else now

        def op() -> None:
            with self._transaction() as db:
                db.execute(
                    "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?)",
                    (name, revision, pod_uid, now),
                )

        self._never_failing(op, f"the lease of {name}/{revision} to Pod {pod_uid}")

    def _never_failing(self, op: Callable[[], None], what: str) -> None:
        try:
            self._using(op)
        except (sqlite3.Error, UsageError) as e:
            log.warning("could not record %s in %s: %s", what, self.path, e)

    def remove_unless_protected(self, name: str, revision: str, remove: Callable[[], None]) -> bool:
        """Call `remove()` and forget the revision, inside one write transaction that
        finds it neither leased nor pinned; False (nothing done) if it is.

        A fetch commits its lease before it checks the marker, so a fetch that printed
        the revision's path is seen here, and one that leases after this commits finds
        the revision gone. Raises sqlite3.Error if the database cannot be read: nothing
        is removed on the basis of a database that is not the one on disk.
        """

        def op() -> bool:
            with self._transaction() as db:
                key = (name, revision)
                if db.execute(
                    "SELECT 1 FROM leases WHERE name = ? AND revision = ? UNION ALL "
                    "SELECT 1 FROM pins WHERE name = ? AND revision = ?",
                    key + key,
                ).fetchone():
                    return False
                remove()
                db.execute("DELETE FROM entries WHERE name = ? AND revision = ?", key)
            return True

        return self._using(op)

    def entries(self) -> list[Entry]:
        return self._using(self._entries)

    def _entries(self) -> list[Entry]:
        db = self.db
        leases: dict[tuple[str, str], list[str]] = {}
        for name, rev, uid in db.execute("SELECT name, revision, pod_uid FROM leases"):
            leases.setdefault((name, rev), []).append(uid)
        return [
            Entry(n, r, src, size, last, tuple(sorted(leases.get((n, r), ()))))
            for n, r, src, size, last in db.execute(
                "SELECT name, revision, source, size, last_access FROM entries "
                "ORDER BY name, revision"
            )
        ]

    def pins(self) -> set[tuple[str, str]]:
        return self._using(
            lambda: {(n, r) for n, r in self.db.execute("SELECT name, revision FROM pins")}
        )

    def set_pins(self, pinned: set[tuple[str, str]]) -> None:
        def op() -> None:
            with self._transaction() as db:
                db.execute("DELETE FROM pins")
                db.executemany("INSERT INTO pins VALUES (?, ?)", sorted(pinned))

        self._using(op)

    def lease_holders(self) -> set[str]:
        return self._using(
            lambda: {u for (u,) in self.db.execute("SELECT DISTINCT pod_uid FROM leases")}
        )

    def lease_ages(self) -> list[tuple[str, float]]:
        """(pod_uid, most recent lease time) per Pod."""
        return self._using(
            lambda: list(self.db.execute("SELECT pod_uid, MAX(since) FROM leases GROUP BY pod_uid"))
        )

    def end_leases(self, pod_uids: set[str]) -> None:
        def op() -> None:
            with self._transaction() as db:
                db.executemany("DELETE FROM leases WHERE pod_uid = ?", [(u,) for u in pod_uids])

        self._using(op)

    def forget(self, name: str, revision: str) -> None:
        def op() -> None:
            with self._transaction() as db:
                db.execute("DELETE FROM entries WHERE name = ? AND revision = ?", (name, revision))

        self._using(op)


def for_cache(layout: Layout) -> Index:
    """The index of a cache directory, rebuilt from its markers if found corrupt (the
    last access of a rebuilt revision is its marker's mtime)."""
    store = Cache(layout)

    def rebuild() -> Iterator[Rebuilt]:
        for name, revision in layout.revisions():
            marker = store.read_marker(name, revision)
            try:
                mtime = layout.marker(name, revision).stat().st_mtime
            except OSError:
                continue
            if marker is not None:
                yield name, revision, marker.source, marker.size, mtime

    return Index(layout.state_db, rebuild=rebuild, read_only=layout.read_only)


def _identity(path: Path) -> Identity | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _is_corrupt(error: sqlite3.DatabaseError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    if code is None:  # raised by `_connect` on a failed quick_check
        return "malformed" in str(error)
    return code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _carry_over(old: sqlite3.Connection, new: sqlite3.Connection) -> None:
    """Copy leases and entries of the database that was replaced into the new one, so
    that a Pod leasing before the replacement stays protected. Best effort."""
    try:
        leases = old.execute("SELECT name, revision, pod_uid, since FROM leases").fetchall()
        entries = old.execute(
            "SELECT name, revision, source, size, last_access, created FROM entries"
        ).fetchall()
        new.execute("BEGIN IMMEDIATE")
        new.executemany("INSERT OR IGNORE INTO leases VALUES (?, ?, ?, ?)", leases)
        new.executemany("INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, ?, ?)", entries)
        new.execute("COMMIT")
    except sqlite3.Error as e:
        with contextlib.suppress(sqlite3.Error):
            new.execute("ROLLBACK")
        log.warning("could not carry the leases over to the new %s: %s", "state.db", e)


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that never writes: mode=ro sees a running daemon's WAL when it can,
    immutable=1 reads the main file alone when no WAL index can be opened on a read-only
    mount, and a missing file reads as an empty index."""
    if not path.exists():
        db = sqlite3.connect(":memory:", isolation_level=None)
        db.executescript(_SCHEMA)
        return db
    for flags in ("mode=ro", "immutable=1"):
        try:
            uri = f"file:{urllib.parse.quote(str(path))}?{flags}"
            db = sqlite3.connect(uri, uri=True, isolation_level=None)
            db.execute("SELECT count(*) FROM entries").fetchone()
            return db
        except sqlite3.Error as e:
            log.debug("opening %s with %s: %s", path, flags, e)
    raise sqlite3.OperationalError(f"cannot read {path} on a read-only mount")
