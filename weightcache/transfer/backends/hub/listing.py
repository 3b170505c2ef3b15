"""The Hub's answers about a revision, read as untrusted bytes: the model info
(`GET /api/models/{repo}/revision/{rev}?blobs=true`: the commit, every file's size and
hashes) and the tree listing (`GET /api/models/{repo}/tree/{commit}?recursive=true`, what
`hf download` lists, for a mirror whose model info has no sizes). HF_ENDPOINT may name a
mirror, a proxy or a web page: whatever it answers ends here in a listing or a SourceError
(exit 3) naming HF_ENDPOINT, never in another exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from weightcache.errors import SourceError
from weightcache.sourceurl import HUB_COMMIT

#: Sizes at or above this (256 TiB) are no model file's: a bound before any arithmetic.
MAX_FILE_SIZE = 1 << 48
_SHA256 = r"[0-9a-fA-F]{64}"
_BLOB_ID = r"[0-9a-f]{40}"


@dataclass(frozen=True)
class HubFile:
    size: int
    sha256: str | None  # an LFS file's, lowercase hex
    blob_id: str | None  # its git blob id (an LFS file's is that of its pointer)


@dataclass(frozen=True)
class HubListing:
    commit: str
    files: dict[str, HubFile]


class _NotTheHub(Exception):
    """What makes an answer not the Hub's, in words."""


def parse_info(body: bytes, what: str) -> tuple[str, dict[str, HubFile] | None]:
    """The commit and the files of a model info answer (`what` names it in messages); files
    None when the answer lists no sizes (a mirror that ignores ?blobs=true). Raises
    SourceError for anything that is not the Hub's model info."""
    try:
        info = _json(body)
        if not isinstance(info, dict):
            raise _NotTheHub(f"a JSON {type(info).__name__}, not an object")
        commit = info.get("sha")
        if not isinstance(commit, str) or not re.fullmatch(HUB_COMMIT, commit):
            raise _NotTheHub(f"no commit id in its 'sha' ({_short(commit)})")
        siblings = _list(info.get("siblings"), "siblings")
        files: dict[str, HubFile] = {}
        for s in siblings:
            s = _dict(s, "a sibling")
            path = _path(s.get("rfilename"))
            lfs = None if s.get("lfs") is None else _dict(s["lfs"], f"lfs of {path}")
            size = (lfs or s).get("size")
            if size is None:
                return commit, None
            files[path] = _file(path, size, lfs, "sha256", s.get("blobId"), files)
    except _NotTheHub as e:
        raise _refused(what, e) from None
    return commit, files


def parse_tree(body: bytes, what: str) -> dict[str, HubFile]:
    """The files of one page of a tree listing (folders are left out). Raises SourceError
    for anything that is not the Hub's tree listing."""
    files: dict[str, HubFile] = {}
    try:
        for entry in _list(_json(body), "the listing"):
            entry = _dict(entry, "an entry")
            if entry.get("type") == "directory":
                continue
            if entry.get("type") != "file":
                raise _NotTheHub(f"an entry of type {_short(entry.get('type'))}")
            path = _path(entry.get("path"))
            lfs = None if entry.get("lfs") is None else _dict(entry["lfs"], f"lfs of {path}")
            size = (lfs or entry).get("size")
            files[path] = _file(path, size, lfs, "oid", entry.get("oid"), files)
    except _NotTheHub as e:
        raise _refused(what, e) from None
    return files


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the stack
        raise _NotTheHub(f"not JSON ({type(e).__name__}: {str(e)[:80]})") from None


def _refused(what: str, e: _NotTheHub) -> SourceError:
    return SourceError(
        f"{what} is not the Hub's: {e}; point HF_ENDPOINT at a Hub or a mirror of it"
    )


def _file(
    path: str, size: object, lfs: dict[str, Any] | None, sha_key: str, blob_id: object,
    files: dict[str, HubFile],
) -> HubFile:  # fmt: skip
    if path in files:
        raise _NotTheHub(f"{path!r} listed twice")
    if type(size) is not int or not 0 <= size < MAX_FILE_SIZE:
        raise _NotTheHub(f"no size of {path!r} ({_short(size)})")
    sha = None
    if lfs is not None:
        sha = lfs.get(sha_key)
        if not isinstance(sha, str) or not re.fullmatch(_SHA256, sha):
            raise _NotTheHub(f"no sha256 of the LFS file {path!r} ({_short(sha)})")
        sha = sha.lower()
    if blob_id is not None and not (isinstance(blob_id, str) and re.fullmatch(_BLOB_ID, blob_id)):
        raise _NotTheHub(f"no git blob id of {path!r} ({_short(blob_id)})")
    return HubFile(size, sha, blob_id)


def _path(value: object) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise _NotTheHub(f"a file without a path ({_short(value)})")
    return value


def _dict(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _NotTheHub(f"{what} that is a {type(value).__name__}, not an object")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _NotTheHub(f"{what} that is a {type(value).__name__}, not a list")
    return value


def _short(value: object) -> str:
    """`value` for a message: a hostile answer's string may be a megabyte."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
