"""Lock files (`DIR/.weightcache/locks/`): they avoid duplicate work, never guarantee anything.

Correctness comes from renames (weightcache/cache/store.py, design §3 invariant 2).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from weightcache.smallfile import open_own

log = logging.getLogger(__name__)


class FileLock:
    """flock on a lock file, waiting politely. Avoids duplicate work, guarantees nothing.

    Released by the kernel when the holder dies (kill -9 included). On filesystems where
    flock silently does nothing, two fetches both download and the renames keep the
    cache correct (design §3 invariant 2).
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = open_own(self.path)  # `note` writes it: never through a planted symlink
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

    @property
    def held(self) -> bool:
        return self._fd is not None

    def note(self, text: str) -> None:
        """Replace the lock file's content with `text` (one write), while held: what the
        holder is doing, for others to read (`Cache.wanted_by_running_fetches`)."""
        assert self._fd is not None, "note() needs the lock held"
        data = text.encode()
        os.pwrite(self._fd, data, 0)  # then truncate: a reader never sees it emptied
        os.ftruncate(self._fd, len(data))

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
