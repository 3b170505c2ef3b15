"""A revision's fetch (design §4): a hit touches no network; a miss downloads once per node.

Hit: the marker is present, records the requested source, and every file has its recorded
size -> record the access and return. Nothing heavy is imported on this path (boto3 loads
only on a miss).

Miss: take the revision lock, re-check the marker (the waiter of a concurrent fetch finds
it there; a revision of another source is served only if that source's manifest is the
same, else exit 2; a revision damaged since is unmarked and its damaged blobs
quarantined), read and validate the manifest, list sizes, bring the missing blobs
(blobs.py: locks, peers then origin, verification), assemble the revision aside and rename
it into place with its marker inside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from weightcache.cache.index import for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.manifest import MANIFEST_NAME, Manifest, ManifestEntry, parse
from weightcache.cache.store import Cache
from weightcache.config import OriginSettings
from weightcache.errors import SourceError, UsageError, no_space
from weightcache.fetch.blobs import BlobFetch, NodePeers, holder_stalled
from weightcache.progress import human
from weightcache.sourceurl import Source

if TYPE_CHECKING:
    from weightcache.cache.marker import Marker
    from weightcache.fetch.vouched import VouchedFetch
    from weightcache.transfer.backends.s3.client import Origin
    from weightcache.transfer.downloader import RangedDownloader, TransferObserver
    from weightcache.transfer.httpclient import HttpRanges
    from weightcache.transfer.pacing import Background
    from weightcache.transfer.sources import BlobSource, RevisionSource

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class FetchResult:
    """What `fetch` prints: the revision's path, whether it was a hit, what came from the
    origin and how long it took."""

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


def refuse_unless_sha256(layout: Layout, source: Source) -> None:
    """Raise SourceError (exit 3) when the cached revision of `source` holds a file
    verified by anything but a sha256 (`--require-sha256`): fetched without the policy,
    by its store's CRC, MD5 or SHA-1."""
    marker = Cache(layout).read_marker(source.name, source.revision)
    weak = sorted(marker.not_by_sha256().items()) if marker is not None else []
    if weak:
        path, how = weak[0]
        root = layout.revision_dir(source.name, source.revision)
        raise SourceError(
            f"{source.label} in the cache holds {len(weak)} file(s) verified by a checksum "
            f"that catches accidents, not a forged object, e.g. {path!r} verified by {how}, "
            f"and sha256 is required (--require-sha256); publish a {MANIFEST_NAME} at "
            f"{source.url}/ (`weightcache manifest {source.url}/ --write`) and remove the "
            f"cached revision (rm -rf {root}) to fetch it again"
        )


def open_revision(
    source: Source, origin: Callable[[], Origin], http: HttpRanges | None, timeout: float
) -> RevisionSource:
    """The revision at its origin, by the source's scheme (design §4, Revision sources): a
    directory on a mount, an Azure container's prefix (adlfs), a Hub repository, a web
    server's directory, or an s3:// prefix through `origin()` (built only for s3); the Hub,
    http(s) and s3 share the keep-alive connections `http` (new ones if None). Each call
    to the control plane is retried within `timeout` seconds (`--timeout`; s3's by
    `origin()`, built with the same settings)."""
    if source.scheme == "file":
        from weightcache.transfer.backends.file import DirectoryRevision

        return DirectoryRevision(Path("/", source.prefix))
    if source.scheme == "gs":
        from weightcache.transfer.backends.gcs import GcsRevision

        return GcsRevision(source.bucket, source.prefix, timeout)
    if source.scheme in ("az", "abfs"):
        from weightcache.transfer.backends.azure import AzureRevision

        return AzureRevision(source.url, source.bucket, source.prefix, timeout)
    from weightcache.transfer.backends.s3.revision import S3Revision
    from weightcache.transfer.httpclient import HttpRanges

    if source.scheme == "hf":
        from weightcache.transfer.backends.hub.revision import HubRevision

        return HubRevision(http or HttpRanges(), source.prefix, source.revision, timeout)
    if source.scheme in ("http", "https"):
        from weightcache.transfer.backends.http import HttpRevision

        return HttpRevision(http or HttpRanges(), source.url, timeout)

    return S3Revision(http or HttpRanges(), origin(), source.bucket, source.prefix)


def resolve(source: Source, timeout: float) -> Source:
    """The source with a revision that names one content for good: an hf:// branch or tag
    becomes its commit, with one call to the Hub (so such a fetch is never offline, even
    when it is a hit; a commit given in the URL is a hit with no network), and the commit
    is the cache's revision. Others are returned as they are. Raises SourceError,
    TransientError (after `timeout` seconds of trying)."""
    if source.pinned:
        return source
    from weightcache.transfer.backends.hub.revision import HubRevision
    from weightcache.transfer.httpclient import HttpRanges

    commit = HubRevision(HttpRanges(), source.prefix, source.revision, timeout).commit
    log.info("%s is commit %s", source.url, commit)
    return dataclasses.replace(source, revision=commit)


class Fetcher:
    """Brings revisions into one cache directory. Reusable across fetches (the daemon)."""

    def __init__(
        self,
        layout: Layout,
        settings: OriginSettings,
        observer: TransferObserver | None = None,
        downloader: RangedDownloader | None = None,
        reserve: Callable[[int], None] | None = None,
        peers: NodePeers[Any] | None = None,
        cache: Cache | None = None,
        origin: Origin | None = None,
    ) -> None:
        """`reserve(nbytes)` is called before a download to make room under a capacity
        bound (the daemon evicts); it raises NoSpaceError when the room cannot be made.
        With `peers` (the daemon's), blobs come from other nodes that hold them when they
        can, verified exactly as from the origin. `downloader` and `origin` may be shared
        with other Fetchers (one token bucket, one boto3 client); built on first use if not
        given."""
        self.layout = layout
        self.cache = cache or Cache(layout)
        self.index = for_cache(layout)
        self.settings = settings
        self._observer = observer
        self._downloader = downloader
        self._origin = origin
        self._http: HttpRanges | None = None
        # Guards building the downloader, the origin and `_interrupted`: two threads
        # building it at once made two token buckets, one that interrupt() never reached.
        self._build_lock = threading.Lock()
        self._interrupted = False
        self._verify_failed = observer.verify_failed if observer is not None else _nothing
        self._reserve = reserve
        self.blobs = BlobFetch(layout, self.cache, settings.timeout, lambda: self.downloader,
                               self._origin_blob, self._verify_failed, reserve,
                               peers)  # fmt: skip
        self._vouched: VouchedFetch | None = None

    @property
    def downloader(self) -> RangedDownloader:
        """The one downloader of this Fetcher (so one token bucket and one AIMD gate),
        built on first use; concurrent first uses get the same object. Built after
        `interrupt()`, it is interrupted at once."""
        with self._build_lock:
            if self._downloader is None:
                from weightcache.transfer.downloader import RangedDownloader

                self._downloader = RangedDownloader(self.settings, self._observer)
                if self._interrupted:
                    self._downloader.interrupt()
            return self._downloader

    @property
    def vouched(self) -> VouchedFetch:
        """What brings the files of a revision without SHA256SUMS (built on first use: most
        revisions have one, and a cold fetch's first GET should not wait for its import)."""
        from weightcache.fetch.vouched import VouchedFetch

        with self._build_lock:
            if self._vouched is None:
                self._vouched = VouchedFetch(
                    self.layout, self.cache, self.settings.timeout, lambda: self.downloader,
                    lambda s, path: self.revision_source(s).blob(path), self._verify_failed,
                    self._reserve,
                )  # fmt: skip
            return self._vouched

    @property
    def origin(self) -> Origin:
        """The origin store's client (boto3: imported on first use, never on a hit)."""
        with self._build_lock:
            if self._origin is None:
                from weightcache.transfer.backends.s3.client import Origin

                self._origin = Origin(self.settings)
                if self._interrupted:
                    self._origin.interrupt()
            return self._origin

    def revision_source(self, source: Source) -> RevisionSource:
        """The revision at its origin, by the source's scheme (design §4, Revision
        sources): s3://, http(s):// and hf:// over the fetch's shared keep-alive
        connections (which also remember the web servers that ignore Range); a directory,
        GCS and Azure through their own."""
        if source.scheme in ("file", "gs", "az", "abfs"):
            return open_revision(source, lambda: self.origin, None, self.settings.timeout)
        from weightcache.transfer.httpclient import HttpRanges

        with self._build_lock:
            if self._http is None:
                self._http = HttpRanges()
                if self._interrupted:
                    self._http.interrupt()
            http = self._http
        return open_revision(source, lambda: self.origin, http, self.settings.timeout)

    def _origin_blob(self, source: Source, entry: ManifestEntry) -> BlobSource:
        """The blob of `entry` at the origin: an object read by presigned ranged GETs, or
        a file read with preadv."""
        return self.revision_source(source).blob(entry.path)

    def interrupt(self) -> None:
        """Stop running downloads for good (SIGTERM), and those of a downloader still
        being built, and end the requests of the control plane in flight (a listing
        waiting on a silent server); partial files stay resumable."""
        with self._build_lock:
            self._interrupted = True
            downloader, http, origin = self._downloader, self._http, self._origin
        if downloader is not None:
            downloader.interrupt()
        for client in (http, origin):
            if client is not None:
                client.interrupt()

    def fetch(
        self, source: Source, pod_uid: str | None = None, require_sha256: bool = False
    ) -> FetchResult:
        """Make the revision ready; raises a WeightcacheError subclass on failure: a full
        cache disk wherever it shows (a marker, the index, a link) is NoSpaceError, as in
        the CLI, for the daemon's callers too (prefetch, the Pods it fetches for). With
        `require_sha256`, a file verified by anything but a sha256 is SourceError (exit 3),
        before its download, or on a hit (`refuse_unless_sha256`)."""
        try:
            result = self._fetch(source, pod_uid, require_sha256)
            if require_sha256 and result.hit:
                refuse_unless_sha256(self.layout, source)
            return result
        except OSError as e:
            full = no_space(e)
            if full is None:
                raise
            raise full from e

    def _fetch(self, source: Source, pod_uid: str | None, require_sha256: bool) -> FetchResult:
        start = time.monotonic()
        if not source.pinned:  # the caller resolves it: the cache's revision is a commit
            raise UsageError(f"{source.url}: fetch its commit, not a branch or tag")
        self.layout.revision_dir(source.name, source.revision)  # validates, refuses symlinks
        hit = check_hit(self.layout, source, pod_uid)
        if hit is not None:
            return hit
        lock = FileLock(self.layout.revision_lock(source.name, source.revision), source.label)
        if not lock.acquire(give_up=holder_stalled(self.cache, self.settings.timeout)):
            log.warning(
                "the fetch holding %s made no progress for %.0fs; going ahead without its lock",
                source.label,
                self.settings.timeout,
            )
        try:
            hit = self._hit_under_lock(source, start)
            if hit is not None:
                return hit
            manifest, verified, fetched = self.read_contents(source, lock, require_sha256)
            if lock.held:  # spares the blobs we are about to link (Cache.orphans)
                lock.note("".join(f"{e.sha256}\n" for e in manifest.entries))
            fetched += self.blobs.bring(source, manifest)
            from weightcache.cache.marker import Marker  # after the download, not before it

            marker = Marker(
                name=source.name,
                revision=source.revision,
                source=source.url,
                manifest_sha256=manifest.digest,
                files={e.path: (e.sha256, e.size) for e in manifest.entries},
                created=time.time(),
                verified=verified,
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
        revision = self.revision_source(source)
        try:
            data = revision.read_bytes(MANIFEST_NAME)
        except SourceError:  # none: the one made of the sha256 it vouches for, if any
            from weightcache.fetch.vouched import vouched_manifest

            data = vouched_manifest(revision, revision.list_sizes())
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

    def read_contents(
        self, source: Source, lock: FileLock, require_sha256: bool = False
    ) -> tuple[Manifest, dict[str, str], int]:
        """(the manifest with each file's size from the listing, {path: how verified} of the
        files not verified by SHA256SUMS, bytes downloaded to learn it).

        SHA256SUMS and the listing are requested at once (both come before the first data
        GET), and the data plane and state.db are made ready while they are answered; the listing's
        verdict comes first: its error, or no manifest in it. Without one, what the source
        vouches for decides (design §4, Verification without SHA256SUMS): the files whose
        sha256 only their bytes tell are downloaded and published here, under the
        revision's `lock`."""
        revision = self.revision_source(source)
        # The listing first: its answer is awaited first, and the store takes longer over it.
        from weightcache.transfer.pacing import Background

        listing = Background(revision.list_sizes)
        content = Background(lambda: revision.read_bytes(MANIFEST_NAME))
        try:
            self.downloader  # noqa: B018 - built (its modules imported) while the store answers
            # A new cache's state.db too (in a thread of its own): while the store answers and
            # the blobs download, not after them, nor between the manifest and the first GET.
            self.index.create_aside()
            sizes = _checked(listing.result(), revision.url)
            if MANIFEST_NAME in sizes:
                return self._parsed(source, revision, content, sizes), {}, 0
        finally:  # read, or of no more use (a failure, no manifest): neither is retried now
            listing.abandon()
            content.abandon()
        if not sizes:  # not a revision without a manifest: nothing at all, a wrong URL
            raise SourceError(
                f"nothing under {revision.url}/ (no {MANIFEST_NAME}, no files); check the "
                "source URL (bucket, prefix, name and revision) and that it was published"
            )
        from weightcache.fetch.vouched import plan_vouched

        plan = plan_vouched(revision.url, sizes, revision.vouches(), revision.manifest_hint,
                            require_sha256)  # fmt: skip

        def note(hashes: list[str]) -> None:
            if lock.held:  # spares the blobs published so far (Cache.orphans)
                lock.note("".join(f"{h}\n" for h in hashes))

        sha256s, fetched = self.vouched.bring(source, plan.pending, note)
        return plan.manifest(sha256s), plan.verified, fetched

    def _parsed(
        self, source: Source, revision: RevisionSource, content: Background[bytes],
        sizes: dict[str, int],
    ) -> Manifest:  # fmt: skip
        """The SHA256SUMS `content` parsed, validated against the listing `sizes`."""
        where = f"{revision.url}/{MANIFEST_NAME}"
        manifest = parse(content.result(), where)
        missing = [e.path for e in manifest.entries if e.path not in sizes]
        if missing:
            raise SourceError(
                f"{where} lists {len(missing)} file(s) missing under {source.url}/, e.g. "
                f"{missing[0]!r}; upload them or fix the manifest"
            )
        return manifest.with_sizes(sizes, where)

    def _assemble(self, source: Source, marker: Marker, manifest: Manifest) -> str:
        try:
            return str(self.cache.assemble(marker, manifest))
        except FileNotFoundError:
            # A blob was evicted between our check and our link: fetch it again, once.
            log.warning(
                "a blob of %s vanished while assembling it; fetching it again", source.label
            )
            self.blobs.bring(source, manifest)
            return str(self.cache.assemble(marker, manifest))


def _checked(sizes: dict[str, int], url: str) -> dict[str, int]:
    """The listing's sizes, each a byte count: a negative one (a hostile or broken store or
    mirror) would reach the partial file's truncate as EINVAL. Raises SourceError."""
    for path, size in sizes.items():
        if size < 0:
            raise SourceError(
                f"{url} lists {path!r} with a negative size ({size}); the store or mirror "
                "answers garbage: check the source URL and the server behind it"
            )
    return sizes


def _nothing() -> None:
    pass
