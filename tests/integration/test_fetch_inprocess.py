"""The fetch path in-process (weightcache/fetch.py, design §4): `Fetcher(layout,
settings).fetch(source)` and `check_hit` against the real SeaweedFS, no subprocess. What a
caller sees: the result's fields, the errors by class (their exit codes are design §2.2),
and that a failed fetch leaves no revision behind."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, Published, put_objects
from tests.support.checks import (
    assert_blobs_valid,
    assert_linked_to_blobs,
    assert_revision_ok,
    markers,
)
from tests.support.faultproxy import FaultProxy
from weightcache.cache.layout import Layout
from weightcache.config import OriginSettings
from weightcache.errors import IntegrityError, SourceError, UsageError
from weightcache.fetch import Fetcher, check_hit
from weightcache.sourceurl import Source

KiB = 1024
MiB = 1024 * KiB
#: Small parts, so that every shard is several ranged GETs.
PART = 256 * KiB

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def settings(store: Any, monkeypatch: pytest.MonkeyPatch) -> OriginSettings:
    """The store's credentials in this process's environment (boto3 reads them there), the
    host's AWS config out of reach."""
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return OriginSettings(endpoint_url=store.endpoint_url, part_size=PART, timeout=30.0)


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def fetcher(cache_root: Path, settings: OriginSettings) -> Fetcher:
    return Fetcher(Layout.open(cache_root), settings)


def source(pub: Published) -> Source:
    return Source.parse(pub.source)


def test_a_miss_downloads_every_byte_once_then_hits(
    publish: Callable[..., Published], settings: OriginSettings, cache_root: Path
) -> None:
    pub = publish([600 * KiB, 300 * KiB + 7], name="tiny", rev="r1")
    src = source(pub)
    f = fetcher(cache_root, settings)
    assert check_hit(f.layout, src) is None

    miss = f.fetch(src)
    assert (miss.hit, miss.path) == (False, str(pub.local_path(cache_root)))
    assert miss.bytes_from_origin == pub.model.total_size
    assert miss.seconds > 0 and miss.throughput > 0
    assert_revision_ok(cache_root, "tiny", "r1", pub.model)
    assert_linked_to_blobs(cache_root, "tiny", "r1", pub.model)

    hit = f.fetch(src)
    assert (hit.hit, hit.path, hit.bytes_from_origin, hit.throughput) == (True, miss.path, 0, 0)
    direct = check_hit(f.layout, src)
    assert direct is not None and (direct.hit, direct.path) == (True, miss.path)
    assert direct.to_dict()["bytes_from_origin"] == 0


def test_a_second_fetcher_on_the_same_cache_finds_the_hit(
    publish: Callable[..., Published], settings: OriginSettings, cache_root: Path
) -> None:
    pub = publish([400 * KiB])
    src = source(pub)
    first = fetcher(cache_root, settings).fetch(src)
    # A new process's view: a fresh Layout and Fetcher, and an origin that is unreachable.
    offline = OriginSettings(endpoint_url="http://127.0.0.1:9", timeout=1.0, max_attempts=1)
    second = fetcher(cache_root, offline).fetch(src)
    assert (second.hit, second.path, second.bytes_from_origin) == (True, first.path, 0)
    found = check_hit(Layout.open(cache_root), src)
    assert found is not None and found.path == first.path


def test_a_revision_sharing_shards_downloads_only_what_is_new(
    publish: Callable[..., Published], settings: OriginSettings, cache_root: Path
) -> None:
    v1 = publish([500 * KiB, 200 * KiB], rev="v1", shard_seeds=["base", "head1"], small_files=False)
    v2 = publish([500 * KiB, 300 * KiB], rev="v2", shard_seeds=["base", "head2"], small_files=False)
    f = fetcher(cache_root, settings)
    assert f.fetch(source(v1)).bytes_from_origin == 700 * KiB
    assert f.fetch(source(v2)).bytes_from_origin == 300 * KiB  # the base shard is linked
    assert_revision_ok(cache_root, "m", "v2", v2.model)
    assert_linked_to_blobs(cache_root, "m", "v2", v2.model)


def test_a_damaged_file_in_the_cache_is_downloaded_again_alone(
    publish: Callable[..., Published], settings: OriginSettings, cache_root: Path
) -> None:
    pub = publish([400 * KiB, 100 * KiB], small_files=False)
    src = source(pub)
    f = fetcher(cache_root, settings)
    f.fetch(src)
    damaged = pub.model.shard_names()[1]
    with open(pub.local_path(cache_root) / damaged, "r+b") as fh:
        fh.truncate(10)  # a hard link: the blob is damaged too
    again = fetcher(cache_root, settings).fetch(src)
    assert (again.hit, again.bytes_from_origin) == (False, 100 * KiB)
    assert_revision_ok(cache_root, "m", "r1", pub.model)
    assert_blobs_valid(cache_root)


def test_an_object_that_differs_from_the_manifest_is_an_integrity_error(
    publish: Callable[..., Published], s3: Any, settings: OriginSettings, cache_root: Path
) -> None:
    pub = publish([300 * KiB, 200 * KiB], small_files=False)
    bad = pub.model.shard_names()[0]
    put_objects(s3, BUCKET, pub.prefix, {bad: b"\0" * (300 * KiB)})  # same size, other bytes
    f = fetcher(cache_root, settings)
    with pytest.raises(IntegrityError) as e:
        f.fetch(source(pub))
    message = str(e.value)
    assert bad in message and pub.model.hashes[bad] in message
    assert e.value.exit_code == 4
    # Nothing published: no revision, no hit, no blob under the expected hash, and
    # every blob that is there is what its name says.
    assert markers(cache_root) == []
    assert not pub.local_path(cache_root).exists()
    assert check_hit(f.layout, source(pub)) is None
    assert not f.layout.blob(pub.model.hashes[bad]).exists()
    assert_blobs_valid(cache_root)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        pytest.param("delete-shard", "missing under", id="object-missing"),
        pytest.param("delete-manifest", "no SHA256SUMS", id="manifest-missing"),
        pytest.param("bad-manifest", "SHA256SUMS", id="manifest-malformed"),
    ],
)
def test_a_source_that_cannot_serve_the_revision_is_a_source_error(
    publish: Callable[..., Published],
    s3: Any,
    settings: OriginSettings,
    cache_root: Path,
    damage: str,
    why: str,
) -> None:
    pub = publish([200 * KiB, 100 * KiB], small_files=False)
    if damage == "delete-shard":
        s3.delete_object(Bucket=BUCKET, Key=pub.key(pub.model.shard_names()[1]))
    elif damage == "delete-manifest":
        s3.delete_object(Bucket=BUCKET, Key=pub.key("SHA256SUMS"))
    else:
        put_objects(s3, BUCKET, pub.prefix, {"SHA256SUMS": "not a manifest line\n"})
    f = fetcher(cache_root, settings)
    with pytest.raises(SourceError, match=why) as e:
        f.fetch(source(pub))
    assert e.value.exit_code == 3
    assert markers(cache_root) == []
    assert check_hit(f.layout, source(pub)) is None


def test_a_negative_size_in_the_listing_is_a_source_error(
    publish: Callable[..., Published],
    settings: OriginSettings,
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hostile or broken store (or mirror) listing a negative size: exit 3 naming the
    file, not EINVAL from the partial's truncate."""
    pub = publish([200 * KiB], small_files=False)
    f = fetcher(cache_root, settings)
    opened = f.revision_source

    def lying(src: Source) -> Any:
        revision = opened(src)
        listed = revision.list_sizes

        def negative() -> dict[str, int]:
            return {k: v if k == "SHA256SUMS" else -1 for k, v in listed().items()}

        monkeypatch.setattr(revision, "list_sizes", negative)
        return revision

    monkeypatch.setattr(f, "revision_source", lying)
    with pytest.raises(SourceError, match="negative size") as e:
        f.fetch(source(pub))
    assert e.value.exit_code == 3
    assert markers(cache_root) == []


def test_a_revision_of_another_source_with_other_content_is_a_usage_error(
    publish: Callable[..., Published], settings: OriginSettings, cache_root: Path
) -> None:
    one = publish([100 * KiB], name="a", rev="r1", seed=1)
    other = publish([100 * KiB], name="b", rev="r1", seed=2)
    f = fetcher(cache_root, settings)
    first = f.fetch(Source.parse(one.source, "m", "r1"))
    # The same name/revision from another source: a hit only if its manifest is the same.
    assert check_hit(f.layout, Source.parse(other.source, "m", "r1")) is None
    with pytest.raises(UsageError, match="one name/revision holds one content"):
        f.fetch(Source.parse(other.source, "m", "r1"))
    assert f.fetch(Source.parse(one.source, "m", "r1")).path == first.path


def test_part_sizes_are_read_through_every_page_of_get_object_attributes(
    settings: OriginSettings, s3: Any, uniq: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    from boto3.s3.transfer import TransferConfig

    from weightcache.transfer.backends.s3.client import Origin

    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * (15 * MiB + 3))  # parts of 5, 5, 5 MiB and 3 bytes
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB,
                            preferred_transfer_client="classic")  # fmt: skip
    key = f"{uniq}/big.bin"
    s3.upload_file(str(path), BUCKET, key, Config=config,
                   ExtraArgs={"ChecksumAlgorithm": "CRC32C"})  # fmt: skip
    # No HeadObject PartNumber to fall back on: the pages alone must tell every part.
    proxy.configure(unsupported=("partNumber",))
    origin = Origin(dataclasses.replace(settings, endpoint_url=proxy.url))
    origin.parts_page = 3  # two pages
    assert origin.listed_part_sizes(BUCKET, key, 4) == (5 * MiB, 5 * MiB, 5 * MiB, 3)
    origin.parts_page = 1  # four pages
    assert origin.listed_part_sizes(BUCKET, key, 4) == (5 * MiB, 5 * MiB, 5 * MiB, 3)
    assert proxy.stats().faults.get("unsupported", 0) == 0
    assert origin.listed_part_sizes(BUCKET, key, 5) is None  # not the count its checksum says
