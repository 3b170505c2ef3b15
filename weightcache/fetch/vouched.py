"""A revision without SHA256SUMS, verified by the checksums its source vouches for (design
§4, Verification without SHA256SUMS).

Deciding (`plan_vouched`, pure): every file a fetch would take (`select_files`, the same
selection as `weightcache manifest`) must be vouched for by its source with an algorithm
computable here, else the fetch is exit 3 naming the command that writes a manifest. Files
vouched for by sha256 (not ambiguously) are ordinary manifest entries. The others are
`Vouched`: their sha256, the blob store's key, is known only once their bytes have landed.
A composite checksum (of an S3 multipart upload) comes with its part sizes, and is
computed part by part.

Doing (`VouchedFetch.bring`): each such file is downloaded like any blob (parallel ranged
reads, resumable) into a partial named by its vouched checksum, with that checksum computed
beside the sha256 as the prefix grows; a mismatch is downloaded once more and is exit 4 the
second time (nothing published, the partial discarded), but a mismatch of an ambiguous
checksum (`Vouch.ambiguous`) is exit 3 at once; a match is published under the computed
sha256, so the same content from any scheme, or from a SHA256SUMS, is stored once.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.cache.layout import Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestEntry,
    render,
    select_files,
)
from weightcache.cache.marker import BY_SHA256
from weightcache.cache.store import Cache
from weightcache.errors import SourceError
from weightcache.fetch.blobs import (
    LOCK_BATCH,
    Check,
    Strikes,
    check_space,
    holder_stalled,
    verify_from_origin,
)
from weightcache.sourceurl import Source
from weightcache.transfer.checksums import COMPOSITE_SUFFIX, Vouch, available, composite_parts
from weightcache.transfer.sources import BlobSource

if TYPE_CHECKING:
    from weightcache.transfer.downloader import Downloaded, RangedDownloader
    from weightcache.transfer.sources import RevisionSource

log = logging.getLogger(__name__)
#: Hex digits of each algorithm's digest: anything else from a source is not a checksum.
_HEX_DIGITS = {"sha256": 64, "md5": 32, "crc32c": 8, "crc64nvme": 16, "git-sha1": 40,
               "crc32": 8, "sha1": 40}  # fmt: skip
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class Vouched:
    """A file whose content its source vouches for with a checksum other than sha256."""

    path: str
    size: int
    algorithm: str
    digest: str  # lowercase hex; a composite one "<hex>-<parts>"
    parts: tuple[int, ...] = ()  # a composite one's part sizes
    ambiguous: bool = False  # maybe a composite checksum instead (Vouch.ambiguous)

    @property
    def key(self) -> str:
        """Names its partial and its lock: one download per content, whatever its path."""
        return f"{self.algorithm}-{self.digest}-{self.size}"


@dataclass(frozen=True)
class VouchedPlan:
    """What a fetch of a revision without SHA256SUMS brings, and how each file is verified."""

    known: tuple[ManifestEntry, ...]  # vouched for by sha256: ordinary manifest entries
    pending: tuple[Vouched, ...]  # sha256 known once downloaded
    verified: dict[str, str]  # path -> "<scheme>:<algorithm>"

    def manifest(self, sha256s: Mapping[str, str]) -> Manifest:
        """The revision's manifest once `sha256s` ({path: sha256}) covers `pending`; its
        digest is that of the SHA256SUMS `weightcache manifest` would write for it."""
        entries = [*self.known, *(ManifestEntry(v.path, sha256s[v.path], v.size)
                                  for v in self.pending)]  # fmt: skip
        entries.sort(key=lambda e: e.path)
        digest = hashlib.sha256(render([(e.sha256, e.path) for e in entries])).hexdigest()
        # with_sizes: two files vouched for by one sha256 at two sizes are exit 4
        manifest = Manifest(tuple(entries), digest, "the sha256 its store recorded for it")
        return manifest.with_sizes({e.path: e.size for e in entries})


def plan_vouched(
    url: str, sizes: Mapping[str, int], vouches: Mapping[str, tuple[str, str] | Vouch], hint: str,
    require_sha256: bool = False,
) -> VouchedPlan:  # fmt: skip
    """The plan for the revision at `url` without SHA256SUMS, from its listing `sizes` and
    what its source vouches for. Raises SourceError (exit 3) naming a file vouched for by
    nothing usable (and `hint`, what to do), or with `require_sha256`, by anything but a
    sha256 (`BY_SHA256`); or when the listing holds no file."""
    scheme = url.partition("://")[0]
    if not any(_is_checksum(Vouch(*v), None) for v in vouches.values()):
        raise SourceError(f"no {MANIFEST_NAME} at {url}/{MANIFEST_NAME}; {hint}")
    files = select_files(dict(sizes), url).files
    known: list[ManifestEntry] = []
    pending: list[Vouched] = []
    unvouched: list[str] = []
    for path, size in files.items():
        vouch = Vouch(*vouches.get(path, ("", "")))
        if not _is_checksum(vouch, size):
            unvouched.append(path)
        elif vouch.algorithm == "sha256" and not vouch.ambiguous:
            known.append(ManifestEntry(path, vouch.digest, size))
        else:
            pending.append(Vouched(path, size, *vouch))
    if unvouched:
        raise SourceError(
            f"no {MANIFEST_NAME} at {url}/{MANIFEST_NAME}, and the store vouches for the "
            f"content of {len(unvouched)} of its {len(files)} file(s) with no checksum "
            f"weightcache can verify (e.g. {unvouched[0]!r}); {hint}"
        )
    weak = [v for v in pending if v.algorithm not in BY_SHA256]
    if require_sha256 and weak:
        raise SourceError(
            f"no {MANIFEST_NAME} at {url}/{MANIFEST_NAME}, and its store vouches for "
            f"{len(weak)} file(s), e.g. {weak[0].path!r} with {weak[0].algorithm} only: a "
            "checksum that catches accidents, not a forged object, and sha256 is required "
            f"(--require-sha256); {hint}"
        )
    verified = {e.path: f"{scheme}:sha256" for e in known}
    verified.update({v.path: f"{scheme}:{v.algorithm}" for v in pending})
    return VouchedPlan(tuple(known), tuple(pending), verified)


def _is_checksum(vouch: Vouch, size: int | None) -> bool:
    """A digest of an algorithm computable here, of that algorithm's length; a composite
    one with as many parts as its digest says, their sizes adding up to `size` (if given)."""
    algorithm, digest, parts, _ = vouch
    if algorithm.endswith(COMPOSITE_SUFFIX):
        if composite_parts(digest) != len(parts) or min(parts) < 0:
            return False
        if size is not None and sum(parts) != size:
            return False
        algorithm, digest = algorithm.removesuffix(COMPOSITE_SUFFIX), digest.rpartition("-")[0]
    elif parts:
        return False
    if len(digest) != _HEX_DIGITS.get(algorithm, -1) or not _HEX.fullmatch(digest):
        return False
    return available(vouch.algorithm)


class VouchedFetch:
    """Brings the files of a `VouchedPlan` whose sha256 is unknown into one cache."""

    def __init__(
        self, layout: Layout, cache: Cache, timeout: float,
        downloader: Callable[[], RangedDownloader],
        origin_blob: Callable[[Source, str], BlobSource],
        verify_failed: Callable[[], None], reserve: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.layout, self.cache, self.timeout = layout, cache, timeout
        self._downloader, self._origin_blob = downloader, origin_blob
        self._verify_failed, self._reserve = verify_failed, reserve

    def bring(
        self, source: Source, pending: tuple[Vouched, ...], note: Callable[[list[str]], None]
    ) -> tuple[dict[str, str], int]:
        """({path: sha256}, bytes from the origin) for every pending file, each published
        as a blob; `note(sha256s)` is told of the blobs published so far (the revision lock
        spares them from orphan collection). Raises IntegrityError, NoSpaceError, SourceError
        and the downloader's errors."""
        by_key: dict[str, list[Vouched]] = {}
        for v in pending:
            by_key.setdefault(v.key, []).append(v)
        firsts = [same[0] for same in by_key.values()]
        need = sum(v.size - _allocated(self.layout.vouched_partial(v.key), v.size) for v in firsts)
        check_space(self.layout, need, self._reserve)
        sha256s: dict[str, str] = {}
        fetched = 0
        for i in range(0, len(firsts), LOCK_BATCH):  # each lock held is an fd
            got, n = self._bring_batch(source, firsts[i : i + LOCK_BATCH])
            fetched += n
            for key, sha256 in got.items():
                sha256s.update({v.path: sha256 for v in by_key[key]})
            note(sorted(set(sha256s.values())))
        self.cache.sync_blobs()
        return sha256s, fetched

    def _bring_batch(self, source: Source, batch: list[Vouched]) -> tuple[dict[str, str], int]:
        """({key: sha256}, bytes) for one batch, holding each one's lock (a lock whose
        holder stalls is given up on: then the download goes to a private partial)."""
        locks: list[FileLock] = []
        try:
            private: dict[str, bool] = {}
            for v in batch:
                lock = FileLock(self.layout.blob_lock(v.key), v.path)
                held = lock.acquire(give_up=holder_stalled(self.cache, self.timeout))
                private[v.key] = not held
                if held:
                    locks.append(lock)
            return self._download_verified(source, batch, private)
        finally:
            for lock in locks:
                lock.release()

    def _download_verified(
        self, source: Source, todo: list[Vouched], private: dict[str, bool]
    ) -> tuple[dict[str, str], int]:
        """({key: sha256}, bytes from the origin) of `todo`, each verified by the checksum
        its store vouches for (`verify_from_origin`); a mismatch of an ambiguous checksum
        is exit 3 at once."""
        from weightcache.transfer.downloader import BlobJob

        sha256s: dict[str, str] = {}
        partials = {v.key: self.layout.vouched_partial(v.key, private[v.key]) for v in todo}

        def check(v: Vouched) -> Check:
            job = BlobJob(self._origin_blob(source, v.path), v.size, partials[v.key], v.path,
                          check=v.algorithm, check_parts=v.parts)  # fmt: skip
            return Check(job, v.key, v.digest, "the checksum its store recorded for it")

        def reject(v: Vouched, got: str) -> None:
            self.cache.discard_partial(partials[v.key])
            if v.ambiguous:  # downloading it again would prove nothing more
                raise _ambiguous(source, v, got)
            self._verify_failed()

        def publish(v: Vouched, done: Downloaded) -> None:
            sha256s[v.key] = self._publish(partials[v.key], done.digests[v.path], v.size)

        strikes = Strikes(source)
        fetched = verify_from_origin(self._downloader, todo, check, publish, reject, strikes)
        return sha256s, fetched

    def _publish(self, partial: Path, sha256: str, size: int) -> str:
        if self.cache.has_blob(sha256, size):  # the same content came another way
            self.cache.discard_partial(partial)
        else:
            self.cache.publish_blob(partial, sha256)
        return sha256


def _ambiguous(source: Source, v: Vouched, got: str) -> SourceError:
    return SourceError(
        f"ambiguous checksum for {v.path!r} in {source.label}: its store gives a {v.algorithm} "
        f"of {v.digest} for this multipart object without saying whether it is of the whole "
        f"object (the bytes downloaded give {got}) or of its parts' checksums, nor does "
        f"GetObjectAttributes; write a {MANIFEST_NAME} (`weightcache manifest "
        f"{source.url}/ --write`) so the download can be verified"
    )


def _allocated(partial: Path, size: int) -> int:
    """Bytes already reserved on disk by a partial (0 if none)."""
    try:
        return min(partial.stat().st_blocks * 512, size)
    except FileNotFoundError:
        return 0


def vouched_manifest(revision: RevisionSource, sizes: dict[str, int]) -> bytes:
    """The SHA256SUMS `weightcache manifest` would write for a revision without one whose
    source vouches for the sha256 of every file (a Hub revision all in LFS), known without
    reading a byte: it tells whether another source's revision has the same content.
    Raises SourceError when some file's sha256 only its bytes would tell."""
    plan = plan_vouched(revision.url, sizes, revision.vouches(), revision.manifest_hint)
    if plan.pending:
        raise SourceError(
            f"{revision.url} vouches for no sha256 of {len(plan.pending)} file(s), e.g. "
            f"{plan.pending[0].path!r}; the content is known only once downloaded: add a "
            f"{MANIFEST_NAME} ({revision.manifest_hint})"
        )
    return render([(e.sha256, e.path) for e in plan.known])
