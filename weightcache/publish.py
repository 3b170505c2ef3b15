"""`weightcache publish`: hash a local model directory, write SHA256SUMS, upload it all.

The manifest is uploaded last, so a fetch that sees it finds every file it lists.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from weightcache.config import Source, StoreSettings
from weightcache.errors import UsageError
from weightcache.manifest import MANIFEST_NAME, check_path, render

log = logging.getLogger(__name__)


def sha256_file(path: Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_files(root: Path) -> list[str]:
    """Relative paths of the regular files to publish (the manifest itself excluded)."""
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory; give the local model directory")
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise UsageError(f"{path} is a symlink; publish regular files only")
        if path.is_file() and rel != MANIFEST_NAME:
            files.append(check_path(rel, str(root)))
    if not files:
        raise UsageError(f"{root} holds no files to publish")
    return files


def publish(local_dir: Path, dest: Source, settings: StoreSettings) -> bytes:
    """Write LOCAL_DIR/SHA256SUMS and upload the files, then the manifest; return it."""
    from weightcache.transfer.s3 import ObjectStore

    files = model_files(local_dir)
    manifest = render([(sha256_file(local_dir / rel), rel) for rel in files])
    (local_dir / MANIFEST_NAME).write_bytes(manifest)
    store = ObjectStore(settings)
    for rel in files:
        log.info("uploading %s to %s/%s", rel, dest.url, rel)
        store.upload_file(local_dir / rel, dest.bucket, dest.key(rel))
    store.put_bytes(manifest, dest.bucket, dest.key(MANIFEST_NAME))
    return manifest
