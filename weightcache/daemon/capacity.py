"""The daemon's capacity role (design §5, Capacity and Free-space floor): keep the cache
under `--capacity` and its disk above `--min-free`, by LRU eviction and orphan collection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from weightcache.cache import eviction
from weightcache.cache.eviction import Watermarks
from weightcache.cache.index import Index
from weightcache.cache.store import Cache
from weightcache.config import Capacity
from weightcache.daemon.metrics import Metrics
from weightcache.errors import NoSpaceError
from weightcache.progress import human

log = logging.getLogger(__name__)

RevisionKey = tuple[str, str]

#: Seconds an idle cache goes without a full pass all the same: blobs that a fetch alone
#: published and left unlinked when it died change nothing `enforce` looks at.
FULL_PASS_EVERY = 300.0
#: Seconds a directory's mtime must be old to be trusted: a change in the same clock tick
#: as the last one would not move it.
SETTLED_AFTER = 2.0


class CapacityGuard:
    """Bounds the cache: `--capacity` (optional) and `--min-free` on the disk.

    Contract:
    - `make_room(need)` (the Fetcher's `reserve`, called before a download) evicts least
      recently used revisions until `need` more bytes fit under both bounds, or raises
      NoSpaceError (exit 5) naming the bound that cannot be kept; it never evicts.
    - `enforce()` (after every change) evicts from above the high watermark down to the
      low one, and until --min-free is free again when other files grew. Its full pass
      (read every marker, stat every blob) runs when the cache changed since the last one
      that found nothing to do (the blobs directory's mtime, the bytes of partial
      downloads, the disk's size), when --min-free is not free, or every FULL_PASS_EVERY
      seconds: an idle check costs a few syscalls, however many revisions are cached.
    - Neither ever evicts a pinned revision (`pinned()`, the models file's, or the index's)
      nor a leased one: the plan is `eviction.plan_eviction`, executed by
      `eviction.execute`, which checks both again in the removing transaction.
    - Both first delete orphan blobs (no revision links them, no running fetch wants them).
    - It owns the `weightcache_cache_bytes`, `weightcache_cache_capacity_bytes` and
      `weightcache_evictions_total` metrics; `measure()` refreshes the usage gauge, and
      `measure_disk()` the free space and floor (`weightcache_disk_free_bytes`,
      `weightcache_min_free_bytes`).
    Thread-safe: one eviction at a time.
    """

    def __init__(
        self,
        cache: Cache,
        index: Index,
        metrics: Metrics,
        *,
        capacity: Capacity | None,
        min_free: Capacity,
        watermarks: Watermarks,
        pinned: Callable[[], frozenset[RevisionKey]] = frozenset,
        disk_space: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """`disk_space()` is (filesystem size, free bytes) of the cache disk; by default
        the layout's statvfs (tests pass numbers)."""
        self.cache = cache
        self.index = index
        self.metrics = metrics
        self.capacity = capacity
        self.min_free = min_free
        self.watermarks = watermarks
        self.pinned = pinned
        self.disk_space = disk_space or cache.layout.disk_space
        self._lock = threading.Lock()
        self._settled: tuple[int, int, int] | None = None  # `_look()` after an idle pass
        self._full_pass_at = 0.0  # monotonic time of the next full pass, settled or not

    def capacity_bytes(self) -> int | None:
        """--capacity in bytes now (a percentage follows the filesystem), None if unset."""
        if self.capacity is None:
            return None
        return self.capacity.resolve(self.disk_space()[0])

    def make_room(self, need: int) -> None:
        """Evict LRU revisions so that `need` more bytes fit under capacity and leave
        --min-free free on the disk, or raise NoSpaceError (exit 5) saying which bound
        cannot be kept."""
        if need <= 0:
            return
        with self._lock:
            self._collect_orphans()
            revisions, sizes, usage = eviction.survey(self.cache, self.index, self.pinned())
            size, free = self.disk_space()
            floor = self.min_free.resolve(size)
            by_floor = eviction.floor_target(usage, need, free, floor)
            capacity = self.capacity_bytes()
            target = by_floor if capacity is None else min(capacity - need, by_floor)
            plan = eviction.plan_eviction(revisions, sizes, usage, target)
            if not plan.sufficient:
                if plan.usage_after > by_floor:
                    raise NoSpaceError(_floor_message(need, usage, free, floor, plan))
                assert capacity is not None
                raise NoSpaceError(
                    f"the revision needs {human(need)} but the cache holds {human(usage)} of "
                    f"{human(capacity)} capacity and evicting every unpinned, unused "
                    f"revision would free only {human(plan.freed_bytes)}; raise --capacity "
                    "or unpin models"
                )
            self._execute(plan)

    def enforce(self) -> None:
        """Above the high watermark, evict down to the low one; below --min-free free on
        the disk (other files grew), evict until the floor is back. Skipped while nothing
        it acts on changed since a pass that found nothing to do."""
        capacity = self.capacity_bytes()
        with self._lock:
            size, free = self.disk_space()
            look = self._look(size)
            if (
                look is not None
                and look == self._settled
                and time.monotonic() < self._full_pass_at
                and free >= self.min_free.resolve(size)
            ):
                return
            self._settled = None
            self._collect_orphans()
            revisions, sizes, usage = eviction.survey(self.cache, self.index, self.pinned())
            self.metrics.cache_bytes.set(usage)
            size, free = self.disk_space()
            target = eviction.floor_target(usage, 0, free, self.min_free.resolve(size))
            if capacity is not None:
                self.metrics.capacity_bytes.set(capacity)
                if usage > capacity * self.watermarks.high:
                    target = min(target, int(capacity * self.watermarks.low))
            if target < usage:
                self._execute(eviction.plan_eviction(revisions, sizes, usage, target))
            else:  # nothing to do: idle until what it looked at changes
                self._settled = look
                self._full_pass_at = time.monotonic() + FULL_PASS_EVERY

    def _look(self, disk_size: int) -> tuple[int, int, int] | None:
        """What a full pass depends on, read in a few syscalls: the blobs directory's mtime
        (a blob added or removed), the bytes of partial downloads (a download growing), and
        the disk's size (a --capacity in percent); None while that mtime is too recent to
        tell one change from the next."""
        stat = self.cache.layout.blobs.stat()
        if time.time() - stat.st_mtime < SETTLED_AFTER:
            return None
        return stat.st_mtime_ns, self.cache.usage(blobs=False), disk_size

    def measure(self) -> None:
        """Refresh the cache usage gauge (after a fetch added a revision)."""
        self.metrics.cache_bytes.set(self.cache.usage())

    def measure_disk(self) -> None:
        """Refresh the free-space and floor gauges (at each scrape: other files change the
        free space between two enforcements)."""
        size, free = self.disk_space()
        self.metrics.disk_free_bytes.set(free)
        self.metrics.min_free_bytes.set(self.min_free.resolve(size))

    def _collect_orphans(self) -> None:
        """Delete blobs no revision links and no running fetch wants (design §5, Capacity):
        they count as usage but would never be evicted."""
        freed = self.cache.collect_orphans()
        if freed:
            log.info("removed %s of blobs no revision uses", human(freed))

    def _execute(self, plan: eviction.EvictionPlan) -> None:
        if not plan.evict:
            return
        log.info("eviction plan: %s", plan.describe())
        eviction.execute(plan, self.cache, self.index)
        self.metrics.evictions.inc(len(plan.evict))
        self.measure()


def _floor_message(
    need: int, usage: int, free: int, floor: int, plan: eviction.EvictionPlan
) -> str:
    return (
        f"the revision needs {human(need)} but the cache disk has {human(free)} free and "
        f"--min-free keeps {human(floor)} of it free (the cache holds {human(usage)}; other "
        f"files use the rest); evicting every unpinned, unused revision would free only "
        f"{human(plan.freed_bytes)}: free space on the disk, lower --min-free, or unpin "
        "models"
    )
