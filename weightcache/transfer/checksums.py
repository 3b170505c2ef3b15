"""The checksums a source vouches for a file's content with, computed while the bytes land.

A revision without SHA256SUMS can still be verified when its store recorded a checksum of
each whole file (design §4, Verification without SHA256SUMS): S3's full-object sha256, sha1,
crc64nvme, crc32c and crc32, GCS's crc32c, Azure's Content-MD5, the Hub's LFS sha256 and git
blob ids; or a checksum of its parts' checksums whose part sizes the store tells: S3's
COMPOSITE checksums of multipart uploads ("<algorithm>-composite", `Composite`). Ranged
GETs carry no whole-object checksum, so the downloader computes the vouched one itself
beside the sha256 that keys the blob (partial.py). Digests are lowercase hex; a CRC is the
hex of its big-endian bytes, as the stores' base64 values encode it.

crc32c and crc64nvme need a native library (a pure-Python CRC runs at a few MB/s, which
would make the hash the bottleneck of a fetch): both come from `awscrt` (a dependency;
botocore's crt extra), crc32c also from `google-crc32c` (gcsfs depends on it). Measured on
this project's 2-core CI machine, 256 KiB reads: awscrt crc32c 7694 MiB/s, crc64nvme 7329
MiB/s, google-crc32c 4780 MiB/s, sha256 1050 MiB/s, a pure-Python crc32c 2.6 MiB/s; zlib's
crc32 1879 MiB/s and sha1 965 MiB/s (hashlib) need nothing more. Without a library an
algorithm is not `available()`, and a file vouched for only by it counts as not vouched for.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import re
import zlib
from collections.abc import Mapping
from typing import NamedTuple, Protocol

#: The algorithms a RevisionSource may vouch with (`RevisionSource.vouches`), and each
#: one's "<algorithm>-composite" (`Composite`) but git-sha1's and crc64nvme's (S3 defines
#: crc64nvme for full objects only).
ALGORITHMS = ("sha256", "crc32c", "md5", "crc64nvme", "git-sha1", "crc32", "sha1")
COMPOSITE_SUFFIX = "-composite"
_COMPOSITE_DIGEST = re.compile(r"([0-9a-f]+)-([1-9][0-9]*)")


class Vouch(NamedTuple):
    """What a source vouches for a file's content with: `digest` by `algorithm`, lowercase
    hex; a composite one is "<hex>-<number of parts>" with `parts`, each part's size. An
    `ambiguous` one may be either a full-object or a composite checksum (its store did not
    say which): a mismatch then proves nothing about the object."""

    algorithm: str
    digest: str
    parts: tuple[int, ...] = ()
    ambiguous: bool = False


class Hasher(Protocol):
    def update(self, data: memoryview) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc:
    """A running CRC from a library function `fn(data, previous) -> int`."""

    def __init__(self, fn: _CrcFn, bits: int) -> None:
        self._fn, self._bits, self._value = fn, bits, 0

    def update(self, data: memoryview) -> None:
        self._value = self._fn(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:0{self._bits // 4}x}"


class _CrcFn(Protocol):
    def __call__(self, data: memoryview, previous: int, /) -> int: ...


def _crc32c_fn() -> _CrcFn | None:
    if importlib.util.find_spec("awscrt") is not None:
        from awscrt import checksums

        return lambda data, previous: int(checksums.crc32c(data, previous))
    if importlib.util.find_spec("google_crc32c") is not None:
        import google_crc32c

        # It takes read-only buffers only: one copy per read (still ~4.8 GB/s measured).
        return lambda data, previous: int(google_crc32c.extend(previous, bytes(data)))
    return None


def _crc64nvme_fn() -> _CrcFn | None:
    if importlib.util.find_spec("awscrt") is None:
        return None
    from awscrt import checksums

    return lambda data, previous: int(checksums.crc64nvme(data, previous))


def available(algorithm: str) -> bool:
    """Whether `algorithm` can be computed here (at a speed that keeps up with a fetch)."""
    if algorithm.endswith(COMPOSITE_SUFFIX):
        base = algorithm.removesuffix(COMPOSITE_SUFFIX)
        return base not in ("git-sha1", "crc64nvme") and available(base)
    if algorithm == "crc32c":
        return _crc32c_fn() is not None
    if algorithm == "crc64nvme":
        return _crc64nvme_fn() is not None
    return algorithm in ALGORITHMS


def new_hasher(algorithm: str, size: int, parts: tuple[int, ...] = ()) -> Hasher:
    """A running digest of a `size`-byte file by `algorithm` (one of ALGORITHMS or a
    composite one with its `parts`, and `available`); ValueError otherwise. git-sha1 is a
    git blob id: sha1 over the header b"blob <size>\\0" and the content."""
    if algorithm.endswith(COMPOSITE_SUFFIX) and available(algorithm):
        return Composite(algorithm.removesuffix(COMPOSITE_SUFFIX), parts)
    if algorithm in ("sha256", "md5", "sha1"):
        return hashlib.new(algorithm)
    if algorithm == "git-sha1":
        h = hashlib.sha1(usedforsecurity=False)
        h.update(b"blob %d\0" % size)
        return h
    fn = _crc32c_fn() if algorithm == "crc32c" else None
    fn = _crc64nvme_fn() if algorithm == "crc64nvme" else fn
    fn = _crc32 if algorithm == "crc32" else fn
    if fn is None:
        raise ValueError(f"cannot compute checksum {algorithm!r} here")
    return _Crc(fn, 64 if algorithm == "crc64nvme" else 32)


def _crc32(data: memoryview, previous: int) -> int:
    return zlib.crc32(data, previous)  # native: 1879 MiB/s, beside sha256's 1072


class Composite:
    """An S3 COMPOSITE checksum: `algorithm` of the concatenated binary `algorithm` digests
    of consecutive parts of the given sizes, as "<hex>-<number of parts>"."""

    def __init__(self, algorithm: str, parts: tuple[int, ...]) -> None:
        if not parts or min(parts) < 0:
            raise ValueError(f"a composite {algorithm} needs the part sizes, got {parts!r}")
        self._algorithm, self._sizes = algorithm, parts
        self._digests: list[bytes] = []
        self._left = parts[0]  # bytes still to come in the current part
        self._part = new_hasher(algorithm, parts[0])

    def update(self, data: memoryview) -> None:
        while len(data) > self._left and len(self._digests) + 1 < len(self._sizes):
            self._part.update(data[: self._left])
            data = data[self._left :]
            self._next_part()
        self._part.update(data)
        self._left -= len(data)  # below 0 only past the last part: then no digest matches

    def _next_part(self) -> None:
        self._digests.append(bytes.fromhex(self._part.hexdigest()))
        size = self._sizes[len(self._digests)]
        self._part, self._left = new_hasher(self._algorithm, size), size

    def hexdigest(self) -> str:
        while len(self._digests) + 1 < len(self._sizes):  # a file shorter than its parts
            self._next_part()
        whole = b"".join([*self._digests, bytes.fromhex(self._part.hexdigest())])
        outer = new_hasher(self._algorithm, len(whole))
        outer.update(memoryview(whole))
        return f"{outer.hexdigest()}-{len(self._sizes)}"


def composite_parts(digest: str) -> int | None:
    """The number of parts of a composite digest "<hex>-<parts>" (None: not one)."""
    match = _COMPOSITE_DIGEST.fullmatch(digest)
    return int(match.group(2)) if match else None


def b64_to_hex(value: str) -> str:
    """A store's base64 digest (S3 x-amz-checksum-*, GCS crc32c, Content-MD5) as lowercase
    hex; ValueError if it is not base64."""
    try:
        return base64.b64decode(value, validate=True).hex()
    except binascii.Error as e:
        raise ValueError(f"not a base64 digest: {value!r}") from e


#: HeadObject's checksum fields weightcache can verify, strongest first. S3 defines crc64nvme
#: for full objects only; the others also as COMPOSITE checksums of multipart uploads.
_S3_CHECKSUMS = (
    ("ChecksumSHA256", "sha256"), ("ChecksumCRC64NVME", "crc64nvme"),
    ("ChecksumCRC32C", "crc32c"), ("ChecksumSHA1", "sha1"), ("ChecksumCRC32", "crc32"),
)  # fmt: skip
_COMPOSITE = re.compile(r"(.*)-([1-9][0-9]*)")  # "<base64>-<parts>": of the parts' checksums
_MULTIPART_ETAG = re.compile(r'"?[0-9a-fA-F]+-([1-9][0-9]*)"?')  # a multipart upload's ETag
#: S3's limit on the parts of a multipart upload: a composite checksum claiming more is a
#: store's garbage, and believing it would plan a request (a part HEAD) per claimed part.
S3_MAX_PARTS = 10_000


def s3_vouched(headers: Mapping[str, str]) -> Vouch | None:
    """The strongest checksum among HeadObject's fields, or None: a full-object one as
    (algorithm, hex); a COMPOSITE one (of a multipart upload: the checksum of the parts'
    binary checksums, "<base64>-<parts>") as ("<algorithm>-composite", "<hex>-<parts>"),
    whose part sizes the caller must learn, of at most S3_MAX_PARTS parts. A store that
    sends no ChecksumType (SeaweedFS) has a composite checksum when the value has the
    "-<parts>" suffix. A value without it, of a multipart object (its ETag ends in
    "-<parts>"), with no ChecksumType (moto) is `ambiguous`: the caller should learn the
    type (GetObjectAttributes) and ask again with it; COMPOSITE then takes the ETag's part
    count."""
    kind = headers.get("ChecksumType")
    etag = _MULTIPART_ETAG.fullmatch(headers.get("ETag", ""))
    for field, algorithm in _S3_CHECKSUMS:
        value = headers.get(field)
        if not value:
            continue
        composite = _COMPOSITE.fullmatch(value)
        count = composite.group(2) if composite else None
        if kind == "COMPOSITE" and not composite and etag and algorithm != "crc64nvme":
            count = etag.group(1)  # the value without its suffix: the ETag's count
        if kind not in (None, "COMPOSITE" if count else "FULL_OBJECT"):
            continue  # the value contradicts its type: a store's garbage
        if count and int(count) > S3_MAX_PARTS:
            continue  # more parts than S3 allows: garbage too
        if count:
            algorithm = f"{algorithm}{COMPOSITE_SUFFIX}"
            value = composite.group(1) if composite else value
        if not available(algorithm):
            continue
        try:
            digest = b64_to_hex(value)
        except ValueError:
            continue  # a store's garbage is "not vouched", never a crash
        unsure = not count and kind is None and etag is not None and algorithm != "crc64nvme"
        return Vouch(algorithm, f"{digest}-{count}" if count else digest, ambiguous=unsure)
    return None
