"""manifest: SHA256SUMS parsing, validation (design §2.1, §3 invariant 5) and rendering."""

from __future__ import annotations

import hashlib

import pytest

from weightcache.cache import manifest
from weightcache.cache.manifest import Manifest, ManifestEntry
from weightcache.errors import IntegrityError, SourceError

H1 = hashlib.sha256(b"one").hexdigest()
H2 = hashlib.sha256(b"two").hexdigest()
H3 = hashlib.sha256(b"three").hexdigest()
WHERE = "s3://models/m/r/SHA256SUMS"


def _parse(text: str) -> Manifest:
    return manifest.parse(text.encode(), WHERE)


def _error(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    with pytest.raises(SourceError) as info:
        manifest.parse(data, WHERE)
    assert info.value.exit_code == 3
    message = str(info.value)
    assert WHERE in message
    return message


def test_parse_good_manifest() -> None:
    data = (
        f"{H1}  model-00001-of-00002.safetensors\n"
        f"{H2}  model-00002-of-00002.safetensors\n"
        f"{H3}  tokenizer/tokenizer.json\n"
    ).encode()
    m = manifest.parse(data, WHERE)
    assert m.entries == (
        ManifestEntry("model-00001-of-00002.safetensors", H1),
        ManifestEntry("model-00002-of-00002.safetensors", H2),
        ManifestEntry("tokenizer/tokenizer.json", H3),
    )
    assert all(e.size == -1 for e in m.entries)
    assert m.digest == hashlib.sha256(data).hexdigest()


def test_parse_binary_marker_blank_lines_crlf_and_uppercase_hex() -> None:
    data = f"\n{H1} *a.bin\r\n   \n{H2.upper()}  b.bin\n\n".encode()
    m = manifest.parse(data, WHERE)
    assert [(e.path, e.sha256) for e in m.entries] == [("a.bin", H1), ("b.bin", H2)]


def test_parse_bsd_tag_lines_as_sha256sum_check_reads_them() -> None:
    # `sha256sum --tag` writes these and `sha256sum -c` accepts them, mixed with the other form.
    m = _parse(f"SHA256 (a.bin) = {H1}\nSHA256 (dir/b (1).bin) = {H2.upper()}\n{H3}  c.bin\n")
    assert [(e.path, e.sha256) for e in m.entries] == [
        ("a.bin", H1), ("dir/b (1).bin", H2), ("c.bin", H3),
    ]  # fmt: skip


def test_a_bsd_tag_path_may_hold_the_separator_itself() -> None:
    m = _parse(f"SHA256 (a) = b.bin) = {H1}\n")
    assert [(e.path, e.sha256) for e in m.entries] == [("a) = b.bin", H1)]


def test_parse_keeps_manifest_order_and_paths_with_spaces() -> None:
    m = _parse(f"{H2}  z.bin\n{H1}  a dir/with space.bin\n")
    assert [e.path for e in m.entries] == ["z.bin", "a dir/with space.bin"]


def test_digest_is_sha256_of_the_raw_bytes() -> None:
    a = f"{H1}  a.bin\n".encode()
    b = f"{H1}  a.bin\n\n".encode()  # same entries, different bytes
    assert manifest.parse(a, WHERE).digest == hashlib.sha256(a).hexdigest()
    assert manifest.parse(b, WHERE).digest == hashlib.sha256(b).hexdigest()
    assert manifest.parse(a, WHERE).digest != manifest.parse(b, WHERE).digest


def test_with_sizes_and_total_size() -> None:
    m = _parse(f"{H1}  a.bin\n{H2}  d/b.bin\n").with_sizes({"a.bin": 10, "d/b.bin": 32})
    assert [(e.path, e.size) for e in m.entries] == [("a.bin", 10), ("d/b.bin", 32)]
    assert m.total_size == 42


@pytest.mark.parametrize("size", [10**30, (1 << 50) + 1, -1])
def test_a_size_no_object_can_have_is_a_source_error_not_a_full_disk(size: int) -> None:
    """A listing of 10^30 bytes said "needs 1818989403545856512.0TiB more; free space"."""
    with pytest.raises(SourceError, match="no object is that large"):
        _parse(f"{H1}  a.bin\n").with_sizes({"a.bin": size})


def test_with_sizes_same_sha256_same_size_is_fine() -> None:
    m = _parse(f"{H1}  a.bin\n{H1}  copy/a.bin\n").with_sizes({"a.bin": 3, "copy/a.bin": 3})
    assert m.total_size == 6


def test_with_sizes_same_sha256_different_sizes_is_an_integrity_error() -> None:
    # Accepted, it was exit 0 with a marker that never hits afterwards (design §2.1).
    m = _parse(f"{H1}  a.bin\n{H2}  b.bin\n{H1}  d/c.bin\n")
    with pytest.raises(IntegrityError) as info:
        m.with_sizes({"a.bin": 3, "b.bin": 3, "d/c.bin": 4})
    message = str(info.value)
    assert info.value.exit_code == 4
    assert "a.bin (3 bytes)" in message and "d/c.bin (4 bytes)" in message
    assert H1 in message


@pytest.mark.parametrize(
    ("text", "lineno"),
    [
        (f"{H1}  a.bin\nnot a manifest line\n", 2),
        (f"{H1} a.bin\n", 1),  # one space: sha256sum always writes two characters
        (f"{H1}\ta.bin\n", 1),
        (f"{H1[:63]}  a.bin\n", 1),
        (f"{H1}0  a.bin\n", 1),
        (f"{'g' * 64}  a.bin\n", 1),
        (f"{H1}  \n", 1),
        (f"\n\n{H1}  a.bin\n{H2}\n", 4),  # blank lines count towards the line number
        (f"SHA256 (a.bin) = {H1[:63]}\n", 1),  # BSD --tag format, a short digest
        (f"SHA256 (a.bin)= {H1}\n", 1),
        (f"SHA1 (a.bin) = {H1}\n", 1),  # another algorithm's tag
        (f"SHA256 () = {H1}\n", 1),
        (f"\\{H1}  a\\\\b\n", 1),  # sha256sum's escaped-name form
    ],
)
def test_malformed_line_names_its_number(text: str, lineno: int) -> None:
    message = _error(text)
    assert f"line {lineno} is malformed" in message


def test_duplicate_path() -> None:
    message = _error(f"{H1}  a.bin\n{H2}  b.bin\n{H3}  a.bin\n")
    assert "'a.bin' twice (line 3)" in message


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "a/../../x",
        "a/..",
        "..",
        "/abs",
        "/etc/passwd",
        "a/./b",
        "./../a",
        ".",
        "a//b",
        "a/",
        "a\\b",
        "..\\x",
        "a\tb",
        "a\x00b",
        "a\x1bb",
        "a\x7fb",
        "a\x01",
    ],
)
def test_unsafe_path_is_rejected(path: str) -> None:
    message = _error(f"{H1}  ok.bin\n{H2}  {path}\n")
    assert "line 2 has an unsafe path" in message
    assert repr(path.removeprefix("./")) in message


def test_leading_dot_slash_as_find_writes_it_is_the_same_file() -> None:
    m = manifest.parse(f"{H1}  ./a/model.bin\n".encode(), "SHA256SUMS")
    assert [e.path for e in m.entries] == ["a/model.bin"]


@pytest.mark.parametrize("path", [".weightcache", ".weightcache/x", ".weightcache/a/b"])
def test_marker_name_is_reserved(path: str) -> None:
    message = _error(f"{H1}  {path}\n")
    assert "line 1 lists" in message
    assert "reserves for its marker" in message


def test_marker_name_below_the_top_is_allowed() -> None:
    m = _parse(f"{H1}  sub/.weightcache\n{H2}  .weightcache2\n")
    assert [e.path for e in m.entries] == ["sub/.weightcache", ".weightcache2"]


@pytest.mark.parametrize(
    ("text", "parent", "child"),
    [
        (f"{H1}  a\n{H2}  a/b\n", "a", "a/b"),
        (f"{H2}  a/b/c\n{H1}  a\n", "a", "a/b/c"),
        (f"{H1}  x/a\n{H2}  x/a/b\n{H3}  y\n", "x/a", "x/a/b"),
    ],
)
def test_file_and_directory_clash(text: str, parent: str, child: str) -> None:
    message = _error(text)
    assert f"{parent!r} as a file and as a directory of {child!r}" in message


def test_siblings_sharing_a_prefix_do_not_clash() -> None:
    m = _parse(f"{H1}  a\n{H2}  ab/c\n{H3}  a.d/e\n")
    assert len(m.entries) == 3


@pytest.mark.parametrize("text", ["", "\n", "  \n\n\t\n"])
def test_empty_manifest(text: str) -> None:
    assert "lists no files" in _error(text)


def test_non_utf8_manifest() -> None:
    message = _error(f"{H1}  a".encode() + b"\xff\xfe.bin\n")
    assert "not UTF-8" in message


def test_render_is_sorted_sha256sum_format() -> None:
    data = manifest.render([(H2, "b/y.bin"), (H1, "a.bin"), (H3, "B.bin")])
    assert data == f"{H3}  B.bin\n{H1}  a.bin\n{H2}  b/y.bin\n".encode()


def test_render_parse_round_trip() -> None:
    entries = [(H2, "shards/model-00002.safetensors"), (H1, "config.json"),
               (H3, "shards/model-00001.safetensors")]  # fmt: skip
    data = manifest.render(entries)
    m = manifest.parse(data, WHERE)
    assert [(e.sha256, e.path) for e in m.entries] == sorted(entries, key=lambda e: e[1])
    assert m.digest == hashlib.sha256(data).hexdigest()
    assert manifest.render([(e.sha256, e.path) for e in m.entries]) == data


@pytest.mark.parametrize("sep", ["\x0b", "\x0c", "\x1c", "\x85", "\u2028"])
def test_only_newline_separates_lines(sep: str) -> None:
    # One sha256sum line whose file name contains `sep` followed by text that looks like a
    # second entry. sha256sum -c sees one file with an odd name; the parser must see the
    # same: reject that name on line 1 (control characters) or keep it whole, and never
    # invent a second entry "b.bin" out of the middle of a file name.
    name = f"a{sep}{H2}  b.bin"
    try:
        m = _parse(f"{H1}  {name}\n")
    except SourceError as e:
        assert "line 1 has an unsafe path" in str(e)
    else:
        assert [(e.sha256, e.path) for e in m.entries] == [(H1, name)]


def test_a_path_longer_than_any_store_key_is_one_clear_error() -> None:
    """Every name within NAME_MAX, the path over what a cache directory can hold below
    PATH_MAX: refused when the manifest is read, not an OSError when the file is written."""
    path = "/".join(["d" * 200] * 21) + "/model.bin"
    message = _error(f"{H1}  {path}\n")
    assert "line 1 lists a path of 4230 bytes" in message and "\n" not in message, message
    assert len(message) < 400, message
    at_most = "/".join(["d" * 200] * 5) + "/" + "m" * 19
    assert len(at_most) == 1024
    assert _parse(f"{H1}  {at_most}\n").entries[0].path == at_most
