"""An s3:// prefix as a revision source (`sources.RevisionSource`): listed, read and vouched
for with the origin's boto3 client (transfer/backends/s3/client.py), its objects read as
`OriginBlob`s with
presigned ranged GETs on the shared connections (transfer/httpclient.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from weightcache.transfer.checksums import Vouch, composite_parts, s3_vouched
from weightcache.transfer.httpclient import HttpRanges
from weightcache.transfer.sources import RangeReader

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from weightcache.transfer.backends.s3.client import Origin


class OriginBlob:
    """The blob as an object of the origin store (a BlobSource), read with presigned GETs.
    The store's 429/503 SlowDown lowers the concurrency (AIMD)."""

    kind = "origin"
    attempts: int | None = None
    throttles = True

    def __init__(self, http: HttpRanges, origin: Origin, bucket: str, key: str) -> None:
        self._http, self._origin = http, origin
        self.bucket, self.key = bucket, key

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def open_range(
        self, start: int, end: int, size: int, timeout: float
    ) -> contextlib.AbstractContextManager[RangeReader]:
        url = self._origin.presign_get(self.bucket, self.key)
        return self._http.get(url, {}, start, end, size, timeout, self.where)


class S3Revision:
    """A revision as an s3:// prefix (a RevisionSource): listed and read with the origin's
    client, its objects read as `OriginBlob`s."""

    def __init__(self, http: HttpRanges, origin: Origin, bucket: str, prefix: str) -> None:
        self._http, self._origin = http, origin
        self.bucket, self.prefix = bucket, prefix
        self._sizes: dict[str, int] | None = None  # the last listing, for vouches()

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def manifest_hint(self) -> str:
        return (
            f"write it with `weightcache manifest {self.url}/ --write` (or publish with "
            "`weightcache publish`) so downloads can be verified"
        )

    def list_sizes(self) -> dict[str, int]:
        self._sizes = self._origin.list_sizes(self.bucket, self.prefix)
        return self._sizes

    def read_bytes(self, relpath: str) -> bytes:
        return self._origin.get_bytes(self.bucket, f"{self.prefix}/{relpath}")

    def blob(self, relpath: str) -> OriginBlob:
        return OriginBlob(self._http, self._origin, self.bucket, f"{self.prefix}/{relpath}")

    def vouches(self) -> dict[str, Vouch]:
        """The checksum of each object (one HeadObject with ChecksumMode=ENABLED per object),
        by `s3_vouched`; a composite one with its part sizes, from GetObjectAttributes or
        else one HeadObject per part (`_headed_parts`); none when the store tells neither.
        Every request runs on one pool of HEAD_CONCURRENCY threads."""
        from concurrent.futures import ThreadPoolExecutor  # not before a fetch's first GET

        sizes = self._sizes if self._sizes is not None else self.list_sizes()
        paths = sorted(sizes)
        with ThreadPoolExecutor(HEAD_CONCURRENCY) as pool:
            found = dict(zip(paths, pool.map(self._vouch, paths), strict=True))
            unsized = {
                path: count
                for path, vouch in found.items()
                if vouch is not None and not vouch.parts
                and (count := composite_parts(vouch.digest)) is not None
            }  # fmt: skip
            for path, parts in self._headed_parts(pool, unsized).items():
                vouch = found[path]
                found[path] = vouch._replace(parts=parts) if vouch and parts else None
        return {p: v for p, v in found.items() if v is not None}

    def _vouch(self, relpath: str) -> Vouch | None:
        """The object's vouch, its type asked of GetObjectAttributes when HeadObject leaves
        it ambiguous; a composite one with the parts GetObjectAttributes lists, or with no
        parts when it does not (for `_headed_parts`)."""
        key = f"{self.prefix}/{relpath}"
        headers = self._origin.head_checksums(self.bucket, key)
        vouch = s3_vouched(headers)
        if vouch is not None and vouch.ambiguous:  # the store's HeadObject omits the type
            kind = self._origin.checksum_type(self.bucket, key)
            vouch = s3_vouched({**headers, "ChecksumType": kind}) if kind else vouch
        count = composite_parts(vouch.digest) if vouch is not None else None
        if vouch is None or count is None:
            return vouch
        parts = self._origin.listed_part_sizes(self.bucket, key, count)
        return vouch._replace(parts=parts) if parts is not None else vouch

    def _headed_parts(
        self, pool: ThreadPoolExecutor, counts: Mapping[str, int]
    ) -> dict[str, tuple[int, ...] | None]:
        """{relpath: its `counts[relpath]` part sizes, or None when the store does not tell
        them}, from one HeadObject with PartNumber per part. The HEADs of every part of
        every object run on `pool` at once (an object of thousands of parts would otherwise
        take thousands of round trips in a row); part 1 of each goes first, so a store that
        refuses PartNumber costs one request per object, not one per part."""

        def size(job: tuple[str, int]) -> int | None:
            return self._origin.part_size(self.bucket, f"{self.prefix}/{job[0]}", job[1])

        firsts = [(path, 1) for path in counts]
        sized = dict(zip(firsts, pool.map(size, firsts), strict=True))
        rest = [
            (path, number)
            for path, count in counts.items()
            if sized[(path, 1)] is not None
            for number in range(2, count + 1)
        ]
        sized.update(zip(rest, pool.map(size, rest), strict=True))
        return {path: _all_parts(sized, path, count) for path, count in counts.items()}


def _all_parts(
    sized: Mapping[tuple[str, int], int | None], path: str, count: int
) -> tuple[int, ...] | None:
    """Parts 1..count of `path` from `sized`, or None if any is unknown."""
    parts = tuple(sized.get((path, number)) for number in range(1, count + 1))
    return None if None in parts else tuple(p for p in parts if p is not None)


#: HeadObject requests in flight while `S3Revision.vouches` asks for every object's checksum.
HEAD_CONCURRENCY = 16
