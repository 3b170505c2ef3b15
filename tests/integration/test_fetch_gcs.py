"""A revision in Google Cloud Storage (gs://bucket/prefix/<name>/<revision>, design §4,
Revision sources), read through gcsfs from fake-gcs-server on loopback: the same
verification, resume and dedup as from S3; GCS's checksums as the source vouches for them."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published
from tests.integration.test_fetch_hit_miss import HEAVY, WITH_MODULES, measured
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
    kill9_mid_download,
    markers,
)
from tests.support.faultproxy import FaultProxy
from tests.support.gcsemu import FakeGcs
from tests.support.modelgen import MANIFEST, Model, make_model

MiB = 1024 * 1024
BUCKET = "models"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="session")
def gfs(gcs: FakeGcs) -> Any:
    return gcs.fs()


@pytest.fixture
def gput(gfs: Any, uniq: str, tmp_path: Path) -> Callable[..., tuple[str, Model]]:
    """`gput(shard_sizes, **make_model_kwargs) -> (gs:// source URL, Model)`: a model
    written under tmp_path and uploaded to gs://models/<uniq>/llama/v1/ with gcsfs."""

    def _put(sizes: list[int], **kwargs: Any) -> tuple[str, Model]:
        model = make_model(tmp_path / "src" / "llama" / "v1", sizes, **kwargs)
        prefix = f"{BUCKET}/{uniq}/llama/v1"
        gfs.put(f"{model.root}/", f"{prefix}/", recursive=True)
        return f"gs://{prefix}", model

    return _put


def _env(gcs: FakeGcs | FaultProxy) -> dict[str, str | None]:
    return {"STORAGE_EMULATOR_HOST": gcs.url}


def _fetch_json(wc: CLI, gcs: FakeGcs, source: str, cache_dir: Path, *extra: str) -> Any:
    proc = wc.fetch(source, cache_dir, "--no-daemon", "--json", *extra, env=_env(gcs))
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)


def test_miss_then_hit_from_gcs(
    wc: CLI, gcs: FakeGcs, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    url, model = gput([3 * MiB, 1 * MiB], extra_files={"sub/dir/extra.bin": b"x" * 999})
    first = _fetch_json(wc, gcs, url, cache_dir, "--part-size", "256K")
    assert first["hit"] is False and first["bytes_from_origin"] == model.total_size, first
    assert_revision_ok(cache_dir, "llama", "v1", model)
    marker = json.loads((cache_dir / "llama" / "v1" / ".weightcache").read_text())
    assert marker["source"] == url
    again = _fetch_json(wc, gcs, url, cache_dir)
    assert again["hit"] is True and again["bytes_from_origin"] == 0, again


def test_a_hit_loads_no_gcs_library(
    wc: CLI, gcs: FakeGcs, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    """The hit path (design §4) finds the marker without gcsfs, fsspec or aiohttp, even
    with the emulator unreachable."""
    url, _ = gput([64 * 1024])
    _fetch_json(wc, gcs, url, cache_dir)
    args = wc.fetch_args(url, cache_dir, "--no-daemon", endpoint=None)
    emulator_down = {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}
    hit, modules = measured(wc, WITH_MODULES, args, emulator_down, timeout=60)
    assert_ok_path(hit, cache_dir / "llama" / "v1")
    loaded = {m.split(".")[0] for m in modules}
    assert not loaded & {*HEAVY, "gcsfs", "google"}, sorted(loaded & {*HEAVY, "gcsfs", "google"})


def test_kill9_then_resume(
    wc: CLI, gcs: FakeGcs, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    url, model = gput([24 * MiB], small_files=False)
    args = ("--no-daemon", "--part-size", "1M", "--max-concurrency", "4")
    running = wc.fetch_popen(url, cache_dir, *args, "--bwlimit", "3M", env=_env(gcs))
    kill9_mid_download(running, cache_dir)
    resumed = _fetch_json(wc, gcs, url, cache_dir, *args)
    assert_revision_ok(cache_dir, "llama", "v1", model)
    # 2.5 s at 3 MiB/s is ~7 MiB; a kill loses at most the 4 parts in flight.
    assert int(resumed["bytes_from_origin"]) <= model.total_size - 2 * MiB, resumed


def test_a_corrupted_object_is_exit_4_and_nothing_is_published(
    wc: CLI, gcs: FakeGcs, gfs: Any, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    url, model = gput([2 * MiB, 1 * MiB])
    bad = model.shard_names()[0]
    data = bytearray((model.root / bad).read_bytes())
    data[MiB] ^= 0xFF  # same size, one byte differs from what SHA256SUMS says
    gfs.pipe(f"{url.removeprefix('gs://')}/{bad}", bytes(data))
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon", env=_env(gcs)), 4)
    assert "sha256 mismatch" in message and bad in message, message
    assert markers(cache_dir) == []
    assert not (cache_dir / "llama" / "v1").exists()
    assert not (blobs_dir(cache_dir) / model.hashes[bad]).exists()
    assert_blobs_valid(cache_dir)


def test_a_missing_object_is_exit_3(
    wc: CLI, gcs: FakeGcs, gfs: Any, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    url, _ = gput([1 * MiB])
    gfs.rm(f"{url.removeprefix('gs://')}/config.json")
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon", env=_env(gcs)), 3)
    assert "config.json" in message and "missing" in message, message
    assert markers(cache_dir) == []


def test_a_missing_bucket_is_exit_3_and_without_a_manifest_crc32c_verifies(
    wc: CLI, gcs: FakeGcs, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    """A bucket that is not there is exit 3. A prefix without SHA256SUMS is fetched: GCS
    keeps every object's crc32c, which the fetch checks as the bytes land (the marker says
    so)."""
    nobucket = assert_fails(
        wc.fetch("gs://no-such-bucket/m/v1", cache_dir, "--no-daemon", env=_env(gcs)), 3
    )
    assert "gs://no-such-bucket/m/v1" in nobucket and "not found" in nobucket, nobucket
    url, model = gput([1024], manifest=False)
    proc = wc.fetch(url, cache_dir, "--no-daemon", env=_env(gcs))
    assert proc.returncode == 0, describe(proc)
    assert_revision_ok(cache_dir, "llama", "v1", model)
    marker = json.loads((cache_dir / "llama" / "v1" / ".weightcache").read_text())
    assert {f["verified"] for f in marker["files"].values()} == {"gs:crc32c"}, marker


def test_throttling_goes_through_the_retries_and_aimd(
    wc: CLI, gcs: FakeGcs, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    """GCS's 429/503 on a data GET is retried by the downloader (not hidden in gcsfs's
    own backoff) and lowers the concurrency."""
    url, model = gput([2 * MiB], small_files=False)
    with FaultProxy(gcs.url, seed="gcs-throttle") as proxy:
        proxy.configure(script=("slowdown", "slowdown"), scope="ranged")
        proc = wc.fetch(url, cache_dir, "--no-daemon", "--part-size", "1M", env=_env(proxy))
        assert proc.returncode == 0, describe(proc)
        assert proxy.stats().faults.get("slowdown") == 2
    assert "GCS asks to slow down" in proc.stderr, proc.stderr
    assert_revision_ok(cache_dir, "llama", "v1", model)


def test_the_same_file_from_s3_and_from_gcs_is_stored_once(
    wc: CLI, gcs: FakeGcs, gfs: Any, publish: Callable[..., Published], uniq: str,
    cache_dir: Path,
) -> None:  # fmt: skip
    pub = publish([2 * MiB, 1 * MiB], name="m", rev="r1")
    gfs.put(f"{pub.model.root}/", f"{BUCKET}/{uniq}/m/r1/", recursive=True)
    first = _fetch_json(wc, gcs, pub.source, cache_dir)
    assert first["bytes_from_origin"] == pub.model.total_size, first
    again = _fetch_json(wc, gcs, f"gs://{BUCKET}/{uniq}/m/r1", cache_dir, "--revision", "gs")
    assert again["bytes_from_origin"] == 0, again
    assert_revision_ok(cache_dir, "m", "r1", pub.model)
    assert_revision_ok(cache_dir, "m", "gs", pub.model)
    assert assert_blobs_valid(cache_dir) == len(set(pub.model.hashes.values()))


def test_vouches_gives_each_objects_crc32c(
    gcs: FakeGcs, gput: Callable[..., tuple[str, Model]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What GCS vouches for, from the listing, equals the checksums of the bytes uploaded."""
    import google_crc32c

    from weightcache.transfer.backends.gcs import GcsClient, GcsRevision, listed_checksums

    url, model = gput([300_000, 0], extra_files={"sub/a.bin": b"abc"})
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    client = GcsClient()
    try:
        revision = GcsRevision(bucket, prefix, 30.0, client)
        listing, vouched = revision.listing(), revision.vouches()
    finally:
        client.close()
    expected = {}
    for rel in model.hashes:
        data = (model.root / rel).read_bytes()
        expected[rel] = ("crc32c", google_crc32c.Checksum(data).digest().hex())
        assert listed_checksums(listing[rel])["md5"] == hashlib.md5(data).hexdigest(), rel
    assert {k: v for k, v in vouched.items() if k != MANIFEST} == expected
    assert all(len(h) == 8 and h == h.lower() for _, h in expected.values())


def test_listed_checksums_decode_base64_big_endian() -> None:
    from weightcache.transfer.backends.gcs import listed_checksums

    crc = base64.b64encode((0x89C8ECC3).to_bytes(4, "big")).decode()
    md5 = base64.b64encode(hashlib.md5(b"x").digest()).decode()
    assert listed_checksums({"crc32c": crc, "md5Hash": md5}) == {
        "crc32c": "89c8ecc3", "md5": hashlib.md5(b"x").hexdigest()
    }  # fmt: skip
    assert listed_checksums({"crc32c": crc}) == {"crc32c": "89c8ecc3"}  # composite: no md5


def test_manifest_hashes_a_gcs_prefix_and_writes_it(
    wc: CLI, gcs: FakeGcs, gfs: Any, gput: Callable[..., tuple[str, Model]], cache_dir: Path
) -> None:
    """An existing bucket without SHA256SUMS adopts weightcache with one command."""
    url, model = gput([3 * MiB, 0, 100_000], manifest=False)
    proc = wc.run("manifest", url, "--part-size", "1M", env=_env(gcs))
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout == model.manifest_text
    written = wc.run("manifest", url, "--write", env=_env(gcs))
    assert written.returncode == 0, describe(written)
    assert gfs.cat_file(f"{url.removeprefix('gs://')}/{MANIFEST}").decode() == model.manifest_text
    _fetch_json(wc, gcs, url, cache_dir)
    assert_revision_ok(cache_dir, "llama", "v1", model)
