"""The requests of one swarm download (weightcache/swarm/download.py): which pieces are in
flight from which sources, the pieces coming from the store as they arrive (passed on to
peers: cut-through), and where each written piece came from in this run (for the integrity
re-check, weightcache/swarm/recheck.py, and the download's summary line).

The download's loop, its worker threads and the node's peer server (`client.Live`) all read
and change them: every method takes the one lock.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from weightcache.swarm.choice import ORIGIN, Request
from weightcache.swarm.pieces import Bitmap

#: The source recorded for a piece written by an earlier run (the partial's resumed prefix).
RESUMED = "resumed"


@dataclass
class Stream:
    """A piece coming from the store, passed on to peers as it arrives (cut-through): its
    buffer, of which the first `received` bytes are final (the reader only appends)."""

    data: bytearray
    received: int = 0
    began: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Summary:
    """Where a download's pieces came from: `by` counts ORIGIN, "peer" and RESUMED;
    `senders` are the peers that sent any; `streamed` the pieces a peer passed on while
    they came from the store."""

    by: collections.Counter[str]
    senders: int
    streamed: int


class Requests:
    """The bookkeeping of one download's requests (see the module docstring)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.lock = threading.Lock()
        self.inflight: dict[int, set[str]] = {}
        self.streams: dict[int, Stream] = {}  # pieces coming from the store, for peers
        self.sources: dict[int, str] = {}  # piece -> where its bytes came from, this run
        self.cut_through = 0  # pieces from peers that streamed them from the store

    def resumed(self, held: Bitmap) -> None:
        """The pieces of the partial written by an earlier run."""
        with self.lock:
            self.sources = {i: RESUMED for i in held}

    def started(self, request: Request) -> None:
        with self.lock:
            self.inflight.setdefault(request.piece, set()).add(request.source)

    def streaming(self, piece: int, data: bytearray) -> Stream:
        """The stream of a piece asked of the store, which `data` receives; one request to
        the store per piece at a time (choice.choose)."""
        stream = Stream(data)
        with self.lock:
            self.streams[piece] = stream
        return stream

    def finished(self, piece: int, source: str) -> None:
        """A request ended, its piece written or not."""
        with self.lock:
            sources = self.inflight.get(piece, set())
            sources.discard(source)
            if not sources:
                self.inflight.pop(piece, None)
            if source == ORIGIN:  # written, or failed: peers read it from the file now
                self.streams.pop(piece, None)

    def landed(self, piece: int, source: str) -> None:
        with self.lock:
            self.sources[piece] = source

    def passed_on(self) -> None:
        """A piece from a peer that streamed it from the store was written."""
        with self.lock:
            self.cut_through += 1

    def in_flight(self) -> dict[int, frozenset[str]]:
        with self.lock:
            return {p: frozenset(s) for p, s in self.inflight.items()}

    def requests(self) -> int:
        """How many requests are in flight (a piece asked of two sources counts twice)."""
        with self.lock:
            return sum(len(s) for s in self.inflight.values())

    def oldest_stream(self, now: float) -> float:
        """When the oldest piece still coming from the store was asked for (`now` if none)."""
        with self.lock:
            return min((s.began for s in self.streams.values()), default=now)

    def bitmaps(self) -> tuple[Bitmap, Bitmap]:
        """(pieces in flight, those of them streamed from the store)."""
        with self.lock:
            return Bitmap.of(self.count, self.inflight), Bitmap.of(self.count, self.streams)

    def streamed(self, piece: int, offset: int, limit: int, at_least: int) -> bytes | None:
        """What of a piece from the store has arrived, for the peer server (`client.Live`)."""
        with self.lock:
            stream = self.streams.get(piece)
        if stream is None:
            return None
        end = min(stream.received, offset + limit)
        return bytes(stream.data[offset:end]) if end - offset >= at_least else b""

    def not_from_store(self) -> list[int]:
        """The pieces whose bytes did not come from the store in this run."""
        with self.lock:
            return [i for i in range(self.count) if self.sources.get(i) != ORIGIN]

    def replaced(self, piece: int) -> str:
        """The store's bytes replace a piece's: returns who had sent it."""
        with self.lock:
            source = self.sources.get(piece, RESUMED)
            self.sources[piece] = ORIGIN
            return source

    def summary(self) -> Summary:
        with self.lock:
            by = collections.Counter(s if s in (ORIGIN, RESUMED) else "peer"
                                     for s in self.sources.values())  # fmt: skip
            senders = {s for s in self.sources.values() if s not in (ORIGIN, RESUMED)}
            return Summary(by, len(senders), self.cut_through)
