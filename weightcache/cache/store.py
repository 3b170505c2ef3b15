"""The on-disk cache: blobs, atomic publish, revision assembly, removal.

Correctness comes from renames, never from locks (design §3, invariants 1 and 2): a blob is
published by renaming a verified, fsynced partial; a revision by renaming a directory
assembled aside with its marker already inside. `FileLock` only avoids duplicate work.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.cache.layout import MARKER, Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.manifest import Manifest
from weightcache.errors import IntegrityError
from weightcache.smallfile import open_new, open_regular, read_small, write_new

if TYPE_CHECKING:
    from weightcache.cache.marker import Marker

log = logging.getLogger(__name__)
_HEX_LINE = r"(?m)^[0-9a-f]{64}$"  # compiled on use, not by every fetch
#: The most a marker (or a revision lock's list of blobs) is read of: a revision of a
#: million files is ~100 MiB of SHA256SUMS, so 256 MiB is more than any real one holds,
#: and less than a file planted in the cache could make the reader allocate.
MARKER_MAX_BYTES = 256 << 20


class FileOps:
    """The filesystem calls that publish blobs and revisions, in one object so that a test
    can make any one of them fail or "crash" (the filesystem is passed in, as s3transfer
    passes its OSUtils). Reads are not routed here: only writes change what a crash leaves.
    """

    def mkdir(self, path: Path, exist_ok: bool = False) -> None:
        """`exist_ok` also makes missing parents (`mkdir -p`); without it, a fresh name."""
        path.mkdir(parents=exist_ok, exist_ok=exist_ok)

    def link(self, src: Path, dst: Path) -> bool:
        """Hard-link, or copy past the link limit; True if it copied."""
        return _link_or_copy(src, dst)

    def write_durably(self, path: Path, text: str) -> None:
        """Create `path` (nothing may be at its name) holding `text`, fsynced."""
        write_new(path, text.encode(), fsync=True)

    def fsync_dir(self, path: Path) -> None:
        _fsync_dir(path)

    def chmod(self, path: Path, mode: int) -> None:
        """chmod the regular file `path` through its own fd, never through a symlink put
        in its place; IntegrityError if it is no regular file (nothing is changed)."""
        try:
            fd = open_regular(path)
        except ValueError as e:
            raise IntegrityError(
                f"{path} is not a regular file: something replaced it in the cache while it "
                "was downloaded, so it is not published; run the fetch again"
            ) from e
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


class Cache:
    """Blobs and revisions of one cache directory."""

    def __init__(self, layout: Layout, ops: FileOps | None = None) -> None:
        self.layout = layout
        self.ops = ops or FileOps()
        self._warned: set[tuple[str, str, str]] = set()  # unreadable markers, said once

    # -- reading -------------------------------------------------------------------------------

    def load_marker(self, name: str, revision: str) -> Marker | None:
        """The revision's marker, None if it has none; ValueError if it is unreadable,
        not a regular file or over MARKER_MAX_BYTES, or lists an unsafe path (see
        Marker.from_json)."""
        try:
            text = read_small(self.layout.marker(name, revision), MARKER_MAX_BYTES).decode()
        except (FileNotFoundError, NotADirectoryError):
            return None
        # Imported once there is one to read: a cold fetch's first GET need not wait for it.
        from weightcache.cache.marker import Marker

        return Marker.from_json(text)

    def read_marker(self, name: str, revision: str) -> Marker | None:
        """The marker, or None if absent or unreadable (then the revision is not ready)."""
        try:
            return self.load_marker(name, revision)
        except ValueError as e:
            seen = (name, revision, str(e))  # the daemon reads markers every few seconds
            log.log(
                logging.DEBUG if seen in self._warned else logging.WARNING,
                "ignoring unreadable marker of %s/%s: %s",
                name,
                revision,
                e,
            )
            self._warned.add(seen)
            return None

    def ready(self, name: str, revision: str) -> Marker | None:
        """The marker if the revision is complete: marker present, every file its size.

        Sizes are checked (a stat per file, no read) so that a revision damaged after the
        fact, or removed under our feet, is treated as a miss rather than served.
        """
        marker = self.read_marker(name, revision)
        if marker is None or (marker.name, marker.revision) != (name, revision):
            return None
        return None if self.damaged_files(marker) else marker

    def has_blob(self, sha256: str, size: int | None = None) -> bool:
        """The blob is in the store (with `size` bytes, when given: a blob of another size
        is damaged and must be downloaded again, never linked)."""
        try:
            st = self.layout.blob(sha256).stat()
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    def damaged_files(self, marker: Marker) -> dict[str, str]:
        """{path: sha256} of the marker's files that are missing or not of their size."""
        root = self.layout.revision_dir(marker.name, marker.revision)
        damaged = {}
        for path, (sha256, size) in marker.files.items():
            try:
                if os.stat(root / path).st_size != size:
                    damaged[path] = sha256
            except OSError:
                damaged[path] = sha256
        return damaged

    def repair(self, marker: Marker) -> list[str]:
        """Unmark a revision whose files lost their marked sizes: drop the marker first,
        then quarantine each damaged file with its blob (when it is the same inode), so
        the next assembly downloads them again instead of linking the damage (design §3
        invariant 7). Returns the damaged paths (none: nothing is changed)."""
        damaged = self.damaged_files(marker)
        if damaged:
            self.drop_marker(marker.name, marker.revision)
            root = self.layout.revision_dir(marker.name, marker.revision)
            for path, sha256 in sorted(damaged.items()):
                self.quarantine(root / path, sha256)
        return sorted(damaged)

    # -- blobs ---------------------------------------------------------------------------------

    def publish_blob(self, partial: Path, sha256: str) -> Path:
        """Move a verified, fsynced partial into the blob store (atomic, idempotent).

        The blobs directory is not fsynced here (see `sync_blobs`): a revision holds its own
        links, fsynced before its marker can exist, so losing a blob's name in a power cut
        costs a download, never correctness.
        """
        blob = self.layout.blob(sha256)
        # Read-only before it has its name: every revision file is a hard link to it, so
        # an engine that opens one for writing gets EACCES instead of damaging them all.
        self.ops.chmod(partial, 0o444)
        self.ops.replace(partial, blob)
        with contextlib.suppress(FileNotFoundError):
            self.ops.unlink(Layout.part_state(partial))
        return blob

    def sync_blobs(self) -> None:
        """Make the names of newly published blobs durable (once per batch)."""
        _fsync_dir(self.layout.blobs)

    def discard_partial(self, partial: Path) -> None:
        for p in (partial, Layout.part_state(partial)):
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

    def delete_blobs_if_unreferenced(self, hashes: Iterable[str]) -> int:
        """Delete the given blobs that no revision links; return the bytes freed.

        A fetch linking such a blob at the same instant keeps the data alive through its
        new link; a fetch about to link it gets ENOENT and downloads it again (callers
        leave out `wanted_by_running_fetches()` so that this stays rare).
        """
        freed = 0
        for blob in (self.layout.blob(h) for h in hashes):
            with contextlib.suppress(FileNotFoundError):
                st = blob.stat()
                if st.st_nlink == 1:
                    blob.unlink()
                    freed += st.st_size
        return freed

    def orphans(self) -> list[tuple[Path, int]]:
        """(blob, size) of every blob no revision links and no running fetch wants.

        No age guard: a fetch in progress writes the blobs it wants into its revision
        lock (`FileLock.note`) before it looks for them, so a blob it published (or found)
        and has not linked yet is spared while it holds that lock (design §5, Capacity).
        """
        wanted = self.wanted_by_running_fetches()
        out = []
        for blob in self.unreferenced_blobs():
            if blob.name not in wanted:
                with contextlib.suppress(FileNotFoundError):
                    out.append((blob, blob.stat().st_size))
        return out

    def collect_orphans(self) -> int:
        """Delete `orphans()`; return the bytes freed."""
        return self.delete_blobs_if_unreferenced(blob.name for blob, _ in self.orphans())

    def wanted_by_running_fetches(self) -> set[str]:
        """The blobs listed in the revision locks that a fetch holds now."""
        wanted: set[str] = set()
        for path in self.layout.locks.glob("rev-*.lock"):
            lock = FileLock(path, path.name)
            try:
                if lock.try_acquire():
                    lock.release()
                    continue
                listed = read_small(path, MARKER_MAX_BYTES).decode(errors="replace")
            except FileNotFoundError:
                continue
            except ValueError as e:  # planted: no fetch of ours wrote it
                log.warning("ignoring %s", e)
                continue
            wanted.update(re.findall(_HEX_LINE, listed))
        return wanted

    def usage(self, *, blobs: bool = True) -> int:
        """Bytes the cache occupies on disk: blobs (unless `blobs` is False) and partial
        downloads."""
        total = 0
        for d in (self.layout.blobs, self.layout.tmp) if blobs else (self.layout.tmp,):
            for entry in os.scandir(d):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        return total

    # -- revisions -----------------------------------------------------------------------------

    def assemble(self, marker: Marker, manifest: Manifest) -> Path:
        """Link the revision's blobs into a directory aside, marker inside, rename into place.

        The marker is written after every file is linked, and the directory only takes
        its name once both are durable: a crash at any step leaves either the previous
        revision or the complete new one (tests/integration/test_publish_crash.py).
        Raises FileNotFoundError if a blob vanished (evicted) or was found damaged (not
        of its manifest size: it is quarantined) before it could be linked; the caller
        downloads it again.
        """
        target = self.layout.revision_dir(marker.name, marker.revision)
        staging = self.layout.staging(marker.name, marker.revision)
        self.ops.mkdir(staging)
        try:
            dirs = {staging}
            copies = 0
            for entry in manifest.entries:
                dest = staging / entry.path
                self.ops.mkdir(dest.parent, exist_ok=True)
                dirs.add(dest.parent)
                copies += self._link_blob(entry.sha256, entry.size, dest)
            if copies:
                log.warning(
                    "%s/%s: %d files are copies, not links: their blobs reached the "
                    "filesystem's link limit",
                    marker.name,
                    marker.revision,
                    copies,
                )
            self.ops.write_durably(staging / MARKER, marker.to_json())
            for d in sorted(dirs, reverse=True):  # children before their parents
                self.ops.fsync_dir(d)
            self.ops.mkdir(target.parent, exist_ok=True)
            self.layout.check_inside(target)
            self.layout.check_one_filesystem(target.parent)
            self._move_aside(target)
            self.ops.rename(staging, target)
            self.ops.fsync_dir(target.parent)
        finally:
            if staging.exists():
                self.ops.rmtree(staging)
        return target

    def _link_blob(self, sha256: str, size: int, dest: Path) -> int:
        """Link a blob at `dest` (1 if it had to be copied, past the link limit), refusing
        (quarantine, FileNotFoundError) one whose size differs from the manifest's: the size
        is checked on the linked inode itself, so a blob replaced between a check and the
        link cannot slip through."""
        copied = self.ops.link(self.layout.blob(sha256), dest)
        actual = os.stat(dest).st_size
        if actual != size:
            log.warning(
                "blob %s has %d bytes instead of %d; removing it to download it again",
                sha256,
                actual,
                size,
            )
            self.quarantine(dest, sha256)
            raise FileNotFoundError(errno.ENOENT, f"blob {sha256} was damaged", str(dest))
        return int(copied)

    def remove_revision(self, name: str, revision: str) -> None:
        """Make the revision vanish atomically (rename away), then delete its files."""
        trash = self.retire_revision(name, revision)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def retire_revision(self, name: str, revision: str) -> Path | None:
        """Make the revision vanish atomically (rename into tmp/); return where it went,
        for the caller to delete (at leisure: outside any lock)."""
        trash = self._move_aside(self.layout.revision_dir(name, revision), delete=False)
        with contextlib.suppress(OSError):
            self.layout.revision_dir(name, revision).parent.rmdir()  # only if now empty
        return trash

    def drop_marker(self, name: str, revision: str) -> None:
        """Unmark a revision found damaged, so that the next fetch repairs it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.marker(name, revision))
        _fsync_dir(self.layout.revision_dir(name, revision))

    def quarantine(self, damaged: Path, sha256: str) -> None:
        """Remove a damaged revision file and, if it is the blob's own inode, the blob,
        so that the next fetch downloads it again instead of linking the damage.
        Refuses (UsageError) a path that resolves outside the cache."""
        self.layout.check_inside(damaged)
        blob = self.layout.blob(sha256)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(damaged, blob):
                blob.unlink()
        with contextlib.suppress(FileNotFoundError):
            damaged.unlink()

    def _move_aside(self, path: Path, delete: bool = True) -> Path | None:
        if not path.exists() and not path.is_symlink():
            return None
        self.layout.check_one_filesystem(path.parent)
        trash = self.layout.trash()
        self.ops.rename(path, trash)
        self.ops.fsync_dir(path.parent)
        if delete:
            self.ops.rmtree(trash)
        return trash

    def clean_tmp(self, older_than: float = 3600.0, partials_older_than: float = 86400.0) -> None:
        """Remove what killed processes left in tmp/: staging and trash directories and
        private partials after `older_than`, shared (resumable) partials after
        `partials_older_than` seconds without a write."""
        now, private = time.time(), Layout.is_private_partial
        for entry in self.layout.tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                age = now - entry.lstat().st_mtime
                if entry.is_dir() and not entry.is_symlink():  # a link is unlinked below
                    if age > older_than:
                        shutil.rmtree(entry, ignore_errors=True)
                elif age > (older_than if private(entry.name) else partials_older_than):
                    entry.unlink()


def _link_or_copy(blob: Path, dest: Path) -> bool:
    """Hard-link `blob` at `dest`; past the filesystem's link limit (EMLINK: 65,000 links
    per inode on ext4, so >65k files of one content) copy it instead, read-only and
    fsynced. True if it copied. A missing blob raises FileNotFoundError either way; a
    `dest` that exists, FileExistsError (the copy is a new file, never written through a
    symlink planted at its name)."""
    try:
        os.link(blob, dest)
        return False
    except OSError as e:
        if e.errno != errno.EMLINK:
            raise
    with open(blob, "rb") as src:
        fd = open_new(dest, os.O_WRONLY)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, 0o444)  # exactly, whatever the umask: engines read as another uid
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(fd)
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
