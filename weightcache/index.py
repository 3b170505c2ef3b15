"""state.db: what the cache holds, when each revision was last used, pins and leases.

SQLite in WAL mode so that the daemon and many `fetch` processes write concurrently.
The index is advisory bookkeeping for eviction and `ls`; the truth about what is ready
is the marker on disk (a lost index costs LRU precision, never correctness).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

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
    pinned: bool
    leases: tuple[str, ...] = ()


class Index:
    """state.db; cheap to construct, connects on first use, one connection per thread.

    `read_only` (a cache on a read-only mount) reads what the file holds and writes nothing,
    not even the WAL's shared-memory file: a missing file reads as empty.
    """

    def __init__(self, path: Path, timeout: float = 5.0, read_only: bool = False) -> None:
        self.path = path
        self.timeout = timeout
        self.read_only = read_only
        self._local = threading.local()

    @property
    def db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None and self.read_only:
            db = self._local.db = _connect_read_only(self.path)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._local.db = db
        return db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE .. COMMIT: autocommit mode makes `with db:` a no-op, and
        readers must never see pins cleared but not yet set again."""
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
        try:
            with self._transaction():
                self.db.execute(
                    "INSERT INTO entries (name, revision, source, size, last_access, created) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name, revision) DO UPDATE SET "
                    "last_access = excluded.last_access, "
                    "source = CASE WHEN excluded.source = '' THEN source ELSE excluded.source END,"
                    "size = CASE WHEN ? IS NULL THEN size ELSE excluded.size END",
                    (name, revision, source, size or 0, now, now, size),
                )
                if pod_uid:
                    self.db.execute(
                        "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?)",
                        (name, revision, pod_uid, now),
                    )
        except sqlite3.Error as e:
            log.warning(
                "could not record the access to %s/%s in %s: %s", name, revision, self.path, e
            )

    def entries(self) -> list[Entry]:
        leases: dict[tuple[str, str], list[str]] = {}
        for name, rev, uid in self.db.execute("SELECT name, revision, pod_uid FROM leases"):
            leases.setdefault((name, rev), []).append(uid)
        pins = self.pins()
        return [
            Entry(n, r, src, size, last, (n, r) in pins, tuple(sorted(leases.get((n, r), ()))))
            for n, r, src, size, last in self.db.execute(
                "SELECT name, revision, source, size, last_access FROM entries "
                "ORDER BY name, revision"
            )
        ]

    def pins(self) -> set[tuple[str, str]]:
        return {(n, r) for n, r in self.db.execute("SELECT name, revision FROM pins")}

    def set_pins(self, pinned: set[tuple[str, str]]) -> None:
        with self._transaction():
            self.db.execute("DELETE FROM pins")
            self.db.executemany("INSERT INTO pins VALUES (?, ?)", sorted(pinned))

    def lease_holders(self) -> set[str]:
        return {uid for (uid,) in self.db.execute("SELECT DISTINCT pod_uid FROM leases")}

    def lease_ages(self) -> list[tuple[str, float]]:
        """(pod_uid, most recent lease time) per Pod."""
        return list(self.db.execute("SELECT pod_uid, MAX(since) FROM leases GROUP BY pod_uid"))

    def end_leases(self, pod_uids: set[str]) -> None:
        with self._transaction():
            self.db.executemany("DELETE FROM leases WHERE pod_uid = ?", [(u,) for u in pod_uids])

    def forget(self, name: str, revision: str) -> None:
        with self._transaction():
            self.db.execute("DELETE FROM entries WHERE name = ? AND revision = ?", (name, revision))


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
