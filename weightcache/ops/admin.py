"""Operator commands over a cache directory: ls, verify, gc."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.cache import eviction
from weightcache.cache.index import for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.marker import Marker
from weightcache.cache.store import Cache
from weightcache.config import Capacity
from weightcache.errors import IntegrityError, UsageError
from weightcache.ops.publish import sha256_file
from weightcache.progress import human

#: Revisions a gc's warning names at most.
MAX_NAMED = 5


def list_entries(cache_dir: Path) -> list[dict[str, Any]]:
    """One row per revision directory on disk, with the index's bookkeeping."""
    layout = Layout.open(cache_dir, create=False)
    cache = Cache(layout)
    idx = for_cache(layout)
    index = {(e.name, e.revision): e for e in idx.entries()}
    pins = idx.pins()
    rows = []
    for name, revision in layout.revisions():
        marker = cache.read_marker(name, revision)
        entry = index.get((name, revision))
        rows.append(
            {
                "name": name,
                "revision": revision,
                "size": marker.size if marker else None,
                "last_access": entry.last_access if entry else (marker.created if marker else None),
                "pinned": (name, revision) in pins,
                "leases": list(entry.leases) if entry else [],
                "ready": cache.ready(name, revision) is not None,
                "source": marker.source if marker else (entry.source if entry else ""),
                # how its files were verified, counted by method: design §3, the marker
                "verified": marker.verification() if marker else None,
            }
        )
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    header = ("MODEL", "REVISION", "SIZE", "LAST USE", "PINNED", "LEASES", "READY")
    lines = [header]
    for r in rows:
        last = r["last_access"]
        lines.append(
            (
                r["name"],
                r["revision"],
                human(r["size"]) if r["size"] is not None else "-",
                time.strftime("%Y-%m-%d %H:%M", time.localtime(last)) if last else "-",
                "yes" if r["pinned"] else "no",
                str(len(r["leases"])),
                "yes" if r["ready"] else "no",
            )
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def verify(cache_dir: Path, target: str) -> list[str]:
    """Re-hash every file of NAME/REV (or every revision of NAME); return verified paths.

    A mismatch drops that revision's marker, so the next fetch repairs it, and raises
    IntegrityError naming the file and both hashes.
    """
    layout = Layout.open(cache_dir, create=False)
    cache = Cache(layout)
    name, _, revision = target.partition("/")
    revisions = [revision] if revision else [r for n, r in layout.revisions() if n == name]
    if not revisions:
        raise UsageError(f"no revision of {name!r} in {layout.root}; see `weightcache ls`")
    verified = []
    for rev in revisions:
        root = layout.revision_dir(name, rev)
        if not root.is_dir():
            raise UsageError(
                f"no revision {name}/{rev} in {layout.root}; see `weightcache ls` for what "
                "the cache holds"
            )
        marker = _trusted_marker(layout, cache, name, rev)
        for path, (expected, size) in sorted(marker.files.items()):
            actual = sha256_file(root / path) if (root / path).is_file() else "missing"
            if actual != expected or os.stat(root / path).st_size != size:
                raise _damaged(cache, (name, rev), root / path, expected, actual)
        verified.append(str(root))
    return verified


def _trusted_marker(layout: Layout, cache: Cache, name: str, rev: str) -> Marker:
    """The marker of NAME/REV, refused (IntegrityError) if absent, unreadable, or if any
    of its paths leads outside the revision (a planted `../../x` or a symlinked directory):
    verify runs as root and deletes what does not match, so it must touch nothing else
    (design §3, the marker)."""
    root = layout.revision_dir(name, rev)
    try:
        marker = cache.load_marker(name, rev)
    except ValueError as e:
        raise IntegrityError(
            f"the marker of {name}/{rev} cannot be trusted ({e}); nothing was hashed or "
            f"removed: delete {root} and fetch it again"
        ) from e
    if marker is None:
        raise IntegrityError(f"{name}/{rev} has no completion marker; fetch it again")
    for path in marker.files:
        if not (root / path).resolve().is_relative_to(root.resolve()):
            raise IntegrityError(
                f"the marker of {name}/{rev} lists {path!r}, which resolves outside "
                f"{root}; nothing was hashed or removed: delete {root} and fetch it again"
            )
    return marker


def _damaged(
    cache: Cache, revision: tuple[str, str], file: Path, expected: str, actual: str
) -> IntegrityError:
    """Unmark the damaged revision (so the next fetch repairs it) unless the mount is
    read-only; the error to raise either way."""
    name, rev = revision
    root = cache.layout.revision_dir(name, rev)
    what = (
        f"sha256 mismatch for {file.relative_to(root)} in {name}/{rev}: expected {expected}, "
        f"got {actual}"
    )
    if cache.layout.read_only:
        return IntegrityError(
            f"{what}; nothing was removed (read-only mount): run verify where the cache is "
            "mounted read-write so that the next fetch repairs it"
        )
    cache.drop_marker(name, rev)
    cache.quarantine(file, expected)
    return IntegrityError(
        f"{what}; the marker and the damaged file were removed so the next fetch repairs it"
    )


def gc(
    cache_dir: Path,
    capacity: Capacity,
    models_file: Path | None,
    dry_run: bool,
    min_free: Capacity | None = None,
) -> GcResult:
    """Remove orphaned blobs (no revision links them, no running fetch wants them), then
    plan (and unless dry_run, execute) LRU eviction down to `capacity`, and further if
    needed to leave `min_free` free on the disk (other files count)."""
    from weightcache.daemon.models import load

    layout = Layout.open(cache_dir, create=False)
    if layout.read_only and not dry_run:
        raise UsageError(
            f"the cache at {layout.root} is on a read-only mount; run gc where it is mounted "
            "read-write (or add --dry-run to see the plan)"
        )
    cache = Cache(layout)
    index = for_cache(layout)
    pinned = load(models_file).pinned if models_file else frozenset()
    disk_size, free = layout.disk_space()
    floor = min_free.resolve(disk_size) if min_free is not None else 0
    orphans = sum(size for _, size in cache.orphans())
    if not dry_run:
        orphans = cache.collect_orphans()
    revisions, sizes, usage = eviction.survey(cache, index, pinned)
    if dry_run:  # the orphans are still there: plan as if they were gone
        usage, free = usage - orphans, free + orphans
    by_floor = eviction.floor_target(usage, 0, free, floor)
    # The floor lowers the target only where it binds (else the target read as the usage);
    # below 0 (other files leave less than the floor free): evict what can be, down to 0.
    target = capacity.resolve(disk_size)
    if by_floor < usage:
        target = max(0, min(target, by_floor))
    plan = eviction.plan_eviction(revisions, sizes, usage, target)
    unmet = ""
    if by_floor < 0:
        unmet = (
            f"; --min-free {min_free} ({floor} bytes) cannot be kept even by an empty cache: "
            "other files use the disk, free them or lower --min-free"
        )
    if dry_run:
        done = f"would remove {orphans} bytes of orphaned blobs; would {plan.describe()}{unmet}"
        return GcResult(done, _kept_above(plan))
    freed = eviction.execute(plan, cache, index)
    cache.clean_tmp()
    done = (
        f"{plan.describe()}; {freed} bytes of evicted revisions and {orphans} bytes of "
        f"orphaned blobs freed{unmet}"
    )
    return GcResult(done, _kept_above(plan))


@dataclass(frozen=True)
class GcResult:
    """What gc did (or would do), and why the cache stays above its target, if it does."""

    done: str
    shortfall: str | None


def _kept_above(plan: eviction.EvictionPlan) -> str | None:
    """Why `plan` leaves the cache above its target (None if it does not): what is pinned
    or leased, which gc never evicts."""
    if plan.sufficient:
        return None
    kept = ", ".join(f"{n}/{r}" for n, r in plan.protected[:MAX_NAMED]) or "nothing"
    more = f" and {len(plan.protected) - MAX_NAMED} more" if len(plan.protected) > MAX_NAMED else ""
    return (
        f"the cache stays at {plan.usage_after} bytes, above the target of {plan.target}: "
        f"the rest is pinned or leased ({kept}{more}), which gc never evicts; raise "
        "--capacity, unpin in the models file, or wait for the Pods holding leases to end"
    )
