"""Reading back a small file the cache holds: a marker, a part state, a fetch's record.

Anyone who can write the cache directory can plant one (a Pod given the read-write
fallback, a stray script), so such a file is read as untrusted: a FIFO there must not
hang the reader (the daemon, `ls`) forever, nor a symlink to /dev/zero fill its memory.
`open_regular` opens without following a final symlink and without blocking, and keeps
only a regular file; `read_small` reads at most `limit` bytes of one. Writers of the cache's
files never write through what was planted either: `open_own` opens a file the cache
shares between processes (a lock, a partial) and replaces whatever else is at its name,
`open_new` and `write_new` create a file at a fresh name, `replace_atomically` replaces a
small file whole through a temporary of an unpredictable name.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

#: Never through a final symlink, never waiting on a FIFO (a no-op on a regular file).
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_regular(
    path: Path, flags: int = os.O_RDONLY, mode: int = 0o644, *, follow_symlinks: bool = False
) -> int:
    """A descriptor of `path` opened with `flags` (and `mode` if it creates it), if it is a
    regular file. Raises ValueError when `path` is a symlink (unless `follow_symlinks`: a
    file outside the cache, such as a ConfigMap's, is one), a FIFO, a socket, a device or
    a directory (nothing is left open); FileNotFoundError and other OSErrors as `open`."""
    safe = _SAFE & ~os.O_NOFOLLOW if follow_symlinks else _SAFE
    try:
        fd = os.open(path, flags | safe, mode)
    except OSError as e:  # ELOOP: a symlink; EISDIR: a directory opened to write; ENXIO
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link, not a file") from e
        if e.errno in (errno.EISDIR, errno.ENXIO):
            raise ValueError(f"{path} is not a regular file ({e.strerror})") from e
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file (mode {stat.filemode(st_mode)})")
    return fd


def open_own(path: Path, flags: int = os.O_RDWR, mode: int = 0o644, trees: bool = False) -> int:
    """A descriptor of the regular file `path`, created if absent, opened with `flags`.
    Anything else at its name (a symlink, a FIFO: planted by whoever can write the cache)
    is removed first and the file created in its place, so that nothing is ever written
    through it to a file outside the cache. A directory there is removed only with `trees`
    (a name under tmp/), else ValueError; OSErrors as `open`."""
    try:
        return open_regular(path, flags | os.O_CREAT, mode)
    except ValueError as e:
        if path.is_dir() and not path.is_symlink() and not trees:
            raise
        log.warning("removing %s: %s", path, e)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    return open_new(path, flags, mode)


def open_new(path: Path, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """A descriptor of the regular file `path`, created now (O_EXCL: FileExistsError if
    anything, a symlink included, is at its name)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _SAFE, mode)


def write_new(path: Path, data: bytes, fsync: bool = False) -> None:
    """Create the regular file `path` (`open_new`: nothing may be at its name) holding
    `data`, fsynced if asked; removed again when anything fails (a full disk). OSErrors as
    `open` and `write`."""
    fd = open_new(path)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def replace_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with a regular file holding `data`, atomically: written to a new
    temporary beside it whose name no other process can predict (a symlink planted there
    in advance is never written through), then renamed over `path` (a rename replaces a
    symlink, never follows it). No temporary is left when anything fails."""
    tmp = path.with_name(f"{path.name}.{os.urandom(8).hex()}.tmp")
    write_new(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def chmod_own(path: Path, mode: int, kind: int = stat.S_IFREG) -> None:
    """chmod `path` itself, never what a symlink put at its name leads to (Linux has no
    lchmod): through a descriptor that does not follow it, if `path` is of the file type
    `kind` (stat.S_IFSOCK: a socket); ValueError otherwise, nothing changed."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        found = os.fstat(fd).st_mode
        if stat.S_IFMT(found) != kind:
            raise ValueError(f"{path} is not what was made there (mode {stat.filemode(found)})")
        os.chmod(f"/proc/self/fd/{fd}", mode)  # the inode itself, as glibc's fchmodat does
    finally:
        os.close(fd)


class TooLarge(ValueError):
    """A small file holds more than its bound."""


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them.

    Raises FileNotFoundError (or NotADirectoryError) when there is no such file, as
    `open` would; ValueError when `path` is a symlink, a FIFO, a device or a directory, or
    holds more than `limit` bytes (TooLarge); OSError for anything else the kernel refuses."""
    fd = open_regular(path)
    try:
        too_large = TooLarge(f"{path} holds more than {limit} bytes")
        if os.fstat(fd).st_size > limit:
            raise too_large
        chunks, got = [], 0  # read to the end, or past the limit if it grew since
        while got <= limit and (chunk := os.read(fd, limit + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > limit:
        raise too_large
    return b"".join(chunks)
