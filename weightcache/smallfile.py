"""Reading back a small file the cache holds: a marker, a part state, a fetch's record.

Anyone who can write the cache directory can plant one (a Pod given the read-write
fallback, a stray script), so such a file is read as untrusted: a FIFO there must not
hang the reader (the daemon, `ls`) forever, nor a symlink to /dev/zero fill its memory.
`read_small` opens without following a final symlink and without blocking, reads only a
regular file, and at most `limit` bytes of it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them.

    Raises FileNotFoundError (or NotADirectoryError) when there is no such file, as
    `open` would; ValueError when `path` is a symlink, a FIFO, a device or a directory, or
    holds more than `limit` bytes; OSError for anything else the kernel refuses."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link, not a file") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        too_large = ValueError(f"{path} holds more than {limit} bytes")
        if st.st_size > limit:
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
