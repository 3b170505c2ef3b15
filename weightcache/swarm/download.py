"""The swarm's data plane (design §8, Swarm): one blob, piece by piece, from peers and the store.

`SwarmDownload.run` fills the blob's partial file (transfer/partial.py, its parts being the
swarm's pieces) by a loop that asks `choice.choose` what to request next (through
chooser.py), from its view of the peers and of the store, and runs each request in a
worker thread:

- **Views.** Every VIEW_EVERY seconds the peers found by discovery (a sample of them past
  `--peer-view`: weightcache/swarm/views.py) are asked a HEAD of the blob (in the
  background); every response to a piece request updates the view too (the
  peer server advertises held and in-flight pieces on every answer, refusals included).
  A peer that does not answer, or cuts a piece short, is left out until it answers again.
  A peer's claim that does not become a piece in time expires (chooser.py): the store
  is asked for that piece.
- **Requests.** A piece asked of a peer carries `Held-Only`: a 416 only updates the view. A
  piece asked of the store goes through the origin's `BlobSource`, at most the store
  window in flight (`next_window`, measured at each piece the store delivers). A piece is
  read into memory and written at its offset only when complete, and recorded as written
  (so a kill loses at most the pieces in flight); a second source of the same piece
  (endgame) is dropped if the first one landed.
- **Integrity.** The whole-blob sha256 is computed as pieces land. On a mismatch, the
  pieces peers sent are fetched again from the store, the liars marked bad, and the blob
  hashed again (weightcache/swarm/recheck.py).
- **The next blob.** Once every piece is held or asked for, here or by a peer in view
  (nothing is left for this node to claim from the store), the download sets its
  `all_claimed` event: the caller may start the next blob meanwhile (fetch/blobs.py), so
  that neither the store nor the links idle while this blob's last pieces come. Its
  `cancel` event stops it (Interrupted), partial kept.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.errors import Interrupted, TransientError, WeightcacheError
from weightcache.swarm.choice import ORIGIN, Request, RequestLimits
from weightcache.swarm.chooser import Chooser
from weightcache.swarm.inflight import RESUMED, Requests, Stream
from weightcache.swarm.pace import PEER_TIMEOUT, RATE_WINDOW, Rates, TooSlow, judge, slow_floor
from weightcache.swarm.pieces import Bitmap, piece_ranges, piece_size_for
from weightcache.swarm.recheck import Recheck
from weightcache.swarm.storegate import StoreGate
from weightcache.swarm.views import VIEW_EVERY, VIEW_LAG, PeerViews
from weightcache.transfer.partial import PartialFile
from weightcache.transfer.sources import BlobSource, RetryRange

if TYPE_CHECKING:
    from weightcache.fetch.blobs import SwarmMembers
    from weightcache.swarm.client import Peers
    from weightcache.transfer.downloader import RangedDownloader

log = logging.getLogger(__name__)

TICK = 0.1  # seconds the loop sleeps at most between choices
HASH_BUFFER = 256 << 10


class _Dropped(Exception):
    """A request no longer needed: its piece landed from another source, or we stop."""


@dataclass
class Outcome:
    """What `SwarmDownload.run` did: the blob's sha256 (after a re-check from the store,
    if the first assembly did not verify), and the bytes received from the store."""

    digest: str
    mismatched: bool = False
    origin_bytes: int = 0
    liars: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SwarmJob:
    """One blob for the swarm to download: the blob (`sha256`, `size`, `label` in messages),
    its partial file, the store as its source, and the caller's signals (see the module
    docstring: `all_claimed`, `cancel`); `members`: the peers seen swarming the revision's
    other blobs (`SwarmMembers`)."""

    sha256: str
    size: int
    partial: Path
    label: str
    origin: BlobSource
    limits: RequestLimits = field(default_factory=RequestLimits)
    all_claimed: threading.Event | None = None
    cancel: threading.Event | None = None
    members: SwarmMembers | None = None


class SwarmDownload:
    """One blob, downloaded by the swarm into its partial (see the module docstring), from
    the node's `peers` and, through `downloader`, the store."""

    def __init__(self, job: SwarmJob, peers: Peers, downloader: RangedDownloader) -> None:
        self.job, self.peers, self.downloader = job, peers, downloader
        self.sha256, self.size, self.label = job.sha256, job.size, job.label
        self.observer = downloader.observer
        self.piece_size = piece_size_for(job.size)
        self.ranges = piece_ranges(job.size, self.piece_size)
        self.count = len(self.ranges)
        self.rates = Rates()
        self.land_lock = threading.Lock()  # one piece written at a time: first source wins
        self.requests = Requests(self.count)
        self.views = PeerViews(peers, job.sha256, job.size, self.piece_size, job.members)
        self.store = StoreGate(job.limits, downloader, job.origin.where, job.label,
                               self.piece_size, VIEW_LAG)  # fmt: skip
        self.chooser = Chooser(self.views, self.store, self.requests, self.rates, job.all_claimed)
        self.errors: list[BaseException] = []
        self.last_progress = time.monotonic()
        self.events: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.local = threading.local()
        self.file: PartialFile | None = None

    # -- the whole download ------------------------------------------------------------------

    def run(self) -> Outcome:
        """Fill the partial and return its sha256 (see Outcome). Raises Interrupted,
        TransientError (no progress in --timeout), NoSpaceError, and the store's
        SourceError or IntegrityError."""
        self.file = PartialFile.open(self.job.partial, self.label, self.size, self.piece_size)
        pool = ThreadPoolExecutor(self.job.limits.total + 1, thread_name_prefix="swarm")
        self.peers.advertise(self.sha256, self)
        try:
            held = self._held()
            self.observer.expect(self.size - sum(b - a for i, (a, b) in enumerate(self.ranges)
                                                 if i in held))  # fmt: skip
            self.requests.resumed(held)
            self.file.advance_hash(self._buffer(), self._stopping)  # a resumed prefix: long
            self._loop(pool)
            digest = self._digest()
            self._log_summary()
            if digest == self.sha256:
                return Outcome(digest, False, self.store.bytes)
            log.warning("%s: the swarm's copy has sha256 %s, expected %s; fetching the "
                        "pieces peers sent again from the store", self.label, digest,
                        self.sha256)  # fmt: skip
            check = Recheck(self.file, self.ranges, self.requests, self.store,
                            lambda piece: self._read(piece, ORIGIN, "origin", recheck=True),
                            self.peers)  # fmt: skip
            liars = check.liars(pool)
            digest = self.file.rehash(self._buffer(), self._stopping)
            return Outcome(digest, True, self.store.bytes, liars)
        finally:
            self.stop.set()
            self.peers.unadvertise(self.sha256, self)
            pool.shutdown(wait=True, cancel_futures=True)
            self.file.close()

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        self.views.refreshing.set()
        self.views.refresh()  # the first choice with a view: who holds it already
        next_view = time.monotonic() + VIEW_EVERY
        while len(self._held()) < self.count:
            self._check()
            if time.monotonic() >= next_view and not self.views.refreshing.is_set():
                next_view = time.monotonic() + VIEW_EVERY
                self.views.refreshing.set()
                pool.submit(self._refresh_views)
            for request in self._choose():
                self.requests.started(request)
                pool.submit(self._fetch, request)
            with contextlib.suppress(queue.Empty):
                self.events.get(timeout=TICK)

    def _log_summary(self) -> None:
        pieces = self.requests.summary()
        store = self.store.view()
        watched, listed = self.views.watching()
        log.info("swarm: %s in %d pieces: %d from the store, %d from %d peers (%d streamed), "
                 "%d resumed; store window %d, room %s; watching %d of %d peers", self.label,
                 self.count, pieces.by[ORIGIN], pieces.by["peer"], pieces.senders,
                 pieces.streamed, pieces.by[RESUMED], store.window, store.room, watched,
                 listed)  # fmt: skip

    def _check(self) -> None:
        """Raise what ends the download: a worker's fatal error, SIGTERM, no progress."""
        if self.errors:
            raise self.errors[0]
        if self._stopping():
            raise Interrupted()
        stalled = time.monotonic() - self.last_progress
        if stalled >= self.downloader.settings.timeout:
            raise TransientError(
                f"giving up on {self.label}: no piece arrived from peers or the store in "
                f"{stalled:.0f}s; partial data is kept, run the fetch again"
            )

    def _stopping(self) -> bool:
        """SIGTERM, or the caller's `cancel`."""
        cancel = self.job.cancel
        return self.downloader.closing or (cancel is not None and cancel.is_set())

    # -- choosing ----------------------------------------------------------------------------

    def _choose(self) -> list[Request]:
        """The requests to start now (`Chooser.choose`)."""
        return self.chooser.choose(self._held())

    def _held(self) -> Bitmap:
        assert self.file is not None
        with self.file.lock:
            return Bitmap.of(self.count, (i for i, d in enumerate(self.file.state.done) if d))

    def pieces(self) -> tuple[int, Bitmap, Bitmap, Bitmap]:
        """(piece size, held, in flight, streamed) for this node's peer server (`client.Live`)."""
        fetching, streaming = self.requests.bitmaps()
        return self.piece_size, self._held(), fetching, streaming

    def streamed(self, piece: int, offset: int, limit: int, at_least: int) -> bytes | None:
        """What of a piece from the store has arrived, for the peer server (`client.Live`)."""
        return self.requests.streamed(piece, offset, limit, at_least)

    def joined(self, peer: str) -> None:
        """A peer asked about the blob (`client.Live`): see `PeerViews.joined`."""
        self.views.joined(peer)

    def _refresh_views(self) -> None:
        self.views.refresh()
        self.events.put(None)

    def _on_response(self, url: str, streamed: bool) -> Callable[[http.client.HTTPResponse], None]:
        """What to do with a piece answer's headers: update the view of `url`; the answer
        spares the peer the next HEAD round unless it starts a streamed piece (it lasts
        as long as the store takes: its advertisement would go stale meanwhile)."""

        def heard(resp: http.client.HTTPResponse) -> None:
            self.local.status = resp.status
            self.views.heard(url, dict(resp.getheaders()), piece_answer=True, streamed=streamed)

        return heard

    # -- one piece ---------------------------------------------------------------------------

    def _fetch(self, request: Request) -> None:
        """Bring one piece from one source (in a worker thread); a failure of the source
        leaves it to be chosen again, from wherever the next choice says; a failure to
        write it (the cache disk's, no source's) ends the download."""
        piece, source = request.piece, request.source
        self.local.status = 0
        kind = "origin" if source == ORIGIN else "peer"
        # a piece the peer streams from the store, not holds (its answer lasts as long)
        streamed = source != ORIGIN and not self.views.holds(source, piece)
        started = time.monotonic()
        try:
            data = self._read_or_fail(piece, source, kind, streamed)
            if data is not None:
                self._land(piece, source, data)
                if source != ORIGIN:
                    self.views.served(source)
                    if streamed:
                        self.requests.passed_on()
                rate = len(data) / max(1e-3, time.monotonic() - started)
                self.store.measured(kind, rate, self.views.alone())
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.requests.finished(piece, source)
            self.events.put(None)

    def _read_or_fail(self, piece: int, source: str, kind: str, streamed: bool) -> bytearray | None:
        """`_read`, or None after a failure of the source (`_failed`)."""
        try:
            return self._read(piece, source, kind, streamed=streamed)
        except (RetryRange, WeightcacheError, OSError) as e:
            self._failed(source, e, piece, streamed)
            return None

    def _read(
        self, piece: int, source: str, kind: str, recheck: bool = False, streamed: bool = False
    ) -> bytearray | None:
        """The piece's bytes from `source` (`streamed`: a peer passing it on from the store);
        None if the download stops (SIGTERM, `cancel`) or the piece landed from elsewhere
        meanwhile (unless `recheck`: the re-check reads pieces held already)."""
        assert self.file is not None
        done = self.file.state.done  # read without its lock: a stale False costs a read
        start, end = self.ranges[piece]
        data = bytearray(end - start)
        view, pos = memoryview(data), 0
        began = time.monotonic()
        judge_at = float("inf")  # when the piece is next judged (`_judge`)
        if source == ORIGIN:
            blob, timeout = self.job.origin, self.downloader.read_timeout
        else:
            blob = self.peers.blob(source, self.sha256, self._on_response(source, streamed))
            timeout = PEER_TIMEOUT
            judge_at = began + PEER_TIMEOUT
        # a re-checked piece is not streamed: it has been written
        streaming = source == ORIGIN and not recheck
        stream = self.requests.streaming(piece, data) if streaming else Stream(data)
        self.observer.request_started(kind)
        try:
            with blob.open_range(start, end, self.size, timeout) as reader:
                while pos < len(data):
                    if self.stop.is_set() or self._stopping() or (done[piece] and not recheck):
                        raise _Dropped()  # through the source's context: it drops the connection
                    if time.monotonic() >= judge_at:
                        judge_at = time.monotonic() + RATE_WINDOW
                        self._judge(piece, source, streamed, pos, len(data), began)
                    n = reader.readinto(view[pos:])
                    if not n:
                        raise RetryRange(f"the body ended {len(data) - pos} bytes short")
                    pos += n
                    stream.received = pos
                    self.rates.note(n)
                    self.observer.received(n, kind)
                    self.last_progress = time.monotonic()
        except _Dropped:
            return None
        finally:
            self.observer.request_finished(kind)
        return data

    def _judge(self, piece: int, source: str, streamed: bool, pos: int, size: int,
               began: float) -> None:  # fmt: skip
        """`pace.judge` a peer's piece, `pos` of `size` bytes since `began`, against
        `_slow_floor`, and, if it is streamed, against the peer's claim of it, which may
        have expired (`Chooser._unclaimed`). Raises TooSlow."""
        elapsed = time.monotonic() - began
        floor = self._slow_floor(streamed)
        expired = streamed and bool(self.chooser.expired.get(source, 0) >> piece & 1)
        judge(pos, size, elapsed, floor, expired)

    def _slow_floor(self, streamed: bool) -> float:
        """The bytes/s below which a piece from a peer is given up (pace.py)."""
        requests = self.requests.requests()
        return slow_floor(self.rates.rate(), requests, self.store.per_request(), streamed)

    def _land(self, piece: int, source: str, data: bytearray) -> None:
        """Write a complete piece at its offset and record it (first source wins). Raises
        NoSpaceError, and TransientError when the cache disk fails otherwise: whoever
        sent the piece, the next one would fail alike (retried, it would be fetched for
        ever: each read moves the stall clock)."""
        assert self.file is not None
        start, end = self.ranges[piece]
        if source == ORIGIN:
            self.store.received(len(data))
        try:
            with self.land_lock:
                if self.file.state.done[piece]:
                    return
                self.file.write(memoryview(data), start)
                self.file.wrote(piece, end)
                self.file.mark_done(piece)
                self.file.save()  # a kill from now on does not lose this piece
                self.requests.landed(piece, source)
            self.file.advance_hash(self._buffer())
        except OSError as e:
            raise TransientError(
                f"cannot write {self.label} to the cache disk ({e}); partial data is kept, "
                "check the disk and run the fetch again"
            ) from e

    def _failed(self, source: str, error: BaseException, piece: int, streamed: bool) -> None:
        refused = source != ORIGIN and getattr(self.local, "status", 0) == 416
        if refused and not self.views.offers(source, piece):
            return  # not held or streamed (any more, or yet): its advertisement updated the view
        # a failure, as is a refusal still offering the piece (else asked again at once)
        if source != ORIGIN:
            how = "streams from the store" if streamed else "holds"
            log.info("peer %s failed a piece of %s it %s (%s); choosing again", source,
                     self.label, how, error)  # fmt: skip
            self.views.shun(source)
            self.store.peer_failed(error.rate if isinstance(error, TooSlow) else 0.0)
            return
        fatal = self.store.failed(error)
        if fatal is not None:
            self.errors.append(fatal)

    def _digest(self) -> str:
        """The sha256 of the complete partial, once the worker hashing it (if one still
        is: the last piece's) has reached its end."""
        assert self.file is not None
        while self.file.digest is None:
            self.file.advance_hash(self._buffer())  # returns at once if a worker hashes
            if self.file.digest is None:
                time.sleep(0.005)
        return self.file.digest

    def _buffer(self) -> bytearray:
        buf: bytearray | None = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = bytearray(HASH_BUFFER)
        return buf
