"""`weightcache manifest`: the SHA256SUMS of the files already under a source prefix.

An existing bucket (filled by `aws s3 sync`, say) adopts weightcache with one command:
every object under the prefix is hashed where it is, through parallel ranged reads, with no
local copy, and the manifest is printed or, with --write, put next to the files in one PUT
(a reader sees the old manifest or the new one, never a part). It lists exactly what a
fetch of that prefix would download: every object under it, recursively, by its path
relative to the prefix, except the manifest itself and the paths a fetch refuses (design
§2.1, `cache.manifest.check_path`), which are skipped with one warning each.

Schemes: a prefix is reached through the fetch's revision source, so every scheme a fetch
reads can be hashed (s3://, gs://, file:// and plain paths, hf://, az://, http(s):// whose
SHA256SUMS names the files, since a web server has no listing); --write puts to s3:// and
gs:// only, and says so before hashing anything.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Literal, Protocol

from weightcache.cache.manifest import MANIFEST_NAME, Selection, render, select_files
from weightcache.config import OriginSettings
from weightcache.errors import UsageError
from weightcache.progress import Progress, human
from weightcache.sourceurl import Source
from weightcache.transfer.downloader import TransferObserver

if TYPE_CHECKING:
    from weightcache.transfer.backends.s3.client import Origin

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
        self.revision = open_revision(source, self._client, None, settings.timeout)

    def _client(self) -> Origin:
        from weightcache.transfer.backends.s3.client import (
            Origin,  # boto3 only if the source is s3://
        )

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

    def check_writable(self) -> None:
        """Raise UsageError unless `write` can put to this prefix (s3:// and gs:// only)."""
        if self.source.scheme == "gs":
            return
        if self.source.scheme == "hf":
            raise UsageError(
                f"--write puts SHA256SUMS to gs:// and s3:// only; for {self.url}, run without "
                f"--write, save the output as {MANIFEST_NAME} and commit it to the repository "
                f"with `hf upload {self.source.prefix} {MANIFEST_NAME}`"
            )
        if self.source.scheme != "s3":
            raise UsageError(
                f"--write puts SHA256SUMS to gs:// and s3:// only; for {self.url}, run without "
                f"--write and save the output as {self.url.removeprefix('file://')}/{MANIFEST_NAME}"
            )

    def write(self, path: str, data: bytes) -> None:
        self.check_writable()
        if self.source.scheme == "gs":
            from weightcache.transfer.backends.gcs import GcsRevision

            assert isinstance(self.revision, GcsRevision)
            self.revision.put_bytes(path, data)
            return
        self._client().put_bytes(data, self.source.bucket, self.source.key(path))


def open_prefix(url: str, settings: OriginSettings, write: bool = False) -> PrefixStore:
    """The PrefixStore for a source URL (any scheme a fetch reads). Raises UsageError,
    also, with `write`, before any work if the prefix cannot be written."""
    prefix = RevisionPrefix(Source.parse(url), settings)
    if write:
        prefix.check_writable()
    return prefix


# -- deciding (pure) ----------------------------------------------------------------------


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
    log.info(
        "hashed %d files (%s) under %s in %.1fs (%s/s)",
        len(digests),
        human(total),
        prefix.url,
        seconds,
        human(total / seconds),
    )
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
    prefix = open_prefix(url, settings, write)
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
