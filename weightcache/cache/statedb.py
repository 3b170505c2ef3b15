"""A SQLite file shared by many processes, kept usable whatever happens to it on disk.

WAL mode, so that the daemon and many `fetch` processes write concurrently; one connection
per thread. The file is checked before every use: a database replaced or deleted under a
long-lived process is reopened (a subclass carries what must survive over), and a corrupt
one is moved aside to `<name>.corrupt-<time>` and started anew (a subclass refills it). On
a read-only mount nothing is ever written, not even the WAL's shared-memory file. The
index (weightcache/cache/index.py) is what lives in it; design §3, the index.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from weightcache.cache.locks import FileLock
from weightcache.errors import UsageError

# sqlite3 is imported where it is used: a cold fetch needs it only in the thread that
# creates state.db while the store answers (`create_aside`), not on its way to its first GET.
if TYPE_CHECKING:
    import sqlite3

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How a database is told apart from the one a connection holds: (st_dev, st_ino).
Identity = tuple[int, int]


class StateDb:
    """The database at `path` with `schema`; cheap to construct, connects on first use.
    Subclasses fill a recovered database (`_refill`) and carry rows over from a replaced
    one (`_carry_over`)."""

    def __init__(self, path: Path, schema: str, timeout: float = 5.0, read_only: bool = False):
        self.path = path
        self.schema = schema
        self.timeout = timeout
        self.read_only = read_only
        self._local = threading.local()
        #: Connections to a database that is no longer at `path`. Never closed: closing
        #: the last connection to a WAL database unlinks `state.db-wal` and `-shm` by
        #: name, which are by now the files of the database that replaced it.
        self._abandoned: list[sqlite3.Connection] = []
        #: Bumped whenever this process found another database at `path` than the one it
        #: had open (replaced, deleted or recovered); the daemon then writes its pins again.
        self.generation = 0

    def create_aside(self) -> None:
        """Create the database now if it does not exist yet, in a thread of its own: its
        first write (a cold fetch's, after the revision is published) then costs one
        transaction instead of the file, the WAL and the schema, with their syncs. Best
        effort: any failure is left for that write to meet. Not a daemon thread: the
        interpreter waits for it (one still in sqlite3 while it finalizes may crash it)."""
        if self.read_only or self.path.exists():
            return
        threading.Thread(target=self._create, name="statedb-create").start()

    def _create(self) -> None:
        try:
            self._using(lambda: self.db)  # the thread's connection closes as the thread ends
        except Exception as e:  # the caller's first real use reports it
            log.debug("could not create %s ahead of use: %s", self.path, e)

    def _refill(self) -> None:
        """Fill a database just started in place of a corrupt one (nothing here)."""

    def _carry_over(self, old: sqlite3.Connection, new: sqlite3.Connection) -> None:
        """Copy what must survive from a replaced database into the new one (nothing here)."""

    @property
    def db(self) -> sqlite3.Connection:
        """This thread's connection to the database that is at `path` now."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if self.read_only:
            if db is None:
                db = self._local.db = _connect_read_only(self.path, self.schema)
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
            self._carry_over(db, fresh)
        return fresh

    def _connect(self) -> sqlite3.Connection:
        import sqlite3

        db = _connect_own(self.path, self.timeout)
        self._local.identity = _identity(self.path)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed: {verdict}")
            db.executescript(self.schema)
        except sqlite3.Error as e:
            if isinstance(e, sqlite3.DatabaseError) and _is_corrupt(e):
                self._abandoned.append(db)  # not closed: see `_abandoned`
            else:
                db.close()  # e.g. busy: still the file at `path`, retried on next use
            raise
        self._local.db = db
        return db

    def _abandon(self, db: sqlite3.Connection) -> None:
        import sqlite3

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
        import sqlite3

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


def _connect_own(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection to the regular file `path` (created if absent). SQLite follows a
    symlink, so whatever else is planted at its name or its WAL's is removed first, and a
    connection that opened anything but a regular file at `path` is refused
    (OperationalError). The file is never opened here: closing any descriptor of it would
    drop every SQLite lock this process holds on it (POSIX locks)."""
    import sqlite3

    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):  # SQLite's names
        with contextlib.suppress(FileNotFoundError):
            mode = os.lstat(name).st_mode
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                log.warning("removing %s: not a regular file (%s)", name, stat.filemode(mode))
                os.unlink(name)
    db = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = 0
    if not stat.S_ISREG(mode):
        db.close()
        raise sqlite3.OperationalError(f"{path} was replaced while it was opened")
    return db


def _identity(path: Path) -> Identity | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _is_corrupt(error: sqlite3.DatabaseError) -> bool:
    import sqlite3

    code = getattr(error, "sqlite_errorcode", None)
    if code is None:  # raised by `_connect` on a failed quick_check
        return "malformed" in str(error)
    return code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _connect_read_only(path: Path, schema: str) -> sqlite3.Connection:
    """A connection that never writes: mode=ro sees a running daemon's WAL when it can,
    immutable=1 reads the main file alone when no WAL index can be opened on a read-only
    mount, and a missing file reads as an empty index."""
    import sqlite3

    if not path.exists():
        db = sqlite3.connect(":memory:", isolation_level=None)
        db.executescript(schema)
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
