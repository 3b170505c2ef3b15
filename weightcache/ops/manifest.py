"""`weightcache manifest`: the SHA256SUMS of the files already under a source prefix.

An existing bucket (filled by `aws s3 sync`, say) adopts weightcache with one command:
every object under the prefix is hashed where it is, through parallel ranged reads, with no
local copy, and the manifest is printed or, with --write, put next to the files in one PUT
(a reader sees the old manifest or the new one, never a part). It lists exactly what a
fetch of that prefix would download: every object under it, recursively, by its path
relative to the prefix, except the manifest itself and the paths a fetch refuses (design
§2.1, `cache.manifest.check_path`), which are skipped with one warning each.

Schemes: a prefix is reached through the fetch's revision source, so every scheme a fetch
reads can be hashed (s3://, gs://, file:// and plain paths); --write puts to s3:// and
gs:// only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Literal, Protocol

from weightcache.cache.manifest import MANIFEST_NAME, check_path, render
from weightcache.config import OriginSettings, Source
from weightcache.errors import SourceError, UsageError
from weightcache.progress import Progress, human
from weightcache.transfer.ranged import TransferObserver

if TYPE_CHECKING:
    from weightcache.transfer.s3 import Origin

log = logging.getLogger(__name__)


class PrefixStore(Protocol):
    """The files under one source prefix, wherever they live (one class per scheme)."""

    @property
    def url(self) -> str:
        """The prefix as the user wrote it, without a trailing slash, for messages."""
        ...

    def list_files(self) -> dict[str, int]:
        """{path relative to the prefix: size} of every object under it, recursively."""
        ...

    def hash_files(self, files: dict[str, int], observer: TransferObserver) -> dict[str, str]:
        """{path: sha256 hex} of the listed files, read in place."""
        ...

    def read(self, path: str) -> bytes:
        """One small file's content."""
        ...

    def write(self, path: str, data: bytes) -> None:
        """Put one small file, atomically for readers (a single PUT)."""
        ...


class RevisionPrefix:
    """A prefix reached through the fetch's own revision source (design §4, Revision
    sources): listed and read as a fetch reads it, its files hashed through their blob
    sources by `transfer.hashing.ObjectHasher` (parallel ranged reads, bounded memory).
    Writing is an S3 PUT; a directory's SHA256SUMS is written with sha256sum."""

    def __init__(self, source: Source, settings: OriginSettings) -> None:
        from weightcache.fetch.revision import open_revision

        self.source = source
        self.settings = settings
        self._origin: Origin | None = None
        self.revision = open_revision(source, self._client, None)

    def _client(self) -> Origin:
        from weightcache.transfer.s3 import Origin  # boto3 only if the source is s3://

        if self._origin is None:
            self._origin = Origin(self.settings)
        return self._origin

    @property
    def url(self) -> str:
        return self.source.url

    def list_files(self) -> dict[str, int]:
        return self.revision.list_sizes()

    def hash_files(self, files: dict[str, int], observer: TransferObserver) -> dict[str, str]:
        from weightcache.transfer.hashing import ObjectHasher, StoredObject

        objects = [StoredObject(self.revision.blob(p), s, p) for p, s in files.items()]
        return ObjectHasher(self.settings, observer).hash_objects(objects)

    def read(self, path: str) -> bytes:
        return self.revision.read_bytes(path)

    def write(self, path: str, data: bytes) -> None:
        if self.source.scheme == "gs":
            from weightcache.transfer.gcs import GcsRevision

            assert isinstance(self.revision, GcsRevision)
            self.revision.put_bytes(path, data)
            return
        if self.source.scheme != "s3":
            raise UsageError(
                f"--write puts SHA256SUMS to gs:// and s3:// only; for {self.url}, run without "
                f"--write and save the output as {self.url.removeprefix('file://')}/{MANIFEST_NAME}"
            )
        self._client().put_bytes(data, self.source.bucket, self.source.key(path))


def open_prefix(url: str, settings: OriginSettings) -> PrefixStore:
    """The PrefixStore for a source URL (any scheme a fetch reads). Raises UsageError."""
    return RevisionPrefix(Source.parse(url), settings)


# -- deciding (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """What the manifest of a prefix lists, and what it leaves out and why."""

    files: dict[str, int]  # relative path -> size
    skipped: tuple[tuple[str, str], ...]  # (relative path, why a fetch would refuse it)
    existing: bool  # the prefix already holds a SHA256SUMS


def select_files(listing: dict[str, int], url: str) -> Selection:
    """The files a fetch of `url` would download if its manifest listed everything.

    Raises SourceError when nothing is left (an empty or mistyped prefix), or when one
    path is both a file and a folder (a fetch refuses such a manifest; no choice is safe).
    """
    files: dict[str, int] = {}
    skipped: list[tuple[str, str]] = []
    for path, size in sorted(listing.items()):
        if path == MANIFEST_NAME:
            continue
        if path.endswith("/") and size == 0:
            skipped.append((path, "a folder marker, not a file"))
            continue
        try:
            files[check_path(path, url)] = size
        except SourceError as e:
            skipped.append((path, str(e).removeprefix(f"{url} ")))
    if not files:
        raise SourceError(
            f"no files under {url}/ to list in a {MANIFEST_NAME}; check the source URL "
            "(bucket and prefix)"
        )
    _check_no_file_dir_clash(files, url)
    return Selection(files, tuple(skipped), MANIFEST_NAME in listing)


def _check_no_file_dir_clash(files: dict[str, int], url: str) -> None:
    for path in files:
        for parent in PurePosixPath(path).parents:
            if str(parent) in files:
                raise SourceError(
                    f"{url}/{parent} is a file and also the folder of {url}/{path}; a "
                    "cache directory cannot hold both: rename or remove one of them"
                )


WriteAction = Literal["create", "replace", "same"]


def decide_write(new: bytes, old: bytes | None, force: bool, where: str) -> WriteAction:
    """What --write does with an existing manifest. Raises UsageError (exit 2) when one
    that differs would be replaced without --force."""
    if old is None:
        return "create"
    if old == new:
        return "same"
    if not force:
        raise UsageError(
            f"{where} exists and differs from the files' hashes; left it unchanged: compare "
            "it with the output of `weightcache manifest` without --write, and add --force "
            "to replace it"
        )
    return "replace"


# -- doing ----------------------------------------------------------------------------------


def make_manifest(prefix: PrefixStore, observer: TransferObserver) -> tuple[bytes, Selection]:
    """Hash every file of the prefix; return the SHA256SUMS bytes and what they list."""
    selection = select_files(prefix.list_files(), prefix.url)
    for path, why in selection.skipped:
        log.warning("skipping %s/%s: %s", prefix.url, path, why)
    start = time.monotonic()
    digests = prefix.hash_files(selection.files, observer)
    total = sum(selection.files.values())
    seconds = max(time.monotonic() - start, 1e-6)
    log.info("hashed %d files (%s) under %s in %.1fs (%s/s)", len(digests), human(total),
             prefix.url, seconds, human(total / seconds))  # fmt: skip
    return render([(h, p) for p, h in digests.items()]), selection


def write_manifest(prefix: PrefixStore, data: bytes, selection: Selection, force: bool) -> str:
    """Put `data` as the prefix's SHA256SUMS as `decide_write` says; return one line
    saying what was done."""
    where = f"{prefix.url}/{MANIFEST_NAME}"
    old = prefix.read(MANIFEST_NAME) if selection.existing else None
    action = decide_write(data, old, force, where)
    count = len(selection.files)
    if action == "same":
        return f"{where} already lists these {count} files with these hashes; left it unchanged"
    prefix.write(MANIFEST_NAME, data)
    verb = "replaced" if action == "replace" else "wrote"
    return f"{verb} {where} ({count} files); `weightcache fetch {prefix.url}` verifies them now"


def manifest(url: str, settings: OriginSettings, write: bool, force: bool) -> bytes:
    """The `manifest` command: hash, then write if asked; returns the manifest bytes."""
    if force and not write:
        raise UsageError("--force only applies with --write: add --write, or drop --force")
    prefix = open_prefix(url, settings)
    progress = Progress(prefix.url, 0)
    try:
        data, selection = make_manifest(prefix, progress)
    finally:
        progress.close()
    if write:
        log.info("%s", write_manifest(prefix, data, selection, force))
    elif selection.existing and prefix.read(MANIFEST_NAME) != data:
        log.warning("%s/%s differs from these hashes", prefix.url, MANIFEST_NAME)
    return data
