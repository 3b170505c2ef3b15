"""file:// sources: a revision as a local directory, its files read with positioned
reads (design §4, Revision sources)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from weightcache.errors import IntegrityError, SourceError
from weightcache.smallfile import TooLarge, read_small
from weightcache.transfer.sources import SMALL_BODY_MAX, BlobSource, RangeReader, RetryRange


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
