"""Blob sources: where the downloader reads a blob's bytes from (design §4, Blob sources).

A `BlobSource` is one blob at one place: the object in the origin store, the same blob
on a peer, a file on a mounted volume. The downloader (downloader.py) asks it for byte ranges
and knows nothing else of it: it writes what a `RangeReader` yields at its offsets, hashes
it, and applies one retry policy to every source, told by the source only how patient to
be (`attempts`) and whether its refusals mean "slow down" (`throttles`).

A range read is a `RangeReader` that fills a caller's buffer with at most one blocking read
per call, so that the downloader's stall clock and stop switch are checked between reads
whatever the source: a socket `recv_into` for HTTP sources (httpclient.py), a `preadv` for
a local file (`FileBlob`, below).

One level up, a `RevisionSource` is a revision's directory at its origin, whatever the
scheme: it lists the files' sizes, reads the manifest, and hands out each file as a
`BlobSource` (design §4, Revision sources). `DirectoryRevision` (below) is a directory on
a mounted filesystem (a PVC, NFS); `S3Revision` (backends/s3/revision.py) is an s3:// prefix;
`HubRevision` (backends/hub/revision.py) a Hugging Face Hub repository at a revision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from weightcache.transfer.checksums import Vouch


#: Seconds one read from a source may block before the range is cut and retried (an HTTP
#: source's socket timeout, capped by --timeout). A peer serving a partial that does not grow
#: cuts its response sooner (weightcache/swarm/server.py PARTIAL_WAIT), so that its
#: receiver sees a cut body and moves on rather than a timeout.
READ_TIMEOUT = 30.0
#: The most of a small answer read into memory (a SHA256SUMS, a listing page, an error):
#: a SHA256SUMS of 500,000 files is ~50 MiB. A larger one (or an endless body) from a
#: broken or hostile server or volume is refused, not read until the process is killed.
SMALL_BODY_MAX = 64 << 20


class RetryRange(Exception):
    """A retryable failure of one range read (reset, 5xx, truncated body, timeout, a
    trickle); `throttle` if the source asked to slow down. The downloader resumes the
    range at the byte where it broke."""

    def __init__(self, reason: str, throttle: bool = False) -> None:
        super().__init__(reason)
        self.throttle = throttle


class RangeReader(Protocol):
    def readinto(self, buf: memoryview) -> int:
        """Read the range's next bytes into `buf` with at most one blocking read; return
        how many (0: the source has no more, which is a truncation if the range is not
        done). Raises RetryRange, or a WeightcacheError for a failure retrying cannot fix."""


class BlobSource(Protocol):
    """One blob at one place, readable by byte ranges. Thread-safe: the downloader reads
    several ranges of it at once, from several threads."""

    @property
    def kind(self) -> str:
        """The metrics label of the bytes it sends: "origin" or "peer"."""

    @property
    def where(self) -> str:
        """Where the blob is, for messages: "s3://bucket/key", a peer's URL, a path."""

    @property
    def attempts(self) -> int | None:
        """Failures without progress tolerated for one part before the download fails,
        so that a caller can fall back to another source; None: `--max-attempts`."""

    @property
    def throttles(self) -> bool:
        """Whether a refusal to serve (HTTP 429/503) means "slow down": it then halves the
        download's concurrency (AIMD). A peer's 503 only means "busy, ask someone else"."""

    def open_range(
        self, start: int, end: int, size: int, timeout: float
    ) -> contextlib.AbstractContextManager[RangeReader]:
        """Read bytes [start, end) of the blob, expected to be `size` bytes long; each
        read blocks at most `timeout` seconds. The context releases what the read holds
        (a connection is kept for reuse only after a clean, complete read). Raises
        RetryRange; IntegrityError if the blob's size is no longer `size`; SourceError if
        it is gone or access is denied."""


def whole_only(source: BlobSource) -> bool:
    """Whether the source can only send its blob whole (an optional `whole_only` attribute,
    False if absent: a web server that ignores Range): one reader must read it, in order."""
    return bool(getattr(source, "whole_only", False))


def part_size_for(source: BlobSource, size: int, part_size: int) -> int:
    """The part size to read a `size`-byte blob of `source` in: `part_size`, or the whole
    blob for a `whole_only` source, so that no part of it is sent twice."""
    return max(size, 1) if whole_only(source) else part_size


class RevisionSource(Protocol):
    """A revision's files at their origin. Not a hit-path object: built on a miss."""

    @property
    def url(self) -> str:
        """The revision's URL, as markers record it: s3://bucket/prefix, file:///path."""

    @property
    def manifest_hint(self) -> str:
        """What to do when the revision has no SHA256SUMS (the end of an exit-3 message)."""

    def list_sizes(self) -> dict[str, int]:
        """{relative POSIX path: size} of every file of the revision. Raises SourceError
        (missing, denied), TransientError."""

    def read_bytes(self, relpath: str) -> bytes:
        """A small file of the revision (its SHA256SUMS). Raises SourceError if there is
        none."""

    def blob(self, relpath: str) -> BlobSource:
        """The file `relpath` (a validated manifest path) as a BlobSource."""

    def vouches(self) -> Mapping[str, tuple[str, str] | Vouch]:
        """{relpath: (algorithm, lowercase hex digest)} of what the source itself vouches for
        each file's content; files it vouches nothing for are absent. Algorithms:
        checksums.ALGORITHMS ("sha256", "crc32c", "md5", "crc64nvme", "git-sha1" (a git
        blob id), ...), or a composite one given as a `Vouch` with its part sizes. Called
        only when the revision has no SHA256SUMS (design §4, Verification without
        SHA256SUMS)."""
