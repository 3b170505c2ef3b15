"""Bringing a revision's missing blobs into the cache: claim, download, verify, publish.

Each blob is claimed by its lock (one download per node; a blob another process is
downloading is waited for, bounded by that process's progress, then re-checked). In the
daemon, each blob is first asked of the peers holding it, each of them a `BlobSource`
(weightcache/node/peers.py), then whatever they lacked, failed or served wrong comes from
the origin's object. Every blob is verified against the manifest's sha256 before it is
published, whatever its source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightcache.cache.layout import Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.manifest import MANIFEST_NAME, Manifest, ManifestEntry
from weightcache.cache.store import Cache
from weightcache.config import Source
from weightcache.errors import IntegrityError, Interrupted, NoSpaceError, WeightcacheError
from weightcache.progress import human
from weightcache.transfer.sources import BlobSource

if TYPE_CHECKING:
    from weightcache.transfer.ranged import RangedDownloader

log = logging.getLogger(__name__)
#: Peers tried for one blob before the origin: a second chance when the first dies.
PEER_TRIES = 2
#: Blob locks (one fd each) held at once by one fetch.
LOCK_BATCH = 64

ClaimT = TypeVar("ClaimT")


class PeerBlob(BlobSource, Protocol):
    """A blob on a peer: a BlobSource that names the peer, to avoid it when it lies."""

    @property
    def peer(self) -> str:
        """The peer's base URL."""


class NodePeers(Protocol[ClaimT]):
    """What a fetch asks of the node's peers (the daemon's `weightcache.node.peers.Peers`),
    stated here so that the fetch path imports nothing of the daemon. A claim is opaque to
    the fetch: it is handed back as it came."""

    def claim(self, sha256: str, partial: Path, size: int) -> ClaimT: ...

    def release(self, sha256: str, claim: ClaimT) -> None: ...

    def sources(self, sha256: str, size: int, own: ClaimT | None) -> Sequence[PeerBlob]: ...

    def mark_bad(self, peer: str, why: str) -> None: ...


@dataclass(frozen=True)
class Wanted:
    """One blob this fetch downloads: its manifest entry and the partial file it goes
    into. A `private` partial is this process's own, because the lock holder of the shared
    one is stalled: it is never served to peers, and nobody else resumes it."""

    entry: ManifestEntry
    partial: Path
    private: bool

    @property
    def sha256(self) -> str:
        return self.entry.sha256


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
        self._check_space(list(wanted.values()))
        fetched = 0
        pending = list(wanted.values())
        while pending:
            # A batch at a time: each lock held is an fd (50k files must not need 50k).
            batch, pending = pending[:LOCK_BATCH], pending[LOCK_BATCH:]
            locks, theirs = self._lock_batch(batch, wait=not pending)
            try:
                has = self.cache.has_blob
                todo = [
                    Wanted(e, self.layout.partial(e.sha256, lock is None), lock is None)
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

        With peers, each blob is first claimed (so that peers may stream it from us while
        we download it), then asked of peers, then whatever they lacked, failed or served
        wrong comes from the origin.
        """
        if self.peers is None:
            return self._from_origin(source, todo, {})
        claims = {
            w.sha256: self.peers.claim(w.sha256, w.partial, w.entry.size)
            for w in todo
            if not w.private  # a private partial is never served
        }
        try:
            rest: list[Wanted] = []
            tainted: dict[str, list[str]] = {}
            for w in todo:
                published, served = self._from_peers(w, claims.get(w.sha256))
                if not published:
                    rest.append(w)
                    if served:
                        tainted[w.sha256] = served
            return self._from_origin(source, rest, tainted)
        finally:
            for sha256, claim in claims.items():
                self.peers.release(sha256, claim)

    def _from_peers(self, w: Wanted, claim: object | None) -> tuple[bool, list[str]]:
        """Try the best peers for one blob: (published, peers that failed mid-way).

        A peer whose bytes do not verify is marked bad and the blob goes to the origin; a
        peer that refuses, dies or stalls leaves its bytes in the partial for the next
        source to resume from (the final sha256 check covers them).
        """
        from weightcache.transfer.ranged import BlobJob

        assert self.peers is not None
        failed: list[str] = []
        for blob in self.peers.sources(w.sha256, w.entry.size, claim)[:PEER_TRIES]:
            job = BlobJob(blob, w.entry.size, w.partial, w.entry.path)
            try:
                got = self._downloader().download([job]).digests[w.entry.path]
            except (Interrupted, NoSpaceError):
                raise
            except WeightcacheError as e:
                log.warning("peer %s failed to serve %s (%s); trying the next source",
                            blob.peer, w.entry.path, e)  # fmt: skip
                failed.append(blob.peer)
                continue
            if got == w.sha256:
                self.cache.publish_blob(w.partial, w.sha256)
                return True, []
            self.cache.discard_partial(w.partial)
            self._verify_failed()
            self.peers.mark_bad(blob.peer, f"it served {w.entry.path} with sha256 {got}, "
                                f"expected {w.sha256}")  # fmt: skip
            return False, []
        return False, failed

    def _from_origin(
        self, source: Source, todo: list[Wanted], tainted: dict[str, list[str]]
    ) -> int:
        """Download from the origin; a mismatch is downloaded once more, a second one of
        the same file is exit 4. A mismatch of a partial that held bytes from a failed peer
        (`tainted`) is blamed on that peer and does not count."""
        from weightcache.transfer.ranged import BlobJob

        fetched = 0
        strikes: dict[str, int] = {}
        while todo:
            jobs = [
                BlobJob(self._origin_blob(source, w.entry), w.entry.size, w.partial, w.entry.path)
                for w in todo
            ]
            done = self._downloader().download(jobs)
            fetched += done.received.get("origin", 0)  # this call's, not the daemon's
            bad = []
            for w in todo:
                got = done.digests[w.entry.path]
                if got == w.sha256:
                    self.cache.publish_blob(w.partial, w.sha256)
                    continue
                self._reject(source, w, got, tainted.pop(w.sha256, []), strikes)
                bad.append(w)
            todo = bad
        return fetched

    def _reject(
        self, source: Source, w: Wanted, got: str, peers: list[str], strikes: dict[str, int]
    ) -> None:
        """Drop a blob whose bytes did not verify; raise IntegrityError at its second
        strike (a strike blamed on peers whose bytes were in its partial does not count)."""
        e = w.entry
        self.cache.discard_partial(w.partial)
        self._verify_failed()
        log.warning("sha256 mismatch for %s (expected %s, got %s)", e.path, e.sha256, got)
        for peer in peers:
            assert self.peers is not None
            self.peers.mark_bad(peer, f"its part of {e.path} did not verify")
        strikes[e.sha256] = strikes.get(e.sha256, 0) + (0 if peers else 1)
        if strikes[e.sha256] >= 2:
            raise IntegrityError(
                f"sha256 mismatch for {e.path} in {source.label}: expected {e.sha256}, "
                f"got {got}; the object in {source.url}/{e.path} differs from "
                f"{MANIFEST_NAME} (checked twice)"
            )

    def _check_space(self, entries: list[ManifestEntry]) -> None:
        need = sum(e.size - min(self.cache.partial_bytes(e.sha256), e.size) for e in entries)
        if self._reserve is not None:
            self._reserve(need)
        _, free = self.layout.disk_space()  # tmp/ is on the cache's filesystem
        if need > free:
            raise NoSpaceError(
                f"the cache disk at {self.layout.root} has {human(free)} free but the "
                f"download needs {human(need)} more; free space or evict old revisions "
                "(weightcache gc)"
            )
