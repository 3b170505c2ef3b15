"""hf://org/repo@revision as a source (design §4, Revision sources): parsing, the cache
name and revision, --allow-source prefixes, the models file, and the manifest made of the
sha256 the Hub vouches for."""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import cast

import pytest

from weightcache.cache.manifest import parse
from weightcache.daemon.models import parse_entry
from weightcache.errors import Interrupted, SourceError, UsageError
from weightcache.fetch.vouched import vouched_manifest
from weightcache.sourceurl import Source, SourcePrefix
from weightcache.transfer.backends.hub.revision import HubBlob, read_whole
from weightcache.transfer.pacing import Backoff, Retries
from weightcache.transfer.sources import RetryRange

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("url", "repo", "name", "revision"),
    [
        ("hf://Qwen/Qwen3-8B@main", "Qwen/Qwen3-8B", "Qwen--Qwen3-8B", "main"),
        ("hf://Qwen/Qwen3-8B", "Qwen/Qwen3-8B", "Qwen--Qwen3-8B", "main"),
        ("hf://org/m.v1_x@refs/pr/1", "org/m.v1_x", "org--m.v1_x", "refs/pr/1"),
        (f" hf://org/m@{COMMIT} ", "org/m", "org--m", COMMIT),
    ],
)
def test_parse(url: str, repo: str, name: str, revision: str) -> None:
    source = Source.parse(url)
    assert (source.scheme, source.prefix, source.name, source.revision) == (
        "hf",
        repo,
        name,
        revision,
    )
    assert source.url == f"hf://{repo}@{revision}"
    assert source.pinned is (revision == COMMIT)


def test_overrides_and_pinning() -> None:
    source = Source.parse("hf://org/m@main", name="llama", revision=COMMIT)
    assert (source.name, source.revision, source.pinned) == ("llama", COMMIT, True)
    assert not Source.parse("hf://org/m@0123abc").pinned  # a short id may be a branch
    assert Source.parse("s3://bkt/m/v1").pinned and Source.parse("/m/v1").pinned


@pytest.mark.parametrize(
    "url",
    ["hf://org", "hf://org/a/b", "hf://-org/m", "hf://org/m-", "hf://o--x/m", "hf://org/a..b",
     "hf://org/m@a b", "hf://org/m@../x", "hf:///m"],
)  # fmt: skip
def test_parse_invalid(url: str) -> None:
    with pytest.raises(UsageError, match="hf://org/repo@revision"):
        Source.parse(url)


def test_allow_source_prefixes() -> None:
    source = Source.parse("hf://org/m@main")
    assert SourcePrefix.parse("hf://org").covers(source)
    assert SourcePrefix.parse("hf://org/m").covers(source)
    assert not SourcePrefix.parse("hf://org/mm").covers(source)
    assert not SourcePrefix.parse("file:///org").covers(source)
    assert str(SourcePrefix.parent_of(source)) == "hf://org/m"
    for bad in ("hf://org/m@main", "hf://org/m/x"):
        with pytest.raises(UsageError, match="hf://org/repo"):
            SourcePrefix.parse(bad)


def test_the_models_file_takes_a_commit_not_a_branch() -> None:
    spec = parse_entry({"source": f"hf://org/m@{COMMIT}", "pin": True})
    assert (spec.source.name, spec.source.revision) == ("org--m", COMMIT)
    with pytest.raises(UsageError, match="names its commit"):
        parse_entry({"source": "hf://org/m@main"})


class _Vouching:
    """A RevisionSource's listing part: what it vouches for."""

    url = "hf://org/m@main"
    manifest_hint = "commit a SHA256SUMS"

    def __init__(self, vouched: dict[str, tuple[str, str]]) -> None:
        self._vouched = vouched

    def vouches(self) -> dict[str, tuple[str, str]]:
        return self._vouched


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_manifest_from_the_sha256_of_every_file() -> None:
    sizes = {"b.safetensors": 3, "a/x.bin": 2}
    source = _Vouching({"b.safetensors": ("sha256", _sha(b"bbb")),
                        "a/x.bin": ("sha256", _sha(b"xx"))})  # fmt: skip
    manifest = parse(vouched_manifest(source, sizes), "test")  # type: ignore[arg-type]
    assert [(e.path, e.sha256) for e in manifest.entries] == [
        ("a/x.bin", _sha(b"xx")), ("b.safetensors", _sha(b"bbb"))
    ]  # fmt: skip


def test_a_file_without_a_sha256_needs_a_manifest() -> None:
    sizes = {"model.safetensors": 3, "config.json": 2}
    source = _Vouching({"model.safetensors": ("sha256", _sha(b"mmm")),
                        "config.json": ("git-sha1", "ab" * 20)})  # fmt: skip
    with pytest.raises(SourceError, match=r"no sha256 of 1 file.*'config.json'.*SHA256SUMS"):
        vouched_manifest(source, sizes)  # type: ignore[arg-type]
    with pytest.raises(SourceError, match="no SHA256SUMS at hf://org/m@main/SHA256SUMS; commit"):
        vouched_manifest(_Vouching({}), sizes)  # type: ignore[arg-type]


def test_a_small_file_read_logs_each_attempt_and_stops_when_interrupted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Hub that keeps answering 503 for config.json: each failed attempt is logged, and
    SIGTERM (the connections' stop switch) ends the retries, where they went on silently."""
    stop = threading.Event()
    reads: list[int] = []

    class Blob:
        where = "hf://org/m@c0ffee/config.json"

        def open_range(self, start: int, end: int, size: int, timeout: float) -> None:
            reads.append(start)
            if len(reads) == 2:
                stop.set()
            raise RetryRange("HTTP 503 from the Hub")

    retries = Retries(600.0, 6, Backoff(base=0.0, cap=0.0))
    with caplog.at_level(logging.WARNING), pytest.raises(Interrupted):
        read_whole(cast(HubBlob, Blob()), 10, retries, stop)
    assert len(reads) == 2
    assert f"{Blob.where}: attempt 1/6 failed (HTTP 503 from the Hub)" in caplog.text
