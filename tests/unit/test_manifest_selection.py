"""What `weightcache manifest` lists and when --write may replace a SHA256SUMS (pure parts
of weightcache/ops/manifest.py, with literal listings)."""

from __future__ import annotations

import pytest

from weightcache.errors import SourceError, UsageError
from weightcache.ops.manifest import decide_write, select_files

URL = "s3://models/m/r1"


def test_lists_every_file_a_fetch_would_take_and_skips_what_it_refuses() -> None:
    listing = {
        "a.safetensors": 10,
        "tok/vocab.txt": 3,
        "SHA256SUMS": 99,  # the manifest itself: never listed
        "sub/SHA256SUMS": 5,  # a nested one is an ordinary file
        "folder/": 0,  # a console's folder marker
        ".weightcache/x": 1,  # the cache's marker name
        "a//b": 1,  # an empty segment
        "x\\y": 1,  # a backslash
        "ctl\x01": 1,  # a control character
        "n" * 256: 1,  # longer than NAME_MAX
    }
    selection = select_files(listing, URL)
    assert selection.files == {"a.safetensors": 10, "sub/SHA256SUMS": 5, "tok/vocab.txt": 3}
    assert selection.existing
    skipped = dict(selection.skipped)
    assert set(skipped) == {"folder/", ".weightcache/x", "a//b", "x\\y", "ctl\x01", "n" * 256}
    assert skipped["folder/"] == "a folder marker, not a file"


def test_nothing_to_list_is_a_source_error() -> None:
    with pytest.raises(SourceError, match="no files under s3://models/m/r1/"):
        select_files({}, URL)
    with pytest.raises(SourceError, match="no files under"):
        select_files({"SHA256SUMS": 10, "folder/": 0}, URL)


def test_a_path_that_is_a_file_and_a_folder_is_a_source_error() -> None:
    with pytest.raises(SourceError, match="s3://models/m/r1/a is a file and also the folder"):
        select_files({"a": 1, "a/b": 2}, URL)


def test_write_creates_keeps_or_replaces_only_with_force() -> None:
    assert decide_write(b"new", None, False, "w") == "create"
    assert decide_write(b"same", b"same", False, "w") == "same"
    assert decide_write(b"new", b"old", True, "w") == "replace"
    with pytest.raises(UsageError, match=r"w exists and differs.*--force"):
        decide_write(b"new", b"old", False, "w")
