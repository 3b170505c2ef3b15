"""Capacity-bounded LRU eviction: a pure plan, then its execution (design §5, Capacity).

`plan_eviction` sees only literal numbers: which revisions exist, which blobs each links,
how big each blob is, when each revision was last used, which are pinned or leased. It
evicts the least recently used candidates until the usage target is met, counting only
the blobs that no kept revision still links (shared shards free nothing).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from weightcache.cache.index import Index
from weightcache.cache.locks import FileLock
from weightcache.cache.store import Cache
from weightcache.config import HIGH_WATERMARK, LOW_WATERMARK
from weightcache.errors import OtherFilesystem, UsageError

log = logging.getLogger(__name__)

RevisionKey = tuple[str, str]


@dataclass(frozen=True)
class CachedRevision:
    name: str
    revision: str
    blobs: frozenset[str]
    last_access: float
    pinned: bool = False
    leased: bool = False

    @property
    def key(self) -> RevisionKey:
        return (self.name, self.revision)


@dataclass(frozen=True)
class EvictionPlan:
    """What to evict, what that frees, and what stays in the way."""

    evict: tuple[RevisionKey, ...]
    freed_bytes: int
    usage_before: int
    usage_after: int
    target: int
    protected: tuple[RevisionKey, ...]  # pinned or leased: never evicted

    @property
    def sufficient(self) -> bool:
        return self.usage_after <= self.target

    def describe(self) -> str:
        names = ", ".join(f"{n}/{r}" for n, r in self.evict) or "nothing"
        return (
            f"evict {names}: frees {self.freed_bytes} bytes, usage {self.usage_before} -> "
            f"{self.usage_after} (target {self.target})"
        )


def plan_eviction(
    revisions: Iterable[CachedRevision],
    blob_sizes: dict[str, int],
    usage: int,
    target: int,
) -> EvictionPlan:
    """Evict LRU unpinned, unleased revisions until `usage` <= `target`, or all candidates.

    `usage` is the bytes the cache occupies now (blobs and partials); `blob_sizes` the
    size of every blob. A blob counts as freed only once every revision linking it is
    evicted.
    """
    revisions = list(revisions)
    protected = tuple(sorted(r.key for r in revisions if r.pinned or r.leased))
    candidates = sorted(
        (r for r in revisions if not (r.pinned or r.leased)),
        key=lambda r: (r.last_access, r.name, r.revision),
    )
    links: dict[str, int] = {}
    for r in revisions:
        for blob in r.blobs:
            links[blob] = links.get(blob, 0) + 1
    evict: list[RevisionKey] = []
    freed = 0
    for r in candidates:
        if usage - freed <= target:
            break
        evict.append(r.key)
        for blob in r.blobs:
            links[blob] -= 1
            if links[blob] == 0:
                freed += blob_sizes.get(blob, 0)
    return EvictionPlan(tuple(evict), freed, usage, usage - freed, target, protected)


def floor_target(usage: int, need: int, free: int, min_free: int) -> int:
    """The cache usage to evict down to so that, after writing `need` more bytes, the disk
    keeps `min_free` bytes free (the --min-free floor, design §5).

    `free` is the disk's free space now (statvfs), so other files on the disk count: every
    byte evicted is a byte freed, and the floor needs `min_free + need - free` of them
    (none when the disk already has room). May be negative: not even an empty cache would
    keep the floor.
    """
    return usage - max(0, min_free + need - free)


@dataclass(frozen=True)
class Watermarks:
    """Evict when usage passes `high` x capacity, down to `low` x capacity."""

    high: float = HIGH_WATERMARK
    low: float = LOW_WATERMARK

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")


# -- the I/O side: survey the disk, execute a plan ----------------------------------------------


def survey(
    cache: Cache, index: Index, pinned: frozenset[RevisionKey] = frozenset()
) -> tuple[list[CachedRevision], dict[str, int], int]:
    """(ready revisions, blob sizes, bytes in use) of a cache, as the planner needs them.

    Last access comes from the index (the marker's creation time if the index lost it);
    leases from the index; pins from the caller (the daemon's models file) or the index.
    """
    entries = {(e.name, e.revision): e for e in index.entries()}
    pinned = pinned | index.pins()
    revisions = []
    for name, revision in cache.layout.revisions():
        marker = cache.read_marker(name, revision)
        if marker is None:
            continue
        entry = entries.get((name, revision))
        revisions.append(
            CachedRevision(
                name,
                revision,
                frozenset(h for h, _ in marker.files.values()),
                entry.last_access if entry else marker.created,
                pinned=(name, revision) in pinned,
                leased=bool(entry and entry.leases),
            )
        )
    blob_sizes = {}
    for blob in cache.layout.blobs.iterdir():
        with contextlib.suppress(FileNotFoundError):
            blob_sizes[blob.name] = blob.stat().st_size
    return revisions, blob_sizes, cache.usage()


def execute(plan: EvictionPlan, cache: Cache, index: Index) -> int:
    """Remove the planned revisions, then their blobs no one else links; return bytes freed.

    Each removal is a rename out of place first, so no marked revision ever misses a file.
    A revision whose lock a fetch holds is skipped this round, and so is one that a Pod
    leased (or the daemon pinned) since the plan was made: the lease is checked again in
    the same write transaction as the rename (design §3 invariant 8).
    """
    freed_blobs: set[str] = set()
    for name, revision in plan.evict:
        freed_blobs |= _evict(name, revision, cache, index)
    return cache.delete_blobs_if_unreferenced(freed_blobs - cache.wanted_by_running_fetches())


def _evict(name: str, revision: str, cache: Cache, index: Index) -> set[str]:
    """Evict one revision unless a fetch, a lease or a pin holds it; its blobs if evicted."""
    marker = cache.read_marker(name, revision)
    lock = FileLock(cache.layout.revision_lock(name, revision), f"{name}/{revision}")
    if not lock.try_acquire():
        log.info("not evicting %s/%s: a fetch holds it", name, revision)
        return set()
    trash: list[Path | None] = []
    try:
        removed = index.remove_unless_protected(
            name, revision, lambda: trash.append(cache.retire_revision(name, revision))
        )
    except OtherFilesystem:
        raise  # not the index's failure: the revision cannot move to tmp/
    except (sqlite3.Error, UsageError) as e:
        if not trash:
            log.error(
                "not evicting %s/%s: cannot read its leases in %s: %s",
                name,
                revision,
                index.path,
                e,
            )
            return set()
        # Unleased and unpinned, found in the write transaction, and already out of its
        # place: only forgetting its entry failed (a full disk). Finish, or the trash and
        # its blobs would hold the space that the eviction was for.
        log.warning(
            "evicted %s/%s, but %s could not record it (%s); its entry goes at the next eviction",
            name,
            revision,
            index.path,
            e,
        )
        removed = True
    finally:
        lock.release()
    if not removed:
        log.info("not evicting %s/%s: leased or pinned since the plan was made", name, revision)
        return set()
    for path in trash:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
    log.info("evicted %s/%s", name, revision)
    return {h for h, _ in marker.files.values()} if marker is not None else set()
