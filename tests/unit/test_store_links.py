"""A revision with more files of one content than the filesystem allows links to one inode
(EMLINK: 65,000 on ext4) still assembles: past the limit the files are copies (design
§4, Links). Needs root to mount a small ext4 image."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checks import mounted
from weightcache.cache.layout import Layout
from weightcache.cache.manifest import Manifest, ManifestEntry
from weightcache.cache.marker import Marker
from weightcache.cache.store import Cache

EXT4_LINK_MAX = 65000
FILES = EXT4_LINK_MAX + 50


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 filesystem on a loop device, mounted at tmp_path/ext4."""
    if os.geteuid() != 0:
        pytest.skip("the EMLINK test needs root to mount an ext4 image")
    image = tmp_path / "ext4.img"
    with open(image, "wb") as fh:
        fh.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    with mounted(tmp_path / "ext4", "-o", "loop", str(image)) as mountpoint:
        yield mountpoint


@pytest.mark.timeout(120)
def test_more_files_of_one_content_than_links_allowed_are_copied(ext4: Path) -> None:
    layout = Layout.open(ext4 / "cache")
    store = Cache(layout)
    data = b'{"same": true}\n'
    digest = hashlib.sha256(data).hexdigest()
    layout.blob(digest).write_bytes(data)
    paths = [f"d{i % 8}/f{i}.json" for i in range(FILES)]
    manifest = Manifest(tuple(ManifestEntry(p, digest, len(data)) for p in paths), "0" * 64)
    marker = Marker("many", "r1", "s3://b/many/r1", manifest.digest,
                    {p: (digest, len(data)) for p in paths}, 0.0)  # fmt: skip

    root = store.assemble(marker, manifest)

    assert store.ready("many", "r1") is not None
    blob = layout.blob(digest)
    inode = blob.stat().st_ino
    copies = [p for p in paths if (root / p).stat().st_ino != inode]
    assert 0 < len(copies) <= FILES - (EXT4_LINK_MAX - 2), len(copies)
    for p in copies[:100]:
        assert (root / p).read_bytes() == data
        assert (root / p).stat().st_mode & 0o777 == 0o444
