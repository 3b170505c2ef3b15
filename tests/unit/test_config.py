"""config: sizes, rates, durations, capacity, store settings and source URLs."""

from __future__ import annotations

import dataclasses

import pytest

from weightcache.config import (
    Capacity,
    OriginSettings,
    PeerSettings,
    parse_duration,
    parse_rate,
    parse_size,
)
from weightcache.errors import UsageError
from weightcache.sourceurl import Source

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("0", 0),
        ("1b", 1),
        ("1B", 1),
        ("8k", 8 * KiB),
        ("8K", 8 * KiB),
        ("8Ki", 8 * KiB),
        ("8KiB", 8 * KiB),
        ("8KB", 8_000),
        ("500MiB", 500 * MiB),
        ("500M", 500 * MiB),
        ("500MB", 500_000_000),
        ("2G", 2 * GiB),
        ("2g", 2 * GiB),
        ("2GiB", 2 * GiB),
        ("2GB", 2_000_000_000),
        ("1.5GB", 1_500_000_000),
        ("1.5G", 3 * GiB // 2),
        ("3T", 3 * TiB),
        ("3TB", 3 * 10**12),
        ("  16 MiB  ", 16 * MiB),
    ],
)
def test_parse_size_valid(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_accepts_an_int() -> None:
    assert parse_size(4096) == 4096  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "G",
        "2X",
        "2PB",
        "-1G",
        "+1G",
        "1e9",
        "2 G B",
        "1.G",
        ".5G",
        "2G/s",
        "two",
        "2,5G",
        "0x10",
    ],
)
def test_parse_size_invalid(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)
    assert info.value.exit_code == 2


def test_parse_size_names_what_was_parsed() -> None:
    with pytest.raises(UsageError, match=r"^invalid --part-size 'big'"):
        parse_size("big", "--part-size")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2G", 2 * GiB), ("2G/s", 2 * GiB), ("100MB/s", 100_000_000), ("512", 512), ("512/s", 512)],
)
def test_parse_rate_valid(text: str, expected: int) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["fast", "2G/h", "2G/s/s", "/s", "-2G/s"])
def test_parse_rate_invalid(text: str) -> None:
    with pytest.raises(UsageError, match="invalid --bwlimit"):
        parse_rate(text, "--bwlimit")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2Gbit", 250_000_000), ("2gbit/s", 250_000_000), ("100Mbps", 12_500_000),
     ("800kbit", 100_000), ("1Tbit/s", 125_000_000_000), ("80bit", 10)],
)  # fmt: skip
def test_parse_rate_takes_bits_named_as_bits(text: str, expected: int) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["2Gb", "2gb/s", "100Mb", "100mb", "5kb", "1Tb/s", "2Gib"])
def test_parse_rate_refuses_a_b_that_may_be_bits(text: str) -> None:
    """`2Gb` reads as gigabits to many and as gigabytes to others: neither is guessed."""
    with pytest.raises(UsageError, match=r"ambiguous.*B or .*iB for bytes.*bit for bits") as e:
        parse_rate(text, "--bwlimit")
    assert text in str(e.value) and "--bwlimit" in str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", 30.0),
        ("10m", 600.0),
        ("1h", 3600.0),
        ("250ms", 0.25),
        ("5", 5.0),
        ("1.5m", 90.0),
        ("0.5h", 1800.0),
        (" 10 s ", 10.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration_valid(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text",
    ["", "s", "10d", "-5s", "1h30m", "10 minutes", "10S", "1e3s", "abc", "5mss"],
)
def test_parse_duration_invalid(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_duration(text, "--timeout")
    assert str(info.value).startswith(f"invalid --timeout {text!r}")


# -- Capacity ----------------------------------------------------------------------------------


def test_capacity_bytes() -> None:
    cap = Capacity.parse("200G")
    assert cap == Capacity(bytes=200 * GiB)
    assert cap.resolve(filesystem_bytes=10) == 200 * GiB  # absolute: the filesystem is moot


@pytest.mark.parametrize(
    ("text", "percent", "fs", "expected"),
    [
        ("50%", 50.0, 1000, 500),
        ("100%", 100.0, 1234, 1234),
        ("12.5%", 12.5, 800, 100),
        (" 80 % ", 80.0, 1001, 800),
        ("50%", 50.0, 1001, 500),
    ],
)
def test_capacity_percent(text: str, percent: float, fs: int, expected: int) -> None:
    cap = Capacity.parse(text)
    assert cap.percent == percent
    assert cap.bytes is None
    assert cap.resolve(fs) == expected


@pytest.mark.parametrize(
    "text",
    ["0%", "-5%", "100.1%", "%", "x%", "nan%", "inf%", "0", "0G", "-1G", "lots", ""],
)
def test_capacity_invalid(text: str) -> None:
    with pytest.raises(UsageError, match="capacity"):
        Capacity.parse(text)


@pytest.mark.parametrize("text", ["85", "1", "100"])
def test_a_small_number_without_a_unit_is_refused_as_a_forgotten_percent_sign(
    text: str,
) -> None:
    """`--capacity 85` would be 85 bytes: every unpinned revision evicted."""
    with pytest.raises(UsageError, match=rf"write {text}%.* {text}B for bytes"):
        Capacity.parse(text)
    assert Capacity.parse(f"{text}B") == Capacity(bytes=int(text))
    assert Capacity.parse("101") == Capacity(bytes=101)  # a byte count, as before


@pytest.mark.parametrize("cap", [Capacity(bytes=85), Capacity(bytes=3 << 20), Capacity(bytes=101)])
def test_a_capacity_reads_back_as_it_prints(cap: Capacity) -> None:
    assert Capacity.parse(str(cap)) == cap


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", Capacity(bytes=0)), ("0%", Capacity(percent=0.0)), ("20%", Capacity(percent=20.0))],
)
def test_min_free_accepts_zero_to_turn_the_floor_off(text: str, expected: Capacity) -> None:
    assert Capacity.parse(text, "--min-free", zero_ok=True) == expected


@pytest.mark.parametrize("text", ["-5%", "100.1%", "nan%", "-1G", "lots"])
def test_min_free_invalid_names_the_option(text: str) -> None:
    with pytest.raises(UsageError, match="--min-free"):
        Capacity.parse(text, "--min-free", zero_ok=True)


@pytest.mark.parametrize("text", ["100%", "150%"])
def test_a_floor_of_the_whole_disk_is_refused_with_its_range(text: str) -> None:
    with pytest.raises(UsageError, match=r"--min-free .*\[0, 100\)"):
        Capacity.parse(text, "--min-free", zero_ok=True, full_ok=False)
    assert Capacity.parse("99.5%", "--min-free", zero_ok=True, full_ok=False).percent == 99.5


# -- OriginSettings -----------------------------------------------------------------------------


def test_store_settings_defaults_are_valid_and_frozen() -> None:
    s = OriginSettings()
    assert (s.endpoint_url, s.bwlimit, s.max_concurrency) == (None, None, 16)
    assert (s.part_size, s.timeout, s.max_attempts) == (16 * MiB, 300.0, 8)
    assert 8 * MiB <= s.part_size <= 64 * MiB  # tens of MiB: design §4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_concurrency = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"endpoint_url": "http://127.0.0.1:8333"},
        {"endpoint_url": "https://s3.example.com"},
        {"bwlimit": 1},
        {"max_concurrency": 1},
        {"max_concurrency": 1024},
        {"part_size": 256 * KiB},
        {"part_size": 5 * GiB},
        {"timeout": 0.001},
        {"max_attempts": 1},
    ],
)
def test_store_settings_accepts_bounds(kwargs: dict[str, object]) -> None:
    s = OriginSettings(**kwargs)  # type: ignore[arg-type]
    for key, value in kwargs.items():
        assert getattr(s, key) == value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoint_url": "127.0.0.1:8333"}, "endpoint URL"),
        ({"endpoint_url": "ftp://x"}, "endpoint URL"),
        ({"endpoint_url": ""}, "endpoint URL"),
        ({"bwlimit": 0}, "--bwlimit"),
        ({"bwlimit": -1}, "--bwlimit"),
        ({"max_concurrency": 0}, "--max-concurrency"),
        ({"max_concurrency": 1025}, "--max-concurrency"),
        ({"part_size": 256 * KiB - 1}, "--part-size"),
        ({"part_size": 5 * GiB + 1}, "--part-size"),
        ({"timeout": 0}, "--timeout"),
        ({"timeout": -1.0}, "--timeout"),
        ({"max_attempts": 0}, "attempt"),
    ],
)
def test_store_settings_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        OriginSettings(**kwargs)  # type: ignore[arg-type]


# -- Source ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "bucket", "prefix", "name", "revision"),
    [
        (
            "s3://models/qwen3-70b/2026-10-01",
            "models",
            "qwen3-70b/2026-10-01",
            "qwen3-70b",
            "2026-10-01",
        ),
        (
            "s3://models/qwen3-70b/2026-10-01/",
            "models",
            "qwen3-70b/2026-10-01",
            "qwen3-70b",
            "2026-10-01",
        ),
        (
            "s3://models/qwen3-70b/2026-10-01///",
            "models",
            "qwen3-70b/2026-10-01",
            "qwen3-70b",
            "2026-10-01",
        ),
        ("  s3://models/a/b  ", "models", "a/b", "a", "b"),
        (
            "s3://my.bucket-01/org/team/llama/v3.1",
            "my.bucket-01",
            "org/team/llama/v3.1",
            "llama",
            "v3.1",
        ),
        ("s3://abc/x/y", "abc", "x/y", "x", "y"),
    ],
)
def test_source_parse(url: str, bucket: str, prefix: str, name: str, revision: str) -> None:
    src = Source.parse(url)
    assert (src.bucket, src.prefix, src.name, src.revision) == (bucket, prefix, name, revision)
    assert src.url == f"s3://{bucket}/{prefix}"
    assert src.label == f"{name}/{revision}"
    assert src.key("SHA256SUMS") == f"{prefix}/SHA256SUMS"
    assert src.key("sub/model.safetensors") == f"{prefix}/sub/model.safetensors"


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("http://models.example.com/team/llama/v1", "models.example.com", "team/llama/v1"),
        ("https://Models.Example.com:8443/llama/v1/", "models.example.com:8443", "llama/v1"),
        ("http://127.0.0.1:8080/a/llama/v1", "127.0.0.1:8080", "a/llama/v1"),
        ("https://[fd00::7]:443/llama/v1", "[fd00::7]:443", "llama/v1"),
    ],
)
def test_source_parse_http(url: str, bucket: str, prefix: str) -> None:
    """The host (and port) is the bucket; the marker records scheme://host/path."""
    src = Source.parse(url)
    assert (src.scheme, src.bucket, src.prefix) == (url.split(":")[0], bucket, prefix)
    assert (src.name, src.revision) == ("llama", "v1")
    assert src.url == f"{src.scheme}://{bucket}/{prefix}"


def test_source_parse_overrides() -> None:
    src = Source.parse("s3://models/org/qwen3-70b/2026-10-01", name="qwen", revision="prod")
    assert (src.name, src.revision) == ("qwen", "prod")
    assert src.prefix == "org/qwen3-70b/2026-10-01"  # the key prefix is not overridden
    assert src.label == "qwen/prod"
    only_name = Source.parse("s3://models/org/qwen3-70b/2026-10-01", name="qwen")
    assert (only_name.name, only_name.revision) == ("qwen", "2026-10-01")
    only_rev = Source.parse("s3://models/org/qwen3-70b/2026-10-01", revision="prod")
    assert (only_rev.name, only_rev.revision) == ("qwen3-70b", "prod")


@pytest.mark.parametrize("url", ["s3://models/org/qwen3-70b/2026-10-01", "hf://Qwen/Qwen3-8B@main"])
@pytest.mark.parametrize("given", [{"name": ""}, {"revision": ""}, {"revision": " "}])
def test_an_empty_name_or_revision_is_refused_not_taken_from_the_url(
    url: str, given: dict[str, str]
) -> None:
    """Every caller (the CLI, the models file, a Pod's request on the socket) gets the same
    rule: None takes the URL's segment, an empty value is an error."""
    with pytest.raises(UsageError, match="is empty"):
        Source.parse(url, **given)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "models/a/b",
        "http://models/a",
        "https://user:pw@models/a/b",
        "http://models/a/b?x=1",
        "ftp://models/a/b",
        "http:///a/b",
        "http://h/a/../b",
        "s3:/models/a/b",
        "s3://models",
        "s3://models/",
        "s3://models/only-one",
        "s3://models/only-one/",
        "s3://models//a/b",
        "s3://models/a//b",
        "s3://models/a/./b",
        "s3://models/a/..",
        "s3://models/../b",
        "s3://Models/a/b",  # bucket names are lowercase
        "s3://ab/a/b",  # bucket names have 3 to 63 characters
        "s3://" + "b" * 64 + "/a/b",
        "s3://-models/a/b",
        "s3://models-/a/b",
        "s3://mod_els/a/b",
    ],
)
def test_source_parse_invalid(url: str) -> None:
    with pytest.raises(UsageError) as info:
        Source.parse(url)
    assert repr(url) in str(info.value)
    assert "s3://bucket/prefix/<name>/<revision>" in str(info.value)


@pytest.mark.parametrize(
    ("url", "path", "name", "revision"),
    [
        ("file:///mnt/models/llama/v1", "mnt/models/llama/v1", "llama", "v1"),
        ("/mnt/models/llama/v1", "mnt/models/llama/v1", "llama", "v1"),
        ("  /mnt/models/llama/v1//  ", "mnt/models/llama/v1", "llama", "v1"),
        ("file:///llama/v1/", "llama/v1", "llama", "v1"),
    ],
)
def test_source_parse_file(url: str, path: str, name: str, revision: str) -> None:
    src = Source.parse(url)
    assert (src.scheme, src.bucket, src.prefix) == ("file", "", path)
    assert (src.name, src.revision) == (name, revision)
    assert src.url == f"file:///{path}"  # what the marker records, whichever form was given


@pytest.mark.parametrize(
    "url",
    ["file://host/m/llama/v1", "file://", "file:///", "/", "/v1", "llama/v1", "./m/v1",
     "/m//v1", "//m/v1", "/m/../v1", "/m/./v1", "/m/v1/..", "file:/m/v1", "/m/v\0/x"],
)  # fmt: skip
def test_source_parse_file_invalid(url: str) -> None:
    with pytest.raises(UsageError) as info:
        Source.parse(url)
    assert "file:///path/<name>/<revision>" in str(info.value)


def test_a_peer_view_of_no_peer_is_a_usage_error() -> None:
    assert PeerSettings(("0.0.0.0", 9401), "t" * 16).view == 16
    with pytest.raises(UsageError, match="--peer-view 0: watch at least one peer"):
        PeerSettings(("0.0.0.0", 9401), "t" * 16, view=0)
