"""Blob sources: where the downloader reads a blob's bytes from (design §4, Blob sources).

A `BlobSource` is one blob at one place: the object in the origin store, the same blob
on a peer, a file on a mounted volume. The downloader (ranged.py) asks it for byte ranges
and knows nothing else of it: it writes what a `RangeReader` yields at its offsets, hashes
it, and applies one retry policy to every source, told by the source only how patient to
be (`attempts`) and whether its refusals mean "slow down" (`throttles`).

A range read is a `RangeReader` that fills a caller's buffer with at most one blocking read
per call, so that the downloader's stall clock and stop switch are checked between reads
whatever the source: a socket `recv_into` for HTTP sources (httprange.py), a `preadv` for
a local file (`FileBlob`, below).

One level up, a `RevisionSource` is a revision's directory at its origin, whatever the
scheme: it lists the files' sizes, reads the manifest, and hands out each file as a
`BlobSource` (design §4, Revision sources). `DirectoryRevision` (below) is a directory on
a mounted filesystem (a PVC, NFS); `S3Revision` (s3revision.py) is an s3:// prefix;
`HubRevision` (hub.py) a Hugging Face Hub repository at a revision.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from weightcache.errors import IntegrityError, SourceError
from weightcache.smallfile import TooLarge, read_small

if TYPE_CHECKING:
    from weightcache.transfer.checksums import Vouch

#: Seconds one read from a source may block before the range is cut and retried (an HTTP
#: source's socket timeout, capped by --timeout). A peer serving a partial that does not grow
#: cuts its response sooner (weightcache/node/peerserver.py PARTIAL_WAIT), so that its
#: receiver sees a cut body and moves on rather than a timeout.
READ_TIMEOUT = 30.0
#: The most of a small answer read into memory (a SHA256SUMS, a listing page, an error):
#: a SHA256SUMS of 500,000 files is ~50 MiB. A larger one (or an endless body) from a
#: broken or hostile server or volume is refused, not read until the process is killed.
SMALL_BODY_MAX = 64 << 20


class RetryRange(Exception):
    """A retryable failure of one range read (reset, 5xx, truncated body, timeout, a
    trickle); `throttle` if the source asked to slow down. The downloader resumes the
    range at the byte where it broke."""

    def __init__(self, reason: str, throttle: bool = False) -> None:
        super().__init__(reason)
        self.throttle = throttle


class RangeReader(Protocol):
    def readinto(self, buf: memoryview) -> int:
        """Read the range's next bytes into `buf` with at most one blocking read; return
        how many (0: the source has no more, which is a truncation if the range is not
        done). Raises RetryRange, or a WeightcacheError for a failure retrying cannot fix."""


class BlobSource(Protocol):
    """One blob at one place, readable by byte ranges. Thread-safe: the downloader reads
    several ranges of it at once, from several threads."""

    @property
    def kind(self) -> str:
        """The metrics label of the bytes it sends: "origin" or "peer"."""

    @property
    def where(self) -> str:
        """Where the blob is, for messages: "s3://bucket/key", a peer's URL, a path."""

    @property
    def attempts(self) -> int | None:
        """Failures without progress tolerated for one part before the download fails,
        so that a caller can fall back to another source; None: `--max-attempts`."""

    @property
    def throttles(self) -> bool:
        """Whether a refusal to serve (HTTP 429/503) means "slow down": it then halves the
        download's concurrency (AIMD). A peer's 503 only means "busy, ask someone else"."""

    def open_range(
        self, start: int, end: int, size: int, timeout: float
    ) -> contextlib.AbstractContextManager[RangeReader]:
        """Read bytes [start, end) of the blob, expected to be `size` bytes long; each
        read blocks at most `timeout` seconds. The context releases what the read holds
        (a connection is kept for reuse only after a clean, complete read). Raises
        RetryRange; IntegrityError if the blob's size is no longer `size`; SourceError if
        it is gone or access is denied."""


def whole_only(source: BlobSource) -> bool:
    """Whether the source can only send its blob whole (an optional `whole_only` attribute,
    False if absent: a web server that ignores Range): one reader must read it, in order."""
    return bool(getattr(source, "whole_only", False))


def part_size_for(source: BlobSource, size: int, part_size: int) -> int:
    """The part size to read a `size`-byte blob of `source` in: `part_size`, or the whole
    blob for a `whole_only` source, so that no part of it is sent twice."""
    return max(size, 1) if whole_only(source) else part_size


class RevisionSource(Protocol):
    """A revision's files at their origin. Not a hit-path object: built on a miss."""

    @property
    def url(self) -> str:
        """The revision's URL, as markers record it: s3://bucket/prefix, file:///path."""

    @property
    def manifest_hint(self) -> str:
        """What to do when the revision has no SHA256SUMS (the end of an exit-3 message)."""

    def list_sizes(self) -> dict[str, int]:
        """{relative POSIX path: size} of every file of the revision. Raises SourceError
        (missing, denied), TransientError."""

    def read_bytes(self, relpath: str) -> bytes:
        """A small file of the revision (its SHA256SUMS). Raises SourceError if there is
        none."""

    def blob(self, relpath: str) -> BlobSource:
        """The file `relpath` (a validated manifest path) as a BlobSource."""

    def vouches(self) -> Mapping[str, tuple[str, str] | Vouch]:
        """{relpath: (algorithm, lowercase hex digest)} of what the source itself vouches for
        each file's content; files it vouches nothing for are absent. Algorithms:
        checksums.ALGORITHMS ("sha256", "crc32c", "md5", "crc64nvme", "git-sha1" (a git
        blob id), ...), or a composite one given as a `Vouch` with its part sizes. Called
        only when the revision has no SHA256SUMS (design §4, Verification without
        SHA256SUMS)."""


class DirectoryRevision:
    """A revision as a directory on a mounted filesystem (file:///path or /path).

    Sizes come from stat, blobs are `FileBlob`s read in parallel ranges. A symlink is
    followed only if it resolves inside the revision's directory (after resolving the
    directory itself): one pointing elsewhere is refused, so that a source cannot make the
    cache (or the node daemon, design §5) copy files from outside the allowed prefixes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def manifest_hint(self) -> str:
        import shlex  # an error's, off a fetch's path

        root = shlex.quote(str(self.root))
        sums = shlex.quote(str(self.root / "SHA256SUMS"))
        return (
            f"write one beside the files with `weightcache manifest {root} > {sums}`, or "
            "publish the model to s3:// with `weightcache publish`"
        )

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    def list_sizes(self) -> dict[str, int]:
        real = self._real_root()
        sizes: dict[str, int] = {}
        for top, dirs, files in os.walk(real, onerror=_raise):
            dirs.sort()
            for name in files:
                path = Path(top, name)
                rel = path.relative_to(real).as_posix()
                st = self._resolve(real, rel).stat()
                if not stat.S_ISREG(st.st_mode):
                    raise _not_regular(f"{self.url}/{rel}", st.st_mode)
                sizes[rel] = st.st_size
        return sizes

    def read_bytes(self, relpath: str) -> bytes:
        """The file, if it is a regular one of at most SMALL_BODY_MAX bytes (never waiting
        on a FIFO, never reading a device). Raises SourceError."""
        path, where = self._resolve(self._real_root(), relpath), f"{self.url}/{relpath}"
        try:
            return read_small(path, SMALL_BODY_MAX)
        except TooLarge as e:
            raise SourceError(
                f"{where} holds more than {SMALL_BODY_MAX >> 20} MiB, more than a "
                f"{relpath} of a million files; check that it is the right file"
            ) from e
        except ValueError as e:
            raise _not_regular(where, os.stat(path).st_mode) from e
        except OSError as e:
            raise SourceError(f"{where}: {e.strerror}") from e

    def blob(self, relpath: str) -> BlobSource:
        return FileBlob(self._resolve(self._real_root(), relpath))

    def vouches(self) -> dict[str, tuple[str, str]]:
        """Nothing: a filesystem records no checksum of a file's content."""
        return {}

    def _real_root(self) -> Path:
        try:
            real = self.root.resolve(strict=True)
        except OSError as e:
            raise SourceError(
                f"{self.url}: {e.strerror}; check the path and that its volume is mounted"
            ) from e
        if not real.is_dir():
            raise SourceError(f"{self.url} is not a directory")
        return real

    def _resolve(self, real_root: Path, relpath: str) -> Path:
        """The real path of `relpath`, which must stay inside the revision's directory."""
        try:
            real = (real_root / relpath).resolve(strict=True)
        except OSError as e:
            raise SourceError(f"{self.url}/{relpath}: {e.strerror}") from e
        except RuntimeError as e:  # a loop (OSError ELOOP from Python 3.13)
            raise SourceError(
                f"{self.url}/{relpath}: a loop of symbolic links; fix or remove it"
            ) from e
        if not real.is_relative_to(real_root):
            raise SourceError(
                f"{self.url}/{relpath} is a symlink to {real}, outside {self.url}: refused; "
                "copy the file into the revision's directory"
            )
        return real


def _not_regular(where: str, mode: int) -> SourceError:
    return SourceError(
        f"{where} is not a regular file (mode {stat.filemode(mode)}); a revision holds "
        "regular files only: replace it with the file or remove it"
    )


def _raise(e: OSError) -> None:
    raise SourceError(f"cannot list {e.filename}: {e.strerror}") from e


class FileBlob:
    """A blob in a regular file (a mounted volume or a local directory): ranges read with
    `preadv` at their offsets, no network stack. Reads are never throttled; a missing
    file is SourceError, any other OSError is retried."""

    kind = "origin"
    attempts: int | None = None
    throttles = False

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def where(self) -> str:
        return str(self.path)

    @contextlib.contextmanager
    def open_range(self, start: int, end: int, size: int, timeout: float) -> Iterator[RangeReader]:
        try:
            fd = os.open(
                self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
            )  # never a FIFO's wait
        except FileNotFoundError as e:
            raise SourceError(f"{self.where}: no such file; it changed or vanished") from e
        except OSError as e:
            raise RetryRange(f"{type(e).__name__}: {e}") from e
        try:
            if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
                raise _not_regular(self.where, mode)
            if os.fstat(fd).st_size != size:
                raise IntegrityError(
                    f"{self.where} is {os.fstat(fd).st_size} bytes now but was {size} when "
                    "listed; the file changed during the fetch, run it again"
                )
            yield _FileRange(fd, start, end)
        finally:
            os.close(fd)


class _FileRange:
    def __init__(self, fd: int, pos: int, end: int) -> None:
        self._fd, self._pos, self._end = fd, pos, end

    def readinto(self, buf: memoryview) -> int:
        want = min(len(buf), self._end - self._pos)
        if want <= 0:
            return 0
        try:
            n = os.preadv(self._fd, [buf[:want]], self._pos)
        except OSError as e:
            raise RetryRange(f"{type(e).__name__}: {e}") from e
        self._pos += n
        return n
