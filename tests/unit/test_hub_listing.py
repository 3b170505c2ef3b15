"""The Hub's model info and tree listing read as untrusted answers
(transfer/backends/hub/listing.py):
whatever HF_ENDPOINT answers (wrong types, huge numbers, non-ASCII, missing fields, deep
nesting, not JSON at all) is a listing or a SourceError, nothing else."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.errors import SourceError
from weightcache.transfer.backends.hub.listing import MAX_FILE_SIZE, HubFile, parse_info, parse_tree

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHA = "ab" * 32
BLOB = "cd" * 20
EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = (
    st.none() | st.booleans() | st.text(max_size=30)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.sampled_from([COMMIT, SHA, BLOB, SHA.upper(), "main", "é", "\x00", "../x", 0, -1,
                       MAX_FILE_SIZE, 2**64, 1e308])
)  # fmt: skip
_keys = st.sampled_from(
    ["sha", "siblings", "rfilename", "size", "blobId", "lfs", "sha256", "oid", "path", "type"]
) | st.text(max_size=8)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=6),
    max_leaves=30,
)


def _sibling(draw: Any) -> dict[str, Any]:
    """A model info sibling, each field the Hub's or any JSON value."""
    field = lambda good: st.just(good) | _json  # noqa: E731
    lfs = st.fixed_dictionaries({"sha256": field(SHA), "size": field(5)}) | _json
    keys = {"rfilename": field(f"dir/f{draw(st.integers(0, 3))}"), "size": field(5),
            "blobId": field(BLOB), "lfs": lfs}  # fmt: skip
    return {k: draw(v) for k, v in keys.items() if draw(st.booleans())}


@st.composite
def _info(draw: Any) -> Any:
    """A model info answer close to the Hub's, with any part of it replaced."""
    siblings = draw(st.lists(st.builds(dict) | st.just(None), max_size=4))
    siblings = [_sibling(draw) if s is not None else draw(_json) for s in siblings]
    body: dict[str, Any] = {"sha": draw(st.just(COMMIT) | _json), "siblings": siblings}
    if draw(st.booleans()):
        body[draw(st.sampled_from(["sha", "siblings"]))] = draw(_json)
    return body


@st.composite
def _tree(draw: Any) -> Any:
    """A tree listing page close to the Hub's, with any part of it replaced."""
    entries = []
    for i in range(draw(st.integers(0, 4))):
        entry = {"type": draw(st.sampled_from(["file", "directory"]) | _json),
                 "path": draw(st.just(f"f{i}") | _json), "size": draw(st.just(5) | _json),
                 "oid": draw(st.just(BLOB) | _json)}  # fmt: skip
        if draw(st.booleans()):
            entry["lfs"] = draw(st.fixed_dictionaries({"oid": st.just(SHA) | _json}) | _json)
        entries.append(entry)
    return entries


def _check(files: dict[str, HubFile] | None) -> None:
    """What a listing that parsed guarantees the fetch."""
    for path, f in (files or {}).items():
        assert isinstance(path, str) and path and path.isprintable()
        assert type(f.size) is int and 0 <= f.size < MAX_FILE_SIZE
        assert f.sha256 is None or re.fullmatch("[0-9a-f]{64}", f.sha256)
        assert f.blob_id is None or re.fullmatch("[0-9a-f]{40}", f.blob_id)


def _either(parse: Any, body: bytes) -> None:
    try:
        result = parse(body, "the answer")
    except SourceError as e:
        assert "HF_ENDPOINT" in str(e) and len(str(e)) < 500, e
        return
    _check(result[1] if isinstance(result, tuple) else result)


@EXAMPLES
@given(st.one_of(_info(), _json))
def test_any_model_info_is_a_listing_or_a_source_error(value: Any) -> None:
    _either(parse_info, json.dumps(value).encode())


@EXAMPLES
@given(st.one_of(_tree(), _json))
def test_any_tree_page_is_files_or_a_source_error(value: Any) -> None:
    _either(parse_tree, json.dumps(value).encode())


@EXAMPLES
@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_any_bytes_are_a_listing_or_a_source_error(body: bytes) -> None:
    _either(parse_info, body)
    _either(parse_tree, body)


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"sha": ' + b"9" * 5000 + b"}", b'{"sha": 1e999}',
     b"[" + b'{"type": "file", "path": "a", "size": 1e999, "oid": null},' * 3 + b"{}]",
     '{"sha": "é"}'.encode(), b"\xff\xfe", b"", b"null"],
)  # fmt: skip
def test_hostile_answers_are_a_source_error(body: bytes) -> None:
    for parse in (parse_info, parse_tree):
        with pytest.raises(SourceError, match="HF_ENDPOINT"):
            parse(body, "the answer")


def test_the_hubs_answers() -> None:
    info = {"sha": COMMIT, "siblings": [
        {"rfilename": "config.json", "size": 3, "blobId": BLOB},
        {"rfilename": "m.safetensors", "size": 134, "blobId": BLOB,
         "lfs": {"sha256": SHA.upper(), "size": 9, "pointerSize": 134}},
    ]}  # fmt: skip
    assert parse_info(json.dumps(info).encode(), "x") == (COMMIT, {
        "config.json": HubFile(3, None, BLOB), "m.safetensors": HubFile(9, SHA, BLOB),
    })  # fmt: skip
    no_sizes = {"sha": COMMIT, "siblings": [{"rfilename": "config.json"}]}
    assert parse_info(json.dumps(no_sizes).encode(), "x") == (COMMIT, None)
    tree = [{"type": "directory", "path": "d", "oid": BLOB, "size": 0},
            {"type": "file", "path": "d/m.bin", "size": 9, "oid": BLOB,
             "lfs": {"oid": SHA, "size": 9, "pointerSize": 134}}]  # fmt: skip
    assert parse_tree(json.dumps(tree).encode(), "x") == {"d/m.bin": HubFile(9, SHA, BLOB)}
