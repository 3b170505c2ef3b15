"""The fetch algorithm (design §4): a hit touches no network; a miss downloads once per node.

Hit: the marker is present, records the requested source, and every file has its recorded
size -> record the access and return. Nothing heavy is imported on this path (boto3 loads
only on a miss).

Miss: take the revision lock, re-check the marker (the waiter of a concurrent fetch finds
it there; a revision of another source is served only if that source's manifest is the
same, else exit 2; a revision damaged since is unmarked and its damaged blobs
quarantined), read and validate the manifest, list sizes, link blobs already on the node,
download the rest (each under its blob lock; in the daemon, from peers first, see
weightcache/node/peers.py), verify, publish each blob, assemble the revision aside and rename it
into place with its marker inside.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightcache.cache.index import for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.manifest import MANIFEST_NAME, Manifest, ManifestEntry, parse
from weightcache.cache.store import Cache, FileLock, Marker
from weightcache.config import OriginSettings, PeerSettings, Source
from weightcache.errors import (
    IntegrityError,
    Interrupted,
    NoSpaceError,
    SourceError,
    UsageError,
    WeightcacheError,
)
from weightcache.progress import human

if TYPE_CHECKING:
    from weightcache.transfer.ranged import RangedDownloader, TransferObserver
    from weightcache.transfer.s3 import Origin

log = logging.getLogger(__name__)
#: Peers tried for one blob before the origin: a second chance when the first dies.
PEER_TRIES = 2
#: Failed requests to one peer without progress before the blob goes to the next source.
PEER_ATTEMPTS = 3
#: Blob locks (one fd each) held at once by one fetch.
LOCK_BATCH = 64


ClaimT = TypeVar("ClaimT")


class PeerHolding(Protocol):
    @property
    def peer(self) -> str:
        """The base URL of a peer that can serve the blob."""


class PeerSource(Protocol[ClaimT]):
    """What a fetch asks of the node's peers (the daemon's `weightcache.node.peers.Peers`),
    stated here so that the fetch path imports nothing of the daemon. A claim is opaque to
    the fetch: it is handed back as it came."""

    @property
    def settings(self) -> PeerSettings: ...

    def claim(self, sha256: str, partial: Path, size: int) -> ClaimT: ...

    def release(self, sha256: str, claim: ClaimT) -> None: ...

    def sources(self, sha256: str, size: int, own: ClaimT | None) -> Sequence[PeerHolding]: ...

    def mark_bad(self, peer: str, why: str) -> None: ...


@dataclass(frozen=True)
class FetchResult:
    path: str
    hit: bool
    bytes_from_origin: int
    seconds: float

    @property
    def throughput(self) -> float:
        """Bytes per second from the origin (0 for a hit)."""
        return self.bytes_from_origin / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "throughput": round(self.throughput, 1)}


def check_hit(layout: Layout, source: Source, pod_uid: str | None = None) -> FetchResult | None:
    """The hit path: no network, no heavy import. None on a miss, and for a revision
    fetched from another source (a revision directory belongs to its source, design §3;
    `Fetcher.fetch` settles that case).

    The Pod's lease is committed before the marker is checked, so a path returned here
    cannot be evicted any more (Index.remove_unless_protected).
    """
    start = time.monotonic()
    index = for_cache(layout)  # it looked at the mount's flags (one statvfs) for us
    if pod_uid and not index.read_only:
        index.lease(source.name, source.revision, pod_uid)
    marker = Cache(layout).ready(source.name, source.revision)
    if marker is None or marker.source != source.url:
        return None
    if not index.read_only:  # the engine's read-only mount: serve it, record nothing
        index.record_access(source.name, source.revision)
    path = str(layout.revision_dir(source.name, source.revision))
    return FetchResult(path, True, 0, time.monotonic() - start)


class Fetcher:
    """Brings revisions into one cache directory. Reusable across fetches (the daemon)."""

    def __init__(
        self,
        layout: Layout,
        settings: OriginSettings,
        observer: TransferObserver | None = None,
        downloader: RangedDownloader | None = None,
        reserve: Callable[[int], None] | None = None,
        peers: PeerSource[Any] | None = None,
        cache: Cache | None = None,
    ) -> None:
        """`reserve(nbytes)` is called before a download to make room under a capacity
        bound (the daemon evicts); it raises NoSpaceError when the room cannot be made.
        With `peers` (the daemon's), blobs come from other nodes that hold them when they
        can, verified exactly as from the origin."""
        self.layout = layout
        self.cache = cache or Cache(layout)
        self.index = for_cache(layout)
        self.settings = settings
        self._observer = observer
        self._downloader = downloader
        self._reserve = reserve
        self.peers = peers
        # Guards building the downloader and `_interrupted`: two threads
        # building it at once made two token buckets, one that interrupt() never reached.
        self._downloader_lock = threading.Lock()
        self._interrupted = False

    @property
    def downloader(self) -> RangedDownloader:
        """The one downloader of this Fetcher (so one token bucket and one AIMD gate),
        built on first use; concurrent first uses get the same object. Built after
        `interrupt()`, it is interrupted at once."""
        with self._downloader_lock:
            if self._downloader is None:
                from weightcache.transfer.ranged import RangedDownloader
                from weightcache.transfer.s3 import Origin

                self._downloader = RangedDownloader(
                    Origin(self.settings), self.settings, self._observer
                )
                if self._interrupted:
                    self._downloader.interrupt()
            return self._downloader

    @property
    def origin(self) -> Origin:
        return self.downloader.store

    def interrupt(self) -> None:
        """Stop running downloads for good (SIGTERM), and those of a downloader still
        being built; partial files stay resumable."""
        with self._downloader_lock:
            self._interrupted = True
            downloader = self._downloader
        if downloader is not None:
            downloader.interrupt()

    def fetch(self, source: Source, pod_uid: str | None = None) -> FetchResult:
        """Make the revision ready; raises a WeightcacheError subclass on failure."""
        start = time.monotonic()
        self.layout.revision_dir(source.name, source.revision)  # validates, refuses symlinks
        hit = check_hit(self.layout, source, pod_uid)
        if hit is not None:
            return hit
        lock = FileLock(self.layout.revision_lock(source.name, source.revision), source.label)
        if not lock.acquire(give_up=self._holder_stalled()):
            log.warning(
                "the fetch holding %s made no progress for %.0fs; going ahead without its lock",
                source.label,
                self.settings.timeout,
            )
        try:
            hit = self._hit_under_lock(source, start)
            if hit is not None:
                return hit
            manifest = self.read_manifest(source)
            if lock.held:  # spares the blobs we are about to link (Cache.orphans)
                lock.note("".join(f"{e.sha256}\n" for e in manifest.entries))
            fetched = self._bring_blobs(source, manifest)
            marker = Marker(
                name=source.name,
                revision=source.revision,
                source=source.url,
                manifest_sha256=manifest.digest,
                files={e.path: (e.sha256, e.size) for e in manifest.entries},
                created=time.time(),
            )
            path = self._assemble(source, marker, manifest)
        finally:
            lock.release()
        # The lease, if any, was committed by the first check_hit, before the revision
        # existed: an evictor can never remove it between our rename and our print.
        self.index.record_access(
            source.name, source.revision, source=source.url, size=manifest.total_size
        )
        seconds = time.monotonic() - start
        log.info(
            "ready %s at %s: %s from origin in %.1fs", source.label, path, human(fetched), seconds
        )
        return FetchResult(str(path), False, fetched, seconds)

    def _hit_under_lock(self, source: Source, start: float) -> FetchResult | None:
        """The revision as it is once we hold its lock: a hit if a concurrent fetch
        finished it; a hit of another source only if that source's manifest is the same
        (UsageError otherwise); None (a miss) if it is absent, or damaged since it was
        marked (then it is unmarked and its damaged blobs quarantined, design §3 invariant 7)."""
        marker = self.cache.read_marker(source.name, source.revision)
        if marker is None or (marker.name, marker.revision) != (source.name, source.revision):
            return None
        if marker.source != source.url:
            self._check_same_content(source, marker)
        damaged = self.cache.repair(marker)
        if damaged:
            log.warning(
                "%s: %d file(s) no longer of their size (e.g. %s); unmarked it and "
                "downloading them again", source.label, len(damaged), damaged[0]
            )  # fmt: skip
            return None
        self.index.record_access(source.name, source.revision)  # leased by fetch()'s check_hit
        path = str(self.layout.revision_dir(source.name, source.revision))
        return FetchResult(path, True, 0, time.monotonic() - start)

    def _check_same_content(self, source: Source, marker: Marker) -> None:
        """Prove with one small GET that `source` has the manifest the revision was
        fetched with from `marker.source`; raise UsageError naming both otherwise."""
        data = self.origin.get_bytes(source.bucket, source.key(MANIFEST_NAME))
        if hashlib.sha256(data).hexdigest() == marker.manifest_sha256:
            log.info("%s was fetched from %s; %s has the same %s, serving it", source.label,
                     marker.source, source.url, MANIFEST_NAME)  # fmt: skip
            return
        root = self.layout.revision_dir(source.name, source.revision)
        raise UsageError(
            f"{source.label} in the cache was fetched from {marker.source}, and {source.url} "
            f"has a different {MANIFEST_NAME}; one name/revision holds one content: fetch it "
            f"under another --name or --revision, or remove the cached one first "
            f"(rm -rf {root})"
        )

    def read_manifest(self, source: Source) -> Manifest:
        """SHA256SUMS of the revision, validated, with each file's size from the listing."""
        where = f"s3://{source.bucket}/{source.key(MANIFEST_NAME)}"
        sizes = self.origin.list_sizes(source.bucket, source.prefix)
        if MANIFEST_NAME not in sizes:
            raise SourceError(
                f"no {MANIFEST_NAME} at {where}; write it with `weightcache manifest {source.url}/"
                " --write` (or publish with `weightcache publish`) so downloads can be verified"
            )
        manifest = parse(self.origin.get_bytes(source.bucket, source.key(MANIFEST_NAME)), where)
        missing = [e.path for e in manifest.entries if e.path not in sizes]
        if missing:
            raise SourceError(
                f"{where} lists {len(missing)} file(s) missing under {source.url}/, e.g. "
                f"{missing[0]!r}; upload them or fix the manifest"
            )
        return manifest.with_sizes(sizes, where)

    # -- blobs ---------------------------------------------------------------------------------

    def _bring_blobs(self, source: Source, manifest: Manifest) -> int:
        """Ensure every blob of the manifest is in the store; return bytes downloaded.

        Blobs are claimed by their locks: ours are downloaded together; for those another
        process is downloading we wait (bounded by its progress) and re-check.
        """
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
            mine: list[tuple[ManifestEntry, FileLock | None]] = []
            theirs: list[ManifestEntry] = []
            for entry in batch:
                lock = FileLock(self.layout.blob_lock(entry.sha256), entry.path)
                if lock.try_acquire():
                    mine.append((entry, lock))
                else:
                    theirs.append(entry)
            if not mine and not pending:  # others download the rest: wait, then re-check
                entry = theirs.pop(0)
                lock = FileLock(self.layout.blob_lock(entry.sha256), entry.path)
                mine.append((entry, lock if lock.acquire(self._holder_stalled()) else None))
            try:
                has = self.cache.has_blob
                todo = [(e, lock is None) for e, lock in mine if not has(e.sha256, e.size)]
                fetched += self._download_verified(source, todo)
            finally:
                for _, held in mine:
                    if held is not None:
                        held.release()
            pending = [e for e in pending + theirs if not self.cache.has_blob(e.sha256, e.size)]
        self.cache.sync_blobs()
        return fetched

    def _holder_stalled(self) -> Callable[[], bool]:
        """A give-up test for lock waits: true once no download on this node has made
        progress for `--timeout` (a hung daemon or a stopped process holds the lock)."""
        last = (self.cache.progress_signature(), time.monotonic())

        def stalled() -> bool:
            nonlocal last
            now = self.cache.progress_signature()
            if now != last[0]:
                last = (now, time.monotonic())
            return time.monotonic() - last[1] >= self.settings.timeout

        return stalled

    def _download_verified(self, source: Source, todo: list[tuple[ManifestEntry, bool]]) -> int:
        """Download, verify and publish; return the bytes that came from the origin.

        Each entry comes with `private`: download into a partial of this process's own,
        because the lock holder of the shared partial is stalled. With peers, each blob is
        first claimed (so that peers may stream it from us while we download it), then
        asked of peers, then whatever they lacked, failed or served wrong comes from the
        origin.
        """
        if self.peers is None:
            return self._from_origin(source, todo, {})
        claims = {
            e.sha256: self.peers.claim(e.sha256, self.layout.partial(e.sha256), e.size)
            for e, private in todo
            if not private  # a private partial is never served
        }
        try:
            rest, tainted = self._from_peers(source, todo, claims)
            return self._from_origin(source, rest, tainted)
        finally:
            for sha256, claim in claims.items():
                self.peers.release(sha256, claim)

    def _from_peers(
        self, source: Source, todo: list[tuple[ManifestEntry, bool]], claims: dict[str, object]
    ) -> tuple[list[tuple[ManifestEntry, bool]], dict[str, list[str]]]:
        """Bring each blob from peers, one after the other; return what is left for the
        origin, and for each of those the peers whose bytes may remain in its partial."""
        rest: list[tuple[ManifestEntry, bool]] = []
        tainted: dict[str, list[str]] = {}
        for entry, private in todo:
            published, served = self._from_peer(source, entry, private, claims.get(entry.sha256))
            if not published:
                rest.append((entry, private))
                if served:
                    tainted[entry.sha256] = served
        return rest, tainted

    def _from_peer(
        self, source: Source, entry: ManifestEntry, private: bool, claim: object | None
    ) -> tuple[bool, list[str]]:
        """Try the best peers for one blob: (published, peers that failed mid-way).

        A peer whose bytes do not verify is marked bad and the blob goes to the origin; a
        peer that refuses, dies or stalls leaves its bytes in the partial for the next
        source to resume from (the final sha256 check covers them).
        """
        from weightcache.transfer.ranged import BlobJob

        assert self.peers is not None
        partial = self.layout.partial(entry.sha256, private)
        failed: list[str] = []
        for holding in self.peers.sources(entry.sha256, entry.size, claim)[:PEER_TRIES]:
            job = BlobJob(source.bucket, source.key(entry.path), entry.size, entry.sha256,
                          partial, entry.path, peer=holding.peer, token=self.peers.settings.token,
                          attempts=PEER_ATTEMPTS)  # fmt: skip
            try:
                got = self.downloader.download([job]).digests[entry.path]
            except (Interrupted, NoSpaceError):
                raise
            except WeightcacheError as e:
                log.warning("peer %s failed to serve %s (%s); trying the next source",
                            holding.peer, entry.path, e)  # fmt: skip
                failed.append(holding.peer)
                continue
            if got == entry.sha256:
                self.cache.publish_blob(partial, entry.sha256)
                return True, []
            self.cache.discard_partial(partial)
            self.downloader.observer.verify_failed()
            self.peers.mark_bad(holding.peer, f"it served {entry.path} with sha256 {got}, "
                                f"expected {entry.sha256}")  # fmt: skip
            return False, []
        return False, failed

    def _from_origin(
        self,
        source: Source,
        todo: list[tuple[ManifestEntry, bool]],
        tainted: dict[str, list[str]],
    ) -> int:
        """Download from the origin; a mismatch is downloaded once more, a second one of
        the same file is exit 4. A mismatch of a partial that held bytes from a failed peer
        (`tainted`) is blamed on that peer and does not count."""
        from weightcache.transfer.ranged import BlobJob

        fetched = 0
        strikes: dict[str, int] = {}
        while todo:
            jobs = [
                BlobJob(source.bucket, source.key(e.path), e.size, e.sha256,
                        self.layout.partial(e.sha256, private), e.path)
                for e, private in todo
            ]  # fmt: skip
            done = self.downloader.download(jobs)
            fetched += done.received.get("origin", 0)  # this call's, not the daemon's
            actual = done.digests
            bad = []
            for job, (e, private) in zip(jobs, todo, strict=True):
                got = actual[job.label]
                if got == e.sha256:
                    self.cache.publish_blob(job.partial, e.sha256)
                    continue
                self.cache.discard_partial(job.partial)
                self.downloader.observer.verify_failed()
                log.warning("sha256 mismatch for %s (expected %s, got %s)", e.path, e.sha256, got)
                peers = tainted.pop(e.sha256, [])
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
                bad.append((e, private))
            todo = bad
        return fetched

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

    def _assemble(self, source: Source, marker: Marker, manifest: Manifest) -> str:
        try:
            return str(self.cache.assemble(marker, manifest))
        except FileNotFoundError:
            # A blob was evicted between our check and our link: fetch it again, once.
            log.warning(
                "a blob of %s vanished while assembling it; fetching it again", source.label
            )
            self._bring_blobs(source, manifest)
            return str(self.cache.assemble(marker, manifest))
