"""Reading back a small file the cache holds: a marker, a part state, a fetch's record.

Anyone who can write the cache directory can plant one (a Pod given the read-write
fallback, a stray script), so such a file is read as untrusted: a FIFO there must not
hang the reader (the daemon, `ls`) forever, nor a symlink to /dev/zero fill its memory.
`open_regular` opens without following a final symlink and without blocking, and keeps
only a regular file; `read_small` reads at most `limit` bytes of one. Writers of the cache's
files open them the same way (partial downloads, the mode change before publishing).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

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


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them.

    Raises FileNotFoundError (or NotADirectoryError) when there is no such file, as
    `open` would; ValueError when `path` is a symlink, a FIFO, a device or a directory, or
    holds more than `limit` bytes; OSError for anything else the kernel refuses."""
    fd = open_regular(path)
    try:
        too_large = ValueError(f"{path} holds more than {limit} bytes")
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
