"""Every path of the cache, in one place.

```
DIR/<name>/<revision>/...             the files, as the engine reads them (hard links to blobs)
DIR/<name>/<revision>/.weightcache    completion marker, written last (JSON: manifest digest,
                                      files, sizes); present only on a verified revision
DIR/.weightcache/blobs/sha256/<hex>   content-addressed blobs, read-only, one per content
DIR/.weightcache/tmp/                 partial blobs (<hex>.part + <hex>.part.json, resumable),
                                      revisions being assembled, revisions being deleted
DIR/.weightcache/locks/               flock files: single-flight only, never correctness
DIR/.weightcache/state.db             SQLite (WAL): entries, last access, pins, leases
DIR/.weightcache/daemon.sock          the node daemon's Unix socket, when one runs
DIR/.weightcache/daemon.lock          flocked by the one daemon of this cache dir (its pid)
DIR/.weightcache/fetching/            one record per fetch downloading without the daemon,
                                      flocked while it runs (weightcache/cache/alone.py)
```
A revision appears by `rename(2)` of a directory assembled under tmp/ with its marker
already inside, so a marked revision is always complete (design §3, invariants 1 and 2).
Everything lives on one filesystem so that links and renames are atomic.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from weightcache.errors import OtherFilesystem, UsageError

MARKER = ".weightcache"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-+=@]{0,254}")
#: A sha256 as blob names and manifests spell it.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_VOUCHED_KEY = r"[a-z0-9]+(-[a-z0-9]+)*-[0-9a-f]{8,128}(-[0-9]+)?-[0-9]+"  # compiled on use
#: NAME_MAX of every Linux filesystem: a longer file name is ENAMETOOLONG.
NAME_MAX = 255


def check_segment(value: str, what: str) -> str:
    """A model name or revision must be one safe path segment."""
    if not _SEGMENT.fullmatch(value) or value in (".", "..") or value == MARKER:
        raise UsageError(
            f"invalid {what} {value!r}: use letters, digits and . _ - + = @ "
            "(one path segment, not starting with a dot)"
        )
    return value


def check_revision(name: str, revision: str) -> None:
    """A model name and revision that can name DIR/<name>/<revision>; UsageError if not."""
    check_segment(name, "model name")
    check_segment(revision, "revision")


@dataclass(frozen=True)
class Layout:
    """The paths of one cache directory. Creating it makes the internal folders."""

    root: Path

    @classmethod
    def open(cls, cache_dir: str | os.PathLike[str], create: bool = True) -> Layout:
        """The cache at `cache_dir`, made (with its internal folders) if `create`.

        Without `create` (the operator commands: ls, verify, gc) a directory that is not a
        cache, such as a mistyped path, is a UsageError naming it, and the internal folders
        a racing first fetch has not made yet are made only on a writable mount. Works on
        a read-only mount either way when the cache exists.
        """
        root = Path(cache_dir).absolute()
        if root.exists() and not root.is_dir():
            raise UsageError(f"cache directory {root} is not a directory")
        if not create and not (root / MARKER).is_dir():
            raise UsageError(
                f"no weightcache cache at {root} (no {MARKER} folder inside); check "
                "--cache-dir (WEIGHTCACHE_CACHE_DIR)"
            )
        try:
            layout = cls(root.resolve())
            for d in (layout.blobs, layout.tmp, layout.locks):
                layout.check_inside(d)  # before mkdir: a planted DIR/.weightcache symlink
                if create or not layout.read_only:
                    d.mkdir(parents=True, exist_ok=True)
                if d.exists():
                    layout.check_one_filesystem(d)
        except OSError as e:
            raise _open_error(root, e) from e
        return layout

    def disk_space(self) -> tuple[int, int]:
        """(size, free bytes) of the filesystem holding the cache; free as an unprivileged
        writer sees it (f_bavail), which is what the kubelet's thresholds measure too."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    @property
    def read_only(self) -> bool:
        """True when the cache is on a read-only mount (the engine's view of it)."""
        try:
            return bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    @property
    def internal(self) -> Path:
        return self.root / MARKER

    @property
    def blobs(self) -> Path:
        return self.internal / "blobs" / "sha256"

    @property
    def tmp(self) -> Path:
        return self.internal / "tmp"

    @property
    def locks(self) -> Path:
        return self.internal / "locks"

    @property
    def state_db(self) -> Path:
        return self.internal / "state.db"

    @property
    def socket(self) -> Path:
        return self.internal / "daemon.sock"

    @property
    def daemon_lock(self) -> Path:
        return self.internal / "daemon.lock"

    @property
    def fetching(self) -> Path:
        return self.internal / "fetching"

    def blob(self, sha256: str) -> Path:
        if not SHA256_HEX.fullmatch(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.blobs / sha256

    def partial(self, sha256: str, private: bool = False) -> Path:
        """The shared, resumable partial of a blob; or one private to this process, used
        only when the lock holder of the shared one is stalled."""
        self.blob(sha256)  # validates the digest
        return self.tmp / (f"{sha256}.{os.getpid()}.part" if private else f"{sha256}.part")

    def vouched_partial(self, key: str, private: bool = False) -> Path:
        """The partial of a file known only by its source's checksum until its bytes land
        (design §4, Verification without SHA256SUMS): `key` is "<algorithm>-<hex>-<size>",
        or "<algorithm>-<hex>-<parts>-<size>" for a composite checksum
        (`fetch.vouched.Vouched.key`), and the blob lock of that key guards it."""
        if not re.fullmatch(_VOUCHED_KEY, key):
            raise ValueError(f"not a vouched checksum key: {key!r}")
        return self.tmp / (f"{key}.{os.getpid()}.part" if private else f"{key}.part")

    @staticmethod
    def part_state(partial: Path) -> Path:
        """`<partial>.json`: which parts of the partial are written (transfer/parts.py)."""
        return partial.with_name(partial.name + ".json")

    @staticmethod
    def is_private_partial(filename: str) -> bool:
        """`<hex>.<pid>.part[.json]`: a partial private to one process (see `partial`)."""
        return filename.split(".")[1].isdigit() if filename.count(".") >= 2 else False

    def revision_dir(self, name: str, revision: str) -> Path:
        """DIR/<name>/<revision>, refusing anything that would resolve outside DIR."""
        check_revision(name, revision)
        path = self.root / name / revision
        self.check_inside(path)
        return path

    def marker(self, name: str, revision: str) -> Path:
        return self.revision_dir(name, revision) / MARKER

    def revision_lock(self, name: str, revision: str) -> Path:
        return self.locks / fit_name(f"rev-{name}@{revision}", ".lock")

    def blob_lock(self, sha256: str) -> Path:
        return self.locks / f"blob-{sha256}.lock"

    def check_inside(self, path: Path) -> None:
        """Reject a path that resolves (through symlinks) outside the cache dir (§3 inv. 5)."""
        resolved = path.resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise UsageError(
                f"{path} resolves to {resolved}, outside the cache directory {self.root}; "
                "remove the symlink so that the cache stays inside its directory"
            )

    def check_one_filesystem(self, path: Path) -> None:
        """Refuse (OtherFilesystem) a directory of the cache on another filesystem than the
        cache directory: a volume mounted inside it makes every link and rename between
        them fail (EXDEV)."""
        if os.stat(path).st_dev != os.stat(self.root).st_dev:
            raise OtherFilesystem(
                f"{path} is on another filesystem than the cache directory {self.root} (a "
                "volume mounted inside it?); the cache links and renames files between its "
                "directories, which works only within one filesystem: unmount it, or mount "
                f"the volume at {self.root} itself"
            )

    def staging(self, name: str, revision: str) -> Path:
        """A fresh name under tmp/ to assemble a revision in before its rename."""
        return self.tmp / fit_name(f"rev-{name}@{revision}", f"-{os.urandom(8).hex()}")

    def trash(self) -> Path:
        """A fresh name under tmp/ to rename a revision to, so that it vanishes at once and
        its files are deleted after."""
        return self.tmp / f"trash-{os.urandom(8).hex()}"

    def revisions(self) -> list[tuple[str, str]]:
        """Every (name, revision) directory present, with or without a marker."""
        found = []
        for name_dir in sorted(self.root.iterdir()):
            if name_dir.name == MARKER or not name_dir.is_dir() or name_dir.is_symlink():
                continue
            for rev_dir in sorted(name_dir.iterdir()):
                if rev_dir.is_dir() and not rev_dir.is_symlink():
                    found.append((name_dir.name, rev_dir.name))
        return found


def fit_name(stem: str, suffix: str) -> str:
    """`stem + suffix`, with the stem replaced by its digest if the whole would exceed
    NAME_MAX (a 255-byte model name makes `rev-<name>@<rev>.lock` ENAMETOOLONG)."""
    if len((stem + suffix).encode()) <= NAME_MAX:
        return stem + suffix
    return f"{stem[:4]}{hashlib.sha256(stem.encode()).hexdigest()}{suffix}"


def _open_error(root: Path, e: OSError) -> UsageError:
    """The UsageError for a cache directory that cannot be opened or made."""
    if e.errno == errno.EROFS:
        what = "it is on a read-only filesystem; mount it read-write"
    elif e.errno == errno.ENOTDIR:
        what = "a component of the path is a file, not a directory; fix --cache-dir"
    elif e.errno == errno.ENAMETOOLONG:
        what = "the path is too long; use a shorter --cache-dir"
    elif isinstance(e, PermissionError):
        what = "permission denied; mount it writable for this user"
    else:
        what = f"{e.strerror or e}; check --cache-dir"
    return UsageError(f"cannot use cache directory {root}: {what}")
