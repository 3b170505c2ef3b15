"""state.db: what the cache holds, when each revision was last used, pins and leases.

SQLite in WAL mode so that the daemon and many `fetch` processes write concurrently.
The index is advisory bookkeeping for eviction and `ls`; the truth about what is ready
is the marker on disk (a lost index costs LRU precision, never correctness).

Leases are the exception that makes eviction safe (design §3 invariant 8): a fetch commits its
Pod's lease *before* it checks the marker, and the evictor removes a revision only inside
a write transaction that finds no lease (`remove_unless_protected`). Write transactions
are serialized, so either the evictor sees the lease, or the fetch finds the revision gone
and fetches it again.

The file is kept usable by `StateDb` (weightcache/cache/statedb.py): a state.db replaced
or deleted under a long-lived process is reopened (its leases carried over, `_carry_over`),
and a corrupt one is moved aside and rebuilt from the markers on disk (`_refill`; design §3,
the index).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from weightcache.cache.layout import Layout
from weightcache.cache.statedb import StateDb
from weightcache.cache.store import Cache
from weightcache.errors import UsageError

if TYPE_CHECKING:
    import sqlite3  # imported where used: see weightcache/cache/statedb.py

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
    """One revision as the index records it: where from, its size, its last use, its leases."""

    name: str
    revision: str
    source: str
    size: int
    last_access: float
    leases: tuple[str, ...] = ()


#: (name, revision, source, size, last access) of a revision found on disk, for a rebuild.
Rebuilt = tuple[str, str, str, int, float]


class Index(StateDb):
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
        super().__init__(path, _SCHEMA, timeout, read_only)
        self._rebuild = rebuild
        #: Leases and accesses that could not be recorded since the last one that was, and
        #: the last error: the daemon's /healthz reports an index that keeps refusing.
        self.unrecorded = 0
        self.unrecorded_error = ""

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

    def _carry_over(self, old: sqlite3.Connection, new: sqlite3.Connection) -> None:
        """Copy leases and entries of the database that was replaced into the new one, so
        that a Pod leasing before the replacement stays protected. Best effort."""
        import sqlite3

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
            log.warning("could not carry the leases over to the new %s: %s", self.path, e)

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

    def lease(
        self,
        name: str,
        revision: str,
        pod_uid: str,
        now: float | None = None,
        limit: int | None = None,
    ) -> bool:
        """Lease the revision to the Pod, committed when this returns; call it before
        checking the marker (see `remove_unless_protected`). With a `limit`, a Pod that
        holds leases on `limit` other revisions gets none: False, nothing written. Never
        fails the caller: a cache mounted read-only still serves hits, unleased (logged)."""
        now = time.time() if now is None else now
        granted = True

        def op() -> None:
            nonlocal granted
            with self._transaction() as db:  # counted and written in one transaction
                granted = (
                    limit is None
                    or db.execute(
                        "SELECT COUNT(*) FROM leases WHERE pod_uid = ? "
                        "AND NOT (name = ? AND revision = ?)",
                        (pod_uid, name, revision),
                    ).fetchone()[0]
                    < limit
                )
                if granted:
                    db.execute(
                        "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?)",
                        (name, revision, pod_uid, now),
                    )

        self._never_failing(op, f"the lease of {name}/{revision} to Pod {pod_uid}")
        return granted

    def _never_failing(self, op: Callable[[], None], what: str) -> None:
        import sqlite3

        try:
            self._using(op)
        except (sqlite3.Error, UsageError) as e:
            log.warning("could not record %s in %s: %s", what, self.path, e)
            self.unrecorded, self.unrecorded_error = self.unrecorded + 1, str(e)
            return
        self.unrecorded = 0

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
