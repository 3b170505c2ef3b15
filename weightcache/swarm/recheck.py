"""The swarm's integrity re-check (design §8, Swarm): the liars among the peers.

The whole-blob sha256 of a swarm download (weightcache/swarm/download.py) is computed as
pieces land. On a mismatch, every piece that did not come from the store in this run is
fetched again from the store and compared: a peer whose piece differs is marked bad, the
store's bytes are kept, and the blob is hashed again. At most once; the caller decides what
a second mismatch means.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightcache.errors import Interrupted, TransientError
from weightcache.swarm.choice import ORIGIN
from weightcache.swarm.inflight import RESUMED, Requests
from weightcache.swarm.storegate import StoreGate
from weightcache.transfer.partial import PartialFile
from weightcache.transfer.sources import RetryRange

if TYPE_CHECKING:
    from weightcache.swarm.client import Peers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recheck:
    """The re-check of one download's blob, written to `file` in pieces at `ranges`."""

    file: PartialFile
    ranges: list[tuple[int, int]]
    requests: Requests  # where each piece came from
    store: StoreGate  # counts the store's bytes; its downloader bounds the attempts
    read: Callable[[int], bytearray | None]  # a piece from the store, None if we stop
    peers: Peers  # who marks the liars bad

    def liars(self, pool: Executor) -> list[str]:
        """Fetch every piece that did not come from the store again from it; where the
        bytes differ, keep the store's and blame the peer that sent them. Returns the
        liars (marked bad)."""
        suspects = self.requests.not_from_store()
        liars: set[str] = set()
        for piece, data in zip(suspects, pool.map(self.from_store, suspects), strict=True):
            start, _ = self.ranges[piece]
            if os.pread(self.file.fd, len(data), start) == bytes(data):
                continue
            self.file.write(memoryview(data), start)
            source = self.requests.replaced(piece)
            if source not in (ORIGIN, RESUMED):
                liars.add(source)
        for peer in sorted(liars):
            self.peers.mark_bad(peer, f"its pieces of {self.store.label} differ from the store's")
        return sorted(liars)

    def from_store(self, piece: int) -> bytearray:
        """One piece from the store, retried as the downloader would (bounded)."""
        downloader = self.store.downloader
        for attempt in range(1, downloader.settings.max_attempts + 1):
            try:
                data = self.read(piece)
                if data is None:  # SIGTERM or `cancel`
                    raise Interrupted()
                self.store.received(len(data))
                return data
            except (RetryRange, OSError) as e:
                log.warning("%s: re-check piece %d from the store, attempt %d (%s)",
                            self.store.label, piece, attempt, e)  # fmt: skip
                time.sleep(downloader.backoff.delay(attempt))
        raise TransientError(f"cannot fetch {self.store.label} from {self.store.where} to "
                             "check the pieces peers sent; run the fetch again")  # fmt: skip
