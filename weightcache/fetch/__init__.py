"""The fetch path (design §4): a revision's hit or miss (revision.py), and the blobs a miss
brings from peers and the origin, verified (blobs.py)."""

from weightcache.fetch.revision import (
    Fetcher,
    FetchResult,
    check_hit,
    refuse_unless_sha256,
    resolve,
)

__all__ = ["FetchResult", "Fetcher", "check_hit", "refuse_unless_sha256", "resolve"]
