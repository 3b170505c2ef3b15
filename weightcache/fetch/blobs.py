"""Bringing a revision's missing blobs into the cache: claim, download, verify, publish.

Each blob is claimed by its lock (one download per node; a blob another process is
downloading is waited for, bounded by that process's progress, then re-checked). In the
daemon, each blob is downloaded by the node's swarm (`NodePeers.swarm`, weightcache/swarm/
download.py: pieces from several peers and the origin at once), two blobs at once at
most: the next starts once every piece of the one before is held or asked for, here or by
a peer (all claimed), so that the store and the links do not idle between blobs; without
peers, or for a private partial, by the ranged downloader from the origin alone. Every
blob is verified against the manifest's sha256 before it is published, whatever its
source.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightcache.cache.layout import Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.manifest import MANIFEST_NAME, Manifest, ManifestEntry
from weightcache.cache.store import Cache
from weightcache.errors import IntegrityError, NoSpaceError
from weightcache.progress import human
from weightcache.sourceurl import Source
from weightcache.transfer.sources import BlobSource

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    from weightcache.transfer.downloader import BlobJob, Downloaded, RangedDownloader

log = logging.getLogger(__name__)
#: Blob locks (one fd each) held at once by one fetch.
LOCK_BATCH = 64

ClaimT = TypeVar("ClaimT")
T = TypeVar("T")


class SwarmMembers:
    """The peers seen swarming one revision's blobs while this node brings them. Every node
    brings a revision's blobs in the manifest's order, so those peers come to its later
    blobs too: a node that reaches a blob before them splits the store's copy with them
    (their stripes) instead of taking the whole blob from the store as if it were alone,
    which made its uplink every later peer's only source (design §8, Swarm). Thread-safe:
    the blob pipeline's two downloads share one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: set[str] = set()

    def add(self, urls: Iterable[str]) -> None:
        with self._lock:
            self._urls.update(urls)

    def get(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._urls)


class Swarmed(Protocol):
    """What the swarm did for one blob (weightcache/swarm/download.py, `Outcome`)."""

    @property
    def digest(self) -> str:
        """The partial's sha256, after the re-check from the store if there was one."""

    @property
    def mismatched(self) -> bool:
        """The first assembly did not verify (its pieces were then checked at the store)."""

    @property
    def origin_bytes(self) -> int:
        """Bytes received from the store."""


class NodePeers(Protocol[ClaimT]):
    """What a fetch asks of the node's peers (the daemon's `weightcache.swarm.client.Peers`),
    stated here so that the fetch path imports nothing of the daemon. A claim is opaque to
    the fetch: it is handed back as it came."""

    def claim(self, sha256: str, partial: Path, size: int) -> ClaimT: ...

    def release(self, sha256: str, claim: ClaimT) -> None: ...

    def swarm(
        self,
        sha256: str,
        size: int,
        partial: Path,
        label: str,
        origin: BlobSource,
        downloader: RangedDownloader,
        all_claimed: threading.Event | None = None,
        cancel: threading.Event | None = None,
        members: SwarmMembers | None = None,
    ) -> Swarmed:
        """Download one blob into `partial`; set `all_claimed` once every piece of it is
        held or asked for, here or by a peer; stop (Interrupted) once `cancel` is set;
        `members`: the revision's swarm so far, added to as peers advertise the blob."""

    def mark_bad(self, peer: str, why: str) -> None: ...


@dataclass(frozen=True)
class Wanted:
    """One blob this fetch downloads: its manifest entry and the partial file it goes
    into. A `private` partial is this process's own, because the lock holder of the shared
    one is stalled: it is never served to peers, and nobody else resumes it."""

    entry: ManifestEntry
    partial: Path
    private: bool
    vouched_by: str = MANIFEST_NAME  # what a mismatch names (Manifest.vouched_by)

    @property
    def sha256(self) -> str:
        return self.entry.sha256


@dataclass
class _Swarming:
    """One blob the swarm brings in a worker thread: its claim, and its `all_claimed` (set
    too when the download ends, however)."""

    wanted: Wanted
    claim: Any
    all_claimed: threading.Event
    cancel: threading.Event
    future: Future[Swarmed]


def _raised(s: _Swarming) -> bool:
    """Whether the download has ended with an error."""
    return s.future.done() and s.future.exception() is not None


def holder_stalled(cache: Cache, timeout: float) -> Callable[[], bool]:
    """A give-up test for lock waits: true once no download on this node has made
    progress for `timeout` seconds (a hung daemon or a stopped process holds the lock)."""
    last = (cache.progress_signature(), time.monotonic())

    def stalled() -> bool:
        nonlocal last
        now = cache.progress_signature()
        if now != last[0]:
            last = (now, time.monotonic())
        return time.monotonic() - last[1] >= timeout

    return stalled


def check_space(layout: Layout, need: int, reserve: Callable[[int], None] | None) -> None:
    """Before a download of `need` more bytes: `reserve(need)` (the daemon evicts to make
    room under its capacity bound; it raises NoSpaceError when it cannot), then raise
    NoSpaceError if the cache disk has less free."""
    if reserve is not None:
        reserve(need)
    _, free = layout.disk_space()  # tmp/ is on the cache's filesystem
    if need > free:
        raise NoSpaceError(
            f"the cache disk at {layout.root} has {human(free)} free but the download "
            f"needs {human(need)} more; free space or evict old revisions (weightcache gc)"
        )


@dataclass(frozen=True)
class Check:
    """One file to download from the origin and verify: its job, and what its bytes must
    give. Its mismatches count by `key`, the content whatever its path (a blob's sha256,
    a vouched file's `Vouched.key`)."""

    job: BlobJob
    key: str
    expected: str  # by the job's `check` algorithm, else sha256
    vouched_by: str  # what a mismatch names (Manifest.vouched_by)

    @property
    def algorithm(self) -> str:
        return self.job.check or "sha256"

    def got(self, done: Downloaded) -> str:
        """What the downloaded bytes give, by the algorithm they must match."""
        return (done.checks if self.job.check else done.digests)[self.job.label]


class Strikes:
    """The contents whose bytes from the origin did not verify so far (`Check.key`): a
    file's first mismatch is downloaded once more, its second is exit 4."""

    def __init__(self, source: Source, struck: Iterable[str] = ()) -> None:
        self.source = source
        self._struck = set(struck)

    def strike(self, c: Check, got: str) -> None:
        """Log a mismatch; raise IntegrityError at the second of its content."""
        path = c.job.label
        log.warning("%s mismatch for %s (expected %s, got %s)", c.algorithm, path, c.expected, got)
        if c.key in self._struck:
            raise IntegrityError(
                f"{c.algorithm} mismatch for {path} in {self.source.label}: expected "
                f"{c.expected}, got {got}; the object in {self.source.url}/{path} differs "
                f"from {c.vouched_by} (checked twice)"
            )
        self._struck.add(c.key)


def verify_from_origin(
    downloader: Callable[[], RangedDownloader], todo: list[T], check: Callable[[T], Check],
    publish: Callable[[T, Downloaded], None], reject: Callable[[T, str], None],
    strikes: Strikes,
) -> int:  # fmt: skip
    """Download `todo` from the origin until every file has verified and is published;
    return the bytes from the origin. `check(item)` makes its job each time; a file whose
    bytes do not match is `reject`ed (discard its partial, count the failure, or raise) and
    downloaded once more, and its second mismatch raises IntegrityError (`strikes`)."""
    fetched = 0
    while todo:
        checks = [check(item) for item in todo]
        done = downloader().download([c.job for c in checks])
        fetched += done.received.get("origin", 0)  # this call's, not the daemon's
        bad = []
        for item, c in zip(todo, checks, strict=True):
            got = c.got(done)
            if got == c.expected:
                publish(item, done)
                continue
            reject(item, got)
            strikes.strike(c, got)
            bad.append(item)
        todo = bad
    return fetched


class BlobFetch:
    """Brings blobs into one cache from peers and the origin. Built by `Fetcher`, which
    lends it the process's downloader and its origin (both built on first use)."""

    def __init__(
        self, layout: Layout, cache: Cache, timeout: float,
        downloader: Callable[[], RangedDownloader],
        origin_blob: Callable[[Source, ManifestEntry], BlobSource],
        verify_failed: Callable[[], None],
        reserve: Callable[[int], None] | None = None, peers: NodePeers[Any] | None = None,
    ) -> None:  # fmt: skip
        """`reserve(nbytes)` is called before a download to make room under a capacity
        bound (the daemon evicts); it raises NoSpaceError when the room cannot be made.
        `verify_failed()` is told of every blob whose bytes did not verify."""
        self.layout, self.cache, self.timeout = layout, cache, timeout
        self._downloader, self._origin_blob = downloader, origin_blob
        self._verify_failed, self._reserve, self.peers = verify_failed, reserve, peers

    def bring(self, source: Source, manifest: Manifest) -> int:
        """Ensure every blob of the manifest is in the cache; return bytes downloaded
        from the origin. Raises IntegrityError, NoSpaceError, and the downloader's errors."""
        wanted: dict[str, ManifestEntry] = {}
        for entry in manifest.entries:
            if not self.cache.has_blob(entry.sha256, entry.size):
                wanted.setdefault(entry.sha256, entry)
        if not wanted:
            return 0
        pending = list(wanted.values())
        need = sum(e.size - min(self.cache.partial_bytes(e.sha256), e.size) for e in pending)
        check_space(self.layout, need, self._reserve)
        fetched = 0
        while pending:
            # A batch at a time: each lock held is an fd (50k files must not need 50k).
            batch, pending = pending[:LOCK_BATCH], pending[LOCK_BATCH:]
            locks, theirs = self._lock_batch(batch, wait=not pending)
            try:
                has, by = self.cache.has_blob, manifest.vouched_by
                todo = [
                    Wanted(e, self.layout.partial(e.sha256, lock is None), lock is None, by)
                    for e, lock in locks
                    if not has(e.sha256, e.size)
                ]
                fetched += self._download_verified(source, todo)
            finally:
                for _, held in locks:
                    if held is not None:
                        held.release()
            pending = [e for e in pending + theirs if not self.cache.has_blob(e.sha256, e.size)]
        self.cache.sync_blobs()
        return fetched

    def _lock_batch(
        self, batch: list[ManifestEntry], wait: bool
    ) -> tuple[list[tuple[ManifestEntry, FileLock | None]], list[ManifestEntry]]:
        """(the entries whose blob locks we took, those others hold). With `wait` and none
        taken, wait for one of theirs (bounded by its holder's progress): it comes back with
        its lock, or with None when its holder stalled (then we download it privately)."""
        mine: list[tuple[ManifestEntry, FileLock | None]] = []
        theirs: list[ManifestEntry] = []
        for entry in batch:
            lock = FileLock(self.layout.blob_lock(entry.sha256), entry.path)
            if lock.try_acquire():
                mine.append((entry, lock))
            else:
                theirs.append(entry)
        if not mine and wait:  # others download the rest: wait, then re-check
            entry = theirs.pop(0)
            lock = FileLock(self.layout.blob_lock(entry.sha256), entry.path)
            stalled = holder_stalled(self.cache, self.timeout)
            mine.append((entry, lock if lock.acquire(stalled) else None))
        return mine, theirs

    def _download_verified(self, source: Source, todo: list[Wanted]) -> int:
        """Download, verify and publish; return the bytes that came from the origin.

        With peers, each blob is claimed (so that peers may fetch its pieces from us while
        we download it) and downloaded by the swarm, from peers and the origin at once
        (design §8, Swarm); a private partial, or a blob the swarm could not verify even
        after checking its peers' pieces at the origin, comes from the origin alone.
        """
        if self.peers is None:
            return self._from_origin(source, todo)
        # a private partial is never served, so never swarmed
        fetched, failed = self._from_swarm(source, [w for w in todo if not w.private])
        rest = [w for w in todo if w.private] + failed
        # every byte of a failed one came from the origin: one strike
        return fetched + self._from_origin(source, rest, [w.sha256 for w in failed])

    def _from_swarm(self, source: Source, todo: list[Wanted]) -> tuple[int, list[Wanted]]:
        """(bytes from the origin, the blobs not published) of `todo` brought by the swarm,
        two at once at most: each starts once every piece of the one before is held or
        asked for, here or by a peer (or it ended), and after the one before that has ended
        (design §8, Swarm). Each blob is claimed (so that peers may fetch its pieces from
        us while we download it) until it is published or dropped. On an error, the other
        download is stopped first, and no blob is started after one that failed."""
        # imported here: a fetch without peers reaches its first GET without it (design §4)
        from concurrent.futures import ThreadPoolExecutor

        fetched, failed, members = 0, list[Wanted](), SwarmMembers()
        running: collections.deque[_Swarming] = collections.deque()
        with ThreadPoolExecutor(2, thread_name_prefix="blob") as pool:
            try:
                for w in todo:
                    if len(running) == 2:
                        fetched += self._finish(running.popleft(), failed)
                    if running:
                        running[-1].all_claimed.wait()
                        if _raised(running[-1]):  # its error now: nothing more is started
                            self._finish(running.pop(), failed)
                    running.append(self._begin(pool, source, w, members))
                while running:
                    fetched += self._finish(running.popleft(), failed)
            finally:
                self._stop(running)
        return fetched, failed

    def _begin(
        self, pool: ThreadPoolExecutor, source: Source, w: Wanted, members: SwarmMembers
    ) -> _Swarming:
        """Claim the blob and start its swarm download in `pool`."""
        assert self.peers is not None
        peers = self.peers
        origin, downloader = self._origin_blob(source, w.entry), self._downloader()
        all_claimed, cancel = threading.Event(), threading.Event()
        claim = peers.claim(w.sha256, w.partial, w.entry.size)
        try:
            future = pool.submit(peers.swarm, w.sha256, w.entry.size, w.partial, w.entry.path,
                                 origin, downloader, all_claimed=all_claimed, cancel=cancel,
                                 members=members)  # fmt: skip
        except BaseException:
            peers.release(w.sha256, claim)
            raise
        # once the download has ended, if not before: its outcome is then readable (`_raised`)
        future.add_done_callback(lambda _: all_claimed.set())
        return _Swarming(w, claim, all_claimed, cancel, future)

    def _finish(self, s: _Swarming, failed: list[Wanted]) -> int:
        """Wait for one swarm download, publish its blob if it verifies (else add it to
        `failed`), release its claim; return the bytes it took from the origin."""
        assert self.peers is not None
        try:
            done = s.future.result()
            if not self._verified(s.wanted, done):
                failed.append(s.wanted)
            return done.origin_bytes
        finally:
            self.peers.release(s.wanted.sha256, s.claim)

    def _stop(self, running: collections.deque[_Swarming]) -> None:
        """Stop the downloads still running (after an error), wait for them, release their
        claims; their partials are kept for resume."""
        assert self.peers is not None
        for s in running:
            s.cancel.set()
        for s in running:
            with contextlib.suppress(Exception):
                s.future.result()
            self.peers.release(s.wanted.sha256, s.claim)

    def _verified(self, w: Wanted, done: Swarmed) -> bool:
        """Publish a blob the swarm brought if it verifies; True if published. A first
        assembly that does not verify counts as a failed verification, and so does the
        blob after its peers' pieces were replaced by the origin's, if it still does not."""
        if done.mismatched:
            self._verify_failed()
        if done.digest == w.sha256:
            self.cache.publish_blob(w.partial, w.sha256)
            return True
        self.cache.discard_partial(w.partial)
        self._verify_failed()
        log.warning("sha256 mismatch for %s from the origin (expected %s, got %s); "
                    "downloading it once more", w.entry.path, w.sha256, done.digest)  # fmt: skip
        return False

    def _from_origin(self, source: Source, todo: list[Wanted], struck: Iterable[str] = ()) -> int:
        """Download from the origin, verify, publish (`verify_from_origin`; `struck`: the
        blobs whose origin bytes already did not verify once)."""
        from weightcache.transfer.downloader import BlobJob

        def check(w: Wanted) -> Check:
            job = BlobJob(self._origin_blob(source, w.entry), w.entry.size, w.partial, w.entry.path)
            return Check(job, w.sha256, w.sha256, w.vouched_by)

        def reject(w: Wanted, got: str) -> None:
            self.cache.discard_partial(w.partial)
            self._verify_failed()

        def publish(w: Wanted, done: Downloaded) -> None:
            self.cache.publish_blob(w.partial, w.sha256)

        strikes = Strikes(source, struck)
        return verify_from_origin(self._downloader, todo, check, publish, reject, strikes)
