"""The names a process creates and renames away in a directory, as inotify(7) reports them:
what another tenant of the cache learns without guessing, to plant a symlink at a name
before it is used again."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

IN_MOVED_FROM = 0x040
IN_CREATE = 0x100
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of name


class Watch:
    """inotify events of one directory, read without blocking."""

    def __init__(self, directory: Path, mask: int = IN_CREATE | IN_MOVED_FROM) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {directory}")

    def events(self) -> list[tuple[int, str]]:
        """(mask, name) of each event since the last call."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        found, pos = [], 0
        while pos < len(data):
            _, mask, _, length = _EVENT.unpack_from(data, pos)
            pos += _EVENT.size
            found.append((mask, data[pos : pos + length].rstrip(b"\0").decode()))
            pos += length
        return found

    def close(self) -> None:
        os.close(self.fd)
