"""SHA256SUMS: parsing and validation of the manifest that is the source of truth (§2.1).

Format: coreutils `sha256sum` output, one `<64 hex>  <relative path>` per line (`*` for
binary mode is accepted too), or `SHA256 (<relative path>) = <64 hex>` as `sha256sum --tag`
writes it (both are what `sha256sum -c` checks). Every listed file is downloaded and
verified; nothing else is.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from weightcache.cache.layout import MARKER, NAME_MAX
from weightcache.errors import IntegrityError, SourceError

MANIFEST_NAME = "SHA256SUMS"
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")
_TAG_LINE = re.compile(r"SHA256 \((.+)\) = ([0-9a-fA-F]{64})")

#: No object of any store is larger (S3's and GCS's limit is 5 TiB): a size above it is a
#: broken listing or header, not a disk too small (exit 3, not exit 5).
MAX_OBJECT_SIZE = 1 << 50
#: The longest path a manifest may list: the object stores' longest key, which leaves room
#: for the cache directory, name and revision before it within PATH_MAX (4096).
MAX_PATH_BYTES = 1024


@dataclass(frozen=True)
class ManifestEntry:
    """One line of SHA256SUMS, with the file's size once the listing told it."""

    path: str  # relative POSIX path, validated: no `..`, not absolute, no marker clash
    sha256: str  # lowercase hex
    size: int = -1  # filled from the object listing; -1 until known


@dataclass(frozen=True)
class Manifest:
    """A revision's SHA256SUMS, parsed and validated."""

    entries: tuple[ManifestEntry, ...]
    digest: str  # sha256 of the manifest bytes: the revision's content identity
    #: What vouches for the entries' sha256, as a mismatch names it.
    vouched_by: str = MANIFEST_NAME

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.entries)

    def with_sizes(self, sizes: dict[str, int], where: str = MANIFEST_NAME) -> Manifest:
        """The manifest with each file's size from the object listing.

        Raises IntegrityError when two files of one sha256 have different sizes: one
        content has one size, so one of the objects differs from the manifest (and a blob
        of either size would never match the other file's marker entry).
        """
        entries = tuple(ManifestEntry(e.path, e.sha256, sizes[e.path]) for e in self.entries)
        for entry in entries:
            if not 0 <= entry.size <= MAX_OBJECT_SIZE:  # a broken listing, not a file
                raise SourceError(
                    f"the source lists {entry.path} at {entry.size} bytes; no object is that "
                    "large (or negative): check the store or server"
                )
        first: dict[str, ManifestEntry] = {}
        for entry in entries:
            other = first.setdefault(entry.sha256, entry)
            if other.size != entry.size:
                raise IntegrityError(
                    f"{where} lists {other.path} ({other.size} bytes) and {entry.path} "
                    f"({entry.size} bytes) with the same sha256 {entry.sha256}, but one "
                    "content has one size: re-upload the object that differs or regenerate "
                    f"{MANIFEST_NAME} with sha256sum"
                )
        return Manifest(entries, self.digest, self.vouched_by)


def parse(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; `where` names it in errors. Raises SourceError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"{where} is not UTF-8 text; regenerate it with sha256sum") from e
    entries: list[ManifestEntry] = []
    seen: set[str] = set()
    # sha256sum separates lines by \n only; str.splitlines() would also split on \v, \f,
    # U+2028... which may legitimately appear in a file name.
    for lineno, line in enumerate(text.removesuffix("\n").split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        sha256, raw = _split_line(line, f"{where} line {lineno}")
        # `find . -exec sha256sum {} +` writes ./model.safetensors: same file.
        path = check_path(raw.removeprefix("./"), f"{where} line {lineno}")
        if path in seen:
            raise SourceError(f"{where} lists {path!r} twice (line {lineno}); list each file once")
        seen.add(path)
        entries.append(ManifestEntry(path, sha256.lower()))
    if not entries:
        raise SourceError(f"{where} lists no files; publish the model with its weight files")
    _check_no_file_dir_clash(seen, where)
    return Manifest(tuple(entries), hashlib.sha256(data).hexdigest())


def _split_line(line: str, where: str) -> tuple[str, str]:
    """(sha256, raw path) of a line in either of sha256sum's forms; SourceError if neither."""
    m = _LINE.fullmatch(line)
    if m is not None:
        return m.group(1), m.group(2)
    m = _TAG_LINE.fullmatch(line)  # the greedy path keeps a ") = " inside a file name
    if m is not None:
        return m.group(2), m.group(1)
    raise SourceError(
        f"{where} is malformed ({line[:80]!r}); each line must be '<64 hex digits>  "
        "<relative path>' as written by sha256sum, or 'SHA256 (<path>) = <64 hex digits>'"
    )


def check_path(raw: str, where: str) -> str:
    """A manifest path must stay inside the revision directory (§3 invariant 5)."""
    bad = (
        raw.startswith("/")
        or "\\" in raw
        or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in raw)
        or any(part in ("", ".", "..") for part in raw.split("/"))
    )
    if bad:
        raise SourceError(
            f"{where} has an unsafe path {raw!r}: paths must be relative, without '..', "
            "'.', empty segments, backslashes or control characters"
        )
    long = [part for part in raw.split("/") if len(part.encode()) > NAME_MAX]
    if long:
        raise SourceError(
            f"{where} lists a path with a {len(long[0].encode())}-byte name "
            f"({long[0][:40]!r}...): no Linux filesystem holds a name over {NAME_MAX} bytes; "
            "rename the file in the model and publish it again"
        )
    if len(raw.encode()) > MAX_PATH_BYTES:
        raise SourceError(
            f"{where} lists a path of {len(raw.encode())} bytes ({raw[:40]!r}...): over "
            f"{MAX_PATH_BYTES}, the longest key S3, GCS and Azure hold (with the cache "
            "directory before it, Linux's PATH_MAX of 4096 would refuse it); shorten the "
            "path in the model and publish it again"
        )
    if PurePosixPath(raw).parts[0] == MARKER:
        raise SourceError(f"{where} lists {raw!r}, a name weightcache reserves for its marker")
    return raw


def _check_no_file_dir_clash(paths: set[str], where: str) -> None:
    for path in paths:
        for parent in PurePosixPath(path).parents:
            if str(parent) in paths:
                raise SourceError(
                    f"{where} lists {str(parent)!r} as a file and as a directory of {path!r}"
                )


def render(entries: list[tuple[str, str]]) -> bytes:
    """[(sha256, path)] -> manifest bytes in sha256sum format, sorted by path."""
    return "".join(f"{h}  {p}\n" for h, p in sorted(entries, key=lambda e: e[1])).encode()


@dataclass(frozen=True)
class Selection:
    """What the manifest of a prefix lists, and what it leaves out and why."""

    files: dict[str, int]  # relative path -> size
    skipped: tuple[tuple[str, str], ...]  # (relative path, why a fetch would refuse it)
    existing: bool  # the prefix already holds a SHA256SUMS


def select_files(listing: dict[str, int], url: str) -> Selection:
    """The files a fetch of `url` would download if its manifest listed everything.

    Raises SourceError when nothing is left (an empty or mistyped prefix), or when one
    path is both a file and a folder (a fetch refuses such a manifest; no choice is safe).
    """
    files: dict[str, int] = {}
    skipped: list[tuple[str, str]] = []
    for path, size in sorted(listing.items()):
        if path == MANIFEST_NAME:
            continue
        if path.endswith("/") and size == 0:
            skipped.append((path, "a folder marker, not a file"))
            continue
        try:
            files[check_path(path, url)] = size
        except SourceError as e:
            skipped.append((path, str(e).removeprefix(f"{url} ")))
    if not files:
        raise SourceError(
            f"no files under {url}/ to list in a {MANIFEST_NAME}; check the source URL "
            "(bucket and prefix)"
        )
    _check_no_folder_clash(files, url)
    return Selection(files, tuple(skipped), MANIFEST_NAME in listing)


def _check_no_folder_clash(files: dict[str, int], url: str) -> None:
    for path in files:
        for parent in PurePosixPath(path).parents:
            if str(parent) in files:
                raise SourceError(
                    f"{url}/{parent} is a file and also the folder of {url}/{path}; a "
                    "cache directory cannot hold both: rename or remove one of them"
                )
