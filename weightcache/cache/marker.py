"""The completion marker of a revision (`DIR/<name>/<revision>/.weightcache`, JSON).

Written last into a revision assembled aside, so a revision with a marker is complete
(design §3, the marker). Read back from disk, where anyone who can write the cache can plant
one: every path and digest is validated before it is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from weightcache.cache.layout import SHA256_HEX
from weightcache.cache.manifest import check_path
from weightcache.errors import SourceError

MARKER_VERSION = 1


@dataclass(frozen=True)
class Marker:
    """The completion marker of a revision: what it holds, as verified."""

    name: str
    revision: str
    source: str
    manifest_sha256: str
    files: dict[str, tuple[str, int]]  # path -> (sha256, size)
    created: float

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
                "files": {p: {"sha256": h, "size": s} for p, (h, s) in sorted(self.files.items())},
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Marker:
        """Parse a marker; raises ValueError naming what is wrong.

        Every file path is validated as a manifest path and every digest as 64 hex
        digits: a marker is read back from disk, where anyone who can write the cache
        can plant one, and its paths are hashed and removed by `verify` (design §3, the marker).
        """
        try:
            d = json.loads(text)
            if d.get("version") != MARKER_VERSION:
                raise ValueError(f"unknown marker version {d.get('version')!r}")
            files = {_checked_path(p): _checked_file(p, f) for p, f in d["files"].items()}
            return cls(
                d["name"], d["revision"], d["source"], d["manifest_sha256"], files,
                float(d["created"]),
            )  # fmt: skip
        except (KeyError, TypeError, AttributeError) as e:
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
