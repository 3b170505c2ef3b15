"""The completion marker of a revision (`DIR/<name>/<revision>/.weightcache`, JSON).

Written last into a revision assembled aside, so a revision with a marker is complete
(design §3, the marker). Read back from disk, where anyone who can write the cache can plant
one: every path and digest is validated before it is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from weightcache.cache.layout import SHA256_HEX
from weightcache.cache.manifest import check_path
from weightcache.errors import SourceError

#: Still 1 with `verified`: the field is additive, so an older weightcache reads these
#: markers as it always did (a version bump would make it re-download every revision).
MARKER_VERSION = 1
#: How a file listed in the revision's SHA256SUMS was verified; a file of a revision without
#: one was verified by its source's checksum, "<scheme>:<algorithm>" ("s3:crc64nvme").
BY_MANIFEST = "sha256sums"
#: The source checksums that verify bytes against an adversary too (`--require-sha256`): a
#: sha256, or S3's sha256 of its parts' sha256s. A CRC, MD5 or SHA-1 catches accidents only.
BY_SHA256 = ("sha256", "sha256-composite")
_VERIFIED = re.compile(r"sha256sums|[a-z][a-z0-9+.-]*:[a-z0-9-]+")


@dataclass(frozen=True)
class Marker:
    """The completion marker of a revision: what it holds, as verified."""

    name: str
    revision: str
    source: str
    manifest_sha256: str
    files: dict[str, tuple[str, int]]  # path -> (sha256, size)
    created: float
    #: path -> how it was verified; a path absent here was verified by SHA256SUMS
    verified: dict[str, str] = field(default_factory=dict)

    def how_verified(self, path: str) -> str:
        """BY_MANIFEST, or the source checksum "<scheme>:<algorithm>" that verified `path`."""
        return self.verified.get(path, BY_MANIFEST)

    def not_by_sha256(self) -> dict[str, str]:
        """{path: how} of the files verified by anything but a sha256 (`BY_SHA256`)."""
        return {
            path: how
            for path, how in self.verified.items()
            if how != BY_MANIFEST and how.partition(":")[2] not in BY_SHA256
        }

    def verification(self) -> dict[str, int]:
        """{how: number of files verified that way}, e.g. {"sha256sums": 4} (`ls --json`)."""
        counts: dict[str, int] = {}
        for path in sorted(self.files):
            how = self.how_verified(path)
            counts[how] = counts.get(how, 0) + 1
        return counts

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files.values())

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": MARKER_VERSION,
                "name": self.name,
                "revision": self.revision,
                "source": self.source,
                "manifest_sha256": self.manifest_sha256,
                "created": self.created,
                "files": {
                    p: {"sha256": h, "size": s, "verified": self.how_verified(p)}
                    for p, (h, s) in sorted(self.files.items())
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Marker:
        """Parse a marker; raises ValueError naming what is wrong.

        Every file path is validated as a manifest path and every digest as 64 hex
        digits: a marker is read back from disk, where anyone who can write the cache
        can plant one, and its paths are hashed and removed by `verify` (design §3, the marker).
        A file without "verified" (a marker written before it existed) was verified by
        SHA256SUMS, the only way there was.
        """
        try:
            d = json.loads(text)
            if d.get("version") != MARKER_VERSION:
                raise ValueError(f"unknown marker version {d.get('version')!r}")
            for key in ("name", "revision", "source", "manifest_sha256"):
                if not isinstance(d[key], str):
                    raise ValueError(f"the marker's {key} is {d[key]!r}, not a string")
            files = {_checked_path(p): _checked_file(p, f) for p, f in d["files"].items()}
            verified = {p: _checked_verified(p, f) for p, f in d["files"].items()}
            return cls(
                d["name"],
                d["revision"],
                d["source"],
                d["manifest_sha256"],
                files,
                float(d["created"]),
                {p: how for p, how in verified.items() if how != BY_MANIFEST},
            )
        except (KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            raise ValueError(f"malformed marker ({type(e).__name__}: {e})") from e


def _checked_path(raw: str) -> str:
    try:
        return check_path(raw, "the marker")
    except SourceError as e:
        raise ValueError(str(e)) from e


def _checked_file(path: str, entry: dict[str, object]) -> tuple[str, int]:
    sha256, size = entry["sha256"], int(entry["size"])  # type: ignore[call-overload]
    if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256) or size < 0:
        raise ValueError(f"the marker lists {path!r} with sha256 {sha256!r} and size {size}")
    return sha256, size


def _checked_verified(path: str, entry: dict[str, object]) -> str:
    how = entry.get("verified", BY_MANIFEST)
    if not isinstance(how, str) or not _VERIFIED.fullmatch(how):
        raise ValueError(f"the marker lists {path!r} as verified by {how!r}")
    return how
