"""`weightcache publish`: hash a local model directory, upload it and its SHA256SUMS.

The manifest is uploaded last, so a fetch that sees it finds every file it lists.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from weightcache.cache.manifest import MANIFEST_NAME, check_path, render
from weightcache.config import OriginSettings
from weightcache.errors import AccessDenied, SourceError, UsageError
from weightcache.sourceurl import Source

if TYPE_CHECKING:
    from weightcache.transfer.backends.s3.client import Origin

log = logging.getLogger(__name__)


def sha256_file(path: Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def link_root(root: Path) -> Path:
    """The directory that symlinks under `root` may point into.

    A Hugging Face snapshot (`<repo>/snapshots/<commit>/`) is a tree of links into
    `<repo>/blobs/`: there it is the repo folder; anywhere else, `root` itself.
    """
    root = root.resolve()
    return root.parent.parent if root.parent.name == "snapshots" else root


def _check_link(path: Path, within: Path) -> None:
    target = path.resolve()
    if not target.is_relative_to(within):
        raise UsageError(
            f"{path} is a symlink to {target}, outside {within}; publish a directory whose "
            "links stay inside it (or a Hugging Face snapshot folder)"
        )
    if target.is_dir():
        raise UsageError(f"{path} is a symlink to a directory; link files only")


def model_files(root: Path) -> list[str]:
    """Relative paths of the files to publish (the manifest itself excluded): regular files,
    and symlinks to files that resolve inside `link_root(root)`, read through the link."""
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory; give the local model directory")
    within = link_root(root)
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            _check_link(path, within)
        if path.is_file() and rel != MANIFEST_NAME:
            files.append(check_path(rel, str(root)))
    if not files:
        raise UsageError(f"{root} holds no files to publish")
    return files


def publish(local_dir: Path, dest: Source, settings: OriginSettings, force: bool = False) -> bytes:
    """Upload the files of LOCAL_DIR, then their SHA256SUMS; return the manifest.

    Nothing is written into LOCAL_DIR, so read-only model directories (a mounted volume,
    a shared Hugging Face cache) publish as they are. A revision already published with
    other content is refused (UsageError) unless `force`: the nodes that cached it would
    go on serving its old bytes. One published with this content is left as it is.
    """
    from weightcache.transfer.backends.s3.client import Origin

    if dest.scheme != "s3":
        raise UsageError(
            f"publish uploads to s3:// only, not to {dest.url}; a directory on a volume is "
            f"a source as it is once it holds a {MANIFEST_NAME} (sha256sum writes one)"
        )
    files = model_files(local_dir)
    manifest = render([(sha256_file(local_dir / rel), rel) for rel in files])
    sizes = {rel: (local_dir / rel).stat().st_size for rel in files}
    store = Origin(settings)
    if _already_published(store, dest, manifest, sizes, force):
        log.info("%s already holds these files with these hashes; nothing uploaded", dest.url)
        return manifest
    for rel in files:
        log.info("uploading %s to %s/%s", rel, dest.url, rel)
        store.upload_file(local_dir / rel, dest.bucket, dest.key(rel))
    store.put_bytes(manifest, dest.bucket, dest.key(MANIFEST_NAME))
    check_landed(store, dest, sizes)
    log.info("published %d file(s) to %s", len(files), dest.url)
    return manifest


def _already_published(
    store: Origin, dest: Source, manifest: bytes, sizes: dict[str, int], force: bool
) -> bool:
    """True if DEST holds this very manifest and every file at its size (nothing to do);
    raises UsageError if it holds another manifest and not `force`. Credentials that may
    upload but not list cannot tell: False, with a warning."""
    try:
        listed = store.list_sizes(dest.bucket, dest.prefix)
    except AccessDenied as e:
        log.warning(
            "not checked whether %s is already published: listing is refused (%s)", dest.url, e
        )
        return False
    if MANIFEST_NAME not in listed:
        return False
    old = store.get_bytes(dest.bucket, dest.key(MANIFEST_NAME))
    if old != manifest and not force:
        raise UsageError(
            f"{dest.url} is already published with other files or hashes (its "
            f"{MANIFEST_NAME} differs); nodes that cached it would keep serving the old "
            "bytes. Publish to a new revision, or add --force to replace it anyway"
        )
    return old == manifest and all(listed.get(rel) == size for rel, size in sizes.items())


class _Lister(Protocol):
    def list_sizes(self, bucket: str, prefix: str) -> dict[str, int]: ...


def check_landed(store: _Lister, dest: Source, sizes: dict[str, int]) -> None:
    """Raise SourceError unless the store lists every uploaded file at its size: a server
    that is no S3 store (a web page at the wrong port) answers every PUT 200 and keeps
    nothing. One listing, whatever the model's size; credentials that may upload but not
    list (publishing needed only s3:PutObject) skip the check with a warning."""
    try:
        listed = store.list_sizes(dest.bucket, dest.prefix)
    except AccessDenied as e:
        log.warning("uploads to %s not checked: listing them is refused (%s)", dest.url, e)
        return
    wrong = [rel for rel, size in sizes.items() if listed.get(rel) != size]
    if wrong:
        raise SourceError(
            f"the store accepted the upload of {dest.url}/{wrong[0]} but does not list it "
            f"at its size ({len(wrong)} file(s) so); check that --endpoint-url points at an "
            "S3 store and that nothing else writes that prefix"
        )
