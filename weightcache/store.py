"""The on-disk cache: blobs, atomic publish, revision assembly, markers, removal.

Correctness comes from renames, never from locks (STYLE: atomic publish): a blob is
published by renaming a verified, fsynced partial; a revision by renaming a directory
assembled aside with its marker already inside. `FileLock` only avoids duplicate work.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from weightcache.layout import MARKER, Layout
from weightcache.manifest import Manifest

log = logging.getLogger(__name__)
MARKER_VERSION = 1


@dataclass(frozen=True)
class Marker:
    """The completion marker of a revision: what it holds, as verified."""

    name: str
    revision: str
    source: str
    manifest_sha256: str
    files: dict[str, tuple[str, int]]  # path -> (sha256, size)
    created: float

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files.values())

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": MARKER_VERSION,
                "name": self.name,
                "revision": self.revision,
                "source": self.source,
                "manifest_sha256": self.manifest_sha256,
                "created": self.created,
                "files": {p: {"sha256": h, "size": s} for p, (h, s) in sorted(self.files.items())},
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Marker:
        d = json.loads(text)
        if d.get("version") != MARKER_VERSION:
            raise ValueError(f"unknown marker version {d.get('version')!r}")
        files = {p: (f["sha256"], int(f["size"])) for p, f in d["files"].items()}
        return cls(
            d["name"], d["revision"], d["source"], d["manifest_sha256"], files, float(d["created"])
        )


class Store:
    """Blobs and revisions of one cache directory."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    # -- reading -------------------------------------------------------------------------------

    def read_marker(self, name: str, revision: str) -> Marker | None:
        try:
            text = self.layout.marker(name, revision).read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return Marker.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring unreadable marker of %s/%s", name, revision)
            return None

    def ready(self, name: str, revision: str) -> Marker | None:
        """The marker if the revision is complete: marker present, every file its size.

        Sizes are checked (a stat per file, no read) so that a revision damaged after the
        fact, or removed under our feet, is treated as a miss rather than served.
        """
        marker = self.read_marker(name, revision)
        if marker is None or (marker.name, marker.revision) != (name, revision):
            return None
        root = self.layout.revision_dir(name, revision)
        for path, (_, size) in marker.files.items():
            try:
                if os.stat(root / path).st_size != size:
                    return None
            except OSError:
                return None
        return marker

    def has_blob(self, sha256: str) -> bool:
        return self.layout.blob(sha256).is_file()

    # -- blobs ---------------------------------------------------------------------------------

    def publish_blob(self, partial: Path, sha256: str) -> Path:
        """Move a verified, fsynced partial into the blob store (atomic, idempotent).

        The blobs directory is not fsynced here (see `sync_blobs`): a revision holds its own
        links, fsynced before its marker can exist, so losing a blob's name in a power cut
        costs a download, never correctness.
        """
        blob = self.layout.blob(sha256)
        os.chmod(partial, 0o444)
        os.replace(partial, blob)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial.with_name(partial.name + ".json"))
        return blob

    def sync_blobs(self) -> None:
        """Make the names of newly published blobs durable (once per batch)."""
        _fsync_dir(self.layout.blobs)

    def discard_partial(self, partial: Path) -> None:
        for p in (partial, partial.with_name(partial.name + ".json")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def progress_signature(self) -> tuple[int, int]:
        """(newest mtime, entry count) of tmp/: changes while any download makes progress."""
        newest, count = 0, 0
        for entry in os.scandir(self.layout.tmp):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
                count += 1
        return newest, count

    def partial_bytes(self, sha256: str) -> int:
        """Bytes already reserved on disk by a partial of this blob (0 if none)."""
        try:
            return self.layout.partial(sha256).stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    def unreferenced_blobs(self, min_age: float = 0.0) -> list[Path]:
        """Blobs no revision links to (link count 1), published at least `min_age` ago.

        The age guard spares blobs that a running fetch has just published and not yet
        linked into its revision.
        """
        cutoff = time.time() - min_age
        out = []
        for blob in self.layout.blobs.iterdir():
            with contextlib.suppress(FileNotFoundError):
                st = blob.stat()
                if st.st_nlink == 1 and st.st_ctime <= cutoff:
                    out.append(blob)
        return out

    def delete_blobs_if_unreferenced(self, hashes: Iterable[str] | None = None) -> int:
        """Delete the given blobs (default: every orphan older than an hour) that no
        revision links; return the bytes freed.

        A fetch linking such a blob at the same instant keeps the data alive through its
        new link; a fetch about to link it gets ENOENT and downloads it again.
        """
        if hashes is None:
            candidates = self.unreferenced_blobs(min_age=3600)
        else:
            candidates = [self.layout.blob(h) for h in hashes]
        freed = 0
        for blob in candidates:
            with contextlib.suppress(FileNotFoundError):
                st = blob.stat()
                if st.st_nlink == 1:
                    blob.unlink()
                    freed += st.st_size
        return freed

    def usage(self) -> int:
        """Bytes the cache occupies on disk: blobs and partial downloads."""
        total = 0
        for d in (self.layout.blobs, self.layout.tmp):
            for entry in os.scandir(d):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        return total

    # -- revisions -----------------------------------------------------------------------------

    def assemble(self, marker: Marker, manifest: Manifest) -> Path:
        """Link the revision's blobs into a directory aside, marker inside, rename into place.

        Raises FileNotFoundError if a blob vanished (evicted) before it could be linked;
        the caller downloads it again.
        """
        target = self.layout.revision_dir(marker.name, marker.revision)
        staging = self.layout.staging(marker.name, marker.revision)
        staging.mkdir()
        try:
            dirs = {staging}
            copies = 0
            for entry in manifest.entries:
                dest = staging / entry.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dirs.add(dest.parent)
                copies += _link_or_copy(self.layout.blob(entry.sha256), dest)
            if copies:
                log.warning(
                    "%s/%s: %d files are copies, not links: their blobs reached the "
                    "filesystem's link limit",
                    marker.name,
                    marker.revision,
                    copies,
                )
            marker_path = staging / MARKER
            with open(marker_path, "w") as fh:
                fh.write(marker.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            for d in dirs:
                _fsync_dir(d)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.layout.check_inside(target)
            self._move_aside(target)
            os.rename(staging, target)
            _fsync_dir(target.parent)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return target

    def remove_revision(self, name: str, revision: str) -> None:
        """Make the revision vanish atomically (rename away), then delete its files."""
        self._move_aside(self.layout.revision_dir(name, revision))
        with contextlib.suppress(OSError):
            self.layout.revision_dir(name, revision).parent.rmdir()  # only if now empty

    def drop_marker(self, name: str, revision: str) -> None:
        """Unmark a revision found damaged, so that the next fetch repairs it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.marker(name, revision))
        _fsync_dir(self.layout.revision_dir(name, revision))

    def quarantine(self, damaged: Path, sha256: str) -> None:
        """Remove a damaged revision file and, if it is the blob's own inode, the blob,
        so that the next fetch downloads it again instead of linking the damage."""
        blob = self.layout.blob(sha256)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(damaged, blob):
                blob.unlink()
        with contextlib.suppress(FileNotFoundError):
            damaged.unlink()

    def _move_aside(self, path: Path) -> None:
        if not path.exists() and not path.is_symlink():
            return
        trash = self.layout.tmp / f"trash-{os.urandom(8).hex()}"
        os.rename(path, trash)
        _fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def clean_tmp(self, older_than: float = 3600.0, partials_older_than: float = 86400.0) -> None:
        """Remove what killed processes left in tmp/: staging and trash directories and
        private partials after `older_than`, shared (resumable) partials after
        `partials_older_than` seconds without a write."""
        now = time.time()
        for entry in self.layout.tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                age = now - entry.lstat().st_mtime
                if entry.is_dir():
                    if age > older_than:
                        shutil.rmtree(entry, ignore_errors=True)
                elif age > (older_than if _is_private(entry.name) else partials_older_than):
                    entry.unlink()


def _link_or_copy(blob: Path, dest: Path) -> bool:
    """Hard-link `blob` at `dest`; past the filesystem's link limit (EMLINK: 65,000 links
    per inode on ext4, so >65k files of one content) copy it instead, read-only and
    fsynced. True if it copied. A missing blob raises FileNotFoundError either way."""
    try:
        os.link(blob, dest)
        return False
    except OSError as e:
        if e.errno != errno.EMLINK:
            raise
    shutil.copyfile(blob, dest)
    os.chmod(dest, 0o444)
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _is_private(filename: str) -> bool:
    """`<hex>.<pid>.part[.json]`: a partial private to one process."""
    return filename.split(".")[1].isdigit() if filename.count(".") >= 2 else False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileLock:
    """flock on a lock file, waiting politely. Avoids duplicate work, guarantees nothing.

    Released by the kernel when the holder dies (kill -9 included). On filesystems where
    flock silently does nothing, two fetches both download and the renames keep the
    cache correct (SPEC §3 invariant 2).
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def acquire(
        self,
        give_up: Callable[[], bool] | None = None,
        poll: float = 0.05,
        log_every: float = 30.0,
    ) -> bool:
        """Wait for the lock; False if `give_up()` turned true first (a stalled holder)."""
        if self.try_acquire():
            return True
        log.info("waiting for another fetch of %s on this node", self.what)
        start = last_log = time.monotonic()
        while not self.try_acquire():
            if give_up is not None and give_up():
                return False
            time.sleep(poll)
            poll = min(poll * 1.5, 0.5)
            if time.monotonic() - last_log >= log_every:
                last_log = time.monotonic()
                log.info(
                    "still waiting for another fetch of %s (%.0fs)", self.what, last_log - start
                )
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
