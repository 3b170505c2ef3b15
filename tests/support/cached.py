"""Ready revisions written straight into a cache directory, for in-process unit tests of
the daemon's roles (no object store, no daemon process)."""

from __future__ import annotations

import hashlib

from weightcache.cache import manifest
from weightcache.cache.index import for_cache
from weightcache.cache.marker import Marker
from weightcache.cache.store import Cache

FILE = "weights.bin"


def add_revision(
    cache: Cache, name: str, revision: str, size: int, used_at: float = 1.0, source: str = ""
) -> Marker:
    """A ready revision of one `size`-byte file whose blob no other revision shares, last
    used at `used_at`, recorded in the index as a completed fetch records it."""
    data = f"{name}/{revision}/".encode().ljust(size, b".")[:size]
    digest = hashlib.sha256(data).hexdigest()
    cache.layout.blob(digest).write_bytes(data)
    m = manifest.parse(manifest.render([(digest, FILE)]), "test").with_sizes({FILE: size})
    marker = Marker(
        name=name,
        revision=revision,
        source=source or f"s3://models/{name}/{revision}",
        manifest_sha256=m.digest,
        files={FILE: (digest, size)},
        created=used_at,
    )
    cache.assemble(marker, m)
    for_cache(cache.layout).record_access(
        name, revision, source=marker.source, size=size, now=used_at
    )
    return marker
