"""`--allow-source` (design §5, who may ask): which sources the node daemon fetches for Pods.
Prefixes match whole path segments; the option is repeatable and reads
WEIGHTCACHE_ALLOW_SOURCE (several prefixes, space-separated)."""

from __future__ import annotations

import re

import click
import pytest

from weightcache import cli
from weightcache.errors import UsageError
from weightcache.sourceurl import Source, SourcePrefix, parse_allow_sources


def covers(prefix: str, source: str) -> bool:
    return SourcePrefix.parse(prefix).covers(Source.parse(source))


@pytest.mark.parametrize(
    ("prefix", "source", "expected"),
    [
        ("s3://models/team", "s3://models/team/llama/v1", True),
        ("s3://models/team/", "s3://models/team/llama/v1", True),
        ("s3://models/team", "s3://models/teamB/llama/v1", False),  # segments, not strings
        ("s3://models/team", "s3://models/tea/m/llama/v1", False),
        ("s3://models/team/llama", "s3://models/team/llama/v1", True),
        ("s3://models/team/llama", "s3://models/team/llama2/v1", False),
        ("s3://models/team/llama/v1", "s3://models/team/llama/v1", True),
        ("s3://models", "s3://models/anything/llama/v1", True),
        ("s3://models/", "s3://models/anything/llama/v1", True),
        ("s3://models", "s3://models2/team/llama/v1", False),
        ("s3://models/team", "s3://other/team/llama/v1", False),
        ("s3://models/a/b", "s3://models/a/llama/v1", False),  # shorter than the prefix
        ("file:///mnt/models", "file:///mnt/models/llama/v1", True),
        ("/mnt/models/", "/mnt/models/llama/v1", True),
        ("file:///mnt/models", "/mnt/models/llama/v1", True),
        ("file:///mnt/models", "file:///mnt/models2/llama/v1", False),
        ("file:///models", "s3://models/llama/v1", False),  # schemes differ
        ("s3://models", "file:///models/llama/v1", False),
        ("https://h.example", "https://h.example/team/llama/v1", True),
        ("https://h.example/team", "https://h.example/team/llama/v1", True),
        ("https://h.example/team", "https://h.example/teamB/llama/v1", False),
        ("https://h.example/team", "http://h.example/team/llama/v1", False),  # schemes differ
        ("https://h.example/team", "https://h.example:8443/team/llama/v1", False),  # ports
        ("https://h.example/team", "https://other.example/team/llama/v1", False),
        ("s3://h.example/team", "https://h.example/team/llama/v1", False),
    ],
)
def test_prefixes_match_whole_segments(prefix: str, source: str, expected: bool) -> None:
    assert covers(prefix, source) is expected


@pytest.mark.parametrize(
    "text",
    ["models/team", "s3://", "s3://Models/team", "s3://models/a//b", "s3://models/../x",
     "s3://models/./x", "https://u@models/team", "https://models/a/../b", "s3://m", "/",
     "file:///", "file://h/x", "/mnt/../etc", "mnt/models"],
)  # fmt: skip
def test_invalid_prefixes_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match="--allow-source"):
        SourcePrefix.parse(text)


def test_parent_of_a_source_is_every_revision_of_its_model() -> None:
    parent = SourcePrefix.parent_of(Source.parse("s3://models/team/llama/v1"))
    assert str(parent) == "s3://models/team/llama"
    assert parent.covers(Source.parse("s3://models/team/llama/v2"))
    assert not parent.covers(Source.parse("s3://models/team/qwen/v1"))
    assert str(SourcePrefix.parse("s3://models/")) == "s3://models"
    on_disk = SourcePrefix.parent_of(Source.parse("/mnt/models/llama/v1"))
    assert str(on_disk) == "file:///mnt/models/llama"
    assert on_disk.covers(Source.parse("file:///mnt/models/llama/v2"))


def test_no_value_means_the_models_file_default() -> None:
    assert parse_allow_sources(()) is None
    assert parse_allow_sources(("s3://bbb/x", "s3://aaa", "s3://bbb/x/")) == (
        SourcePrefix("aaa"),
        SourcePrefix("bbb", ("x",)),
    )


def _daemon_params(args: list[str]) -> dict[str, object]:
    base = ["--cache-dir", "/tmp/c", "--models", "/tmp/m.yaml", "--capacity", "1G"]
    with cli.daemon.make_context("daemon", [*base, *args]) as ctx:
        return dict(ctx.params)


def test_the_option_is_repeatable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTCACHE_ALLOW_SOURCE", raising=False)
    assert _daemon_params([])["allow_sources"] is None
    params = _daemon_params(["--allow-source", "s3://aaa/x", "--allow-source", "s3://bbb"])
    assert params["allow_sources"] == (SourcePrefix("aaa", ("x",)), SourcePrefix("bbb"))


def test_the_variable_takes_several_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTCACHE_ALLOW_SOURCE", "s3://aaa/x  s3://bbb/y/z")
    params = _daemon_params([])
    assert params["allow_sources"] == (
        SourcePrefix("aaa", ("x",)),
        SourcePrefix("bbb", ("y", "z")),
    )


def test_a_bad_prefix_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTCACHE_ALLOW_SOURCE", raising=False)
    with pytest.raises(click.BadParameter, match="s3://bucket or s3://bucket/prefix"):
        _daemon_params(["--allow-source", "models/team"])


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("s3://x/m/r1", "'x' is no valid s3:// bucket"),
        ("s3://My_Bucket/m/r1", "'My_Bucket' is no valid s3:// bucket"),
        ("s3://models/m1", "it does not end in <name>/<revision>"),
        ("/m1", "it does not end in <name>/<revision>"),
        ("s3://models/a//r1", "an empty, '.' or '..' path segment"),
        ("ftp://models/m/r1", "unknown scheme 'ftp'"),
        ("models/m/r1", "no scheme and not an absolute path"),
        ("https://me:pw@host/m/r1", "credentials in the URL are not taken: put a bearer token "
                                    "in WEIGHTCACHE_HTTP_TOKEN"),
        ("http://me@host/m/r1", "credentials in the URL are not taken"),
        ("s3://key:secret@models/m/r1", "credentials in the URL are not taken: AWS_ACCESS_KEY"),
        ("https://host/m/r1?X-Amz-Signature=abc", "a query (?...) is not taken"),
        ("https://host/m/r1#part", "a fragment (#...) is not taken"),
        ("hf://org/m@main?x=1", "a query (?...) is not taken"),
    ],
)  # fmt: skip
def test_an_invalid_source_says_what_is_wrong_before_the_forms(url: str, why: str) -> None:
    with pytest.raises(UsageError, match=rf"invalid source '{re.escape(url)}': {re.escape(why)}"):
        Source.parse(url)


@pytest.mark.parametrize(
    ("url", "lower"),
    [("HTTP://Models.Example.com/m/r1", "http://models.example.com/m/r1"),
     ("Https://host:8443/m/r1", "https://host:8443/m/r1"), ("S3://models/m/r1", "s3://models/m/r1"),
     ("HF://org/m@main", "hf://org/m@main"), ("FILE:///mnt/m/r1", "/mnt/m/r1"),
     ("GS://models/m/r1", "gs://models/m/r1")],
)  # fmt: skip
def test_the_scheme_is_case_insensitive(url: str, lower: str) -> None:
    assert Source.parse(url) == Source.parse(lower)
    assert SourcePrefix.parse(url.rpartition("/")[0]) == SourcePrefix.parse(
        lower.rpartition("/")[0]
    )
