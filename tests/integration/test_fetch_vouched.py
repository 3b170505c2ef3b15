"""A prefix without SHA256SUMS whose store vouches for every file (design §4, Verification
without SHA256SUMS), against the real SeaweedFS: it stores the checksums given on upload
(x-amz-checksum-sha256 / -crc32c / -crc64nvme) and returns them to HeadObject with
ChecksumMode=ENABLED, so no other S3 server is needed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, CLI, Published, Running
from tests.support.checks import assert_fails, assert_ok_path, blobs_dir, describe
from tests.support.faultproxy import FaultProxy
from tests.support.modelgen import random_bytes, sha256_bytes
from weightcache.transfer.partial import SAVE_INTERVAL

MiB = 1024 * 1024


def _bytes(size: int, seed: str) -> bytes:
    return b"".join(random_bytes(size, seed))


@pytest.fixture(scope="module")
def bare_s3(store: Any) -> Any:
    """A boto3 client that sends no checksum unless one is asked for (boto3 adds crc32 to
    every upload by default)."""
    import boto3
    from botocore.config import Config

    env = store.env
    return boto3.client(
        "s3", endpoint_url=store.endpoint_url, region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(request_checksum_calculation="when_required"),
    )  # fmt: skip


def put_vouched(bare: Any, prefix: str, files: dict[str, tuple[bytes, str | None]]) -> None:
    """Put each file with the checksum algorithm given (None: no checksum at all)."""
    for relpath, (data, algorithm) in files.items():
        extra = {"ChecksumAlgorithm": algorithm} if algorithm else {}
        bare.put_object(Bucket=BUCKET, Key=f"{prefix}/{relpath}", Body=data, **extra)


def marker_of(path: Path) -> dict[str, Any]:
    return json.loads((path / ".weightcache").read_text())  # type: ignore[no-any-return]


FILES = {
    "model-00001-of-00002.safetensors": (_bytes(3 * MiB + 7, "one"), "CRC64NVME"),
    "model-00002-of-00002.safetensors": (_bytes(2 * MiB + 3, "two"), "CRC32C"),
    "config.json": (b'{"hidden_size": 8}\n', "SHA256"),
}


@pytest.mark.timeout(120)
def test_checksum_only_prefix_misses_then_hits(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path
) -> None:
    prefix = f"{uniq}/m/r1"
    put_vouched(bare_s3, prefix, FILES)
    source = f"s3://{BUCKET}/{prefix}"

    miss = wc.fetch(source, cache_dir, "--part-size", "1M", "--json")
    assert miss.returncode == 0, describe(miss)
    assert json.loads(miss.stdout)["hit"] is False
    root = cache_dir / "m" / "r1"
    for relpath, (data, _) in FILES.items():
        assert (root / relpath).read_bytes() == data
        assert (blobs_dir(cache_dir) / sha256_bytes(data)).stat().st_ino == (
            (root / relpath).stat().st_ino
        ), relpath
    files = marker_of(root)["files"]
    assert {p: f["verified"] for p, f in files.items()} == {
        "model-00001-of-00002.safetensors": "s3:crc64nvme",
        "model-00002-of-00002.safetensors": "s3:crc32c",
        "config.json": "s3:sha256",
    }
    assert not list((cache_dir / ".weightcache" / "tmp").glob("*.part*"))

    hit = wc.fetch(source, cache_dir, "--json")
    assert hit.returncode == 0, describe(hit)
    assert json.loads(hit.stdout)["hit"] is True

    ls = wc.run("ls", "--cache-dir", cache_dir, "--json")
    assert ls.returncode == 0, describe(ls)
    (row,) = map(json.loads, ls.stdout.splitlines())
    assert row["verified"] == {"s3:crc32c": 1, "s3:crc64nvme": 1, "s3:sha256": 1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("algorithm", "recorded"),
    [("CRC64NVME", "the checksum its store recorded"),
     # with no SHA256SUMS in the revision, its mismatch names the store's sha256, not one
     ("SHA256", "the sha256 its store recorded")],
)  # fmt: skip
def test_object_not_matching_its_checksum_is_exit_4_and_nothing_is_published(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy, algorithm: str,
    recorded: str,
) -> None:  # fmt: skip
    prefix = f"{uniq}/m/r1"
    size = MiB + 5
    put_vouched(bare_s3, prefix, {"w.bin": (_bytes(size, "w"), algorithm)})
    proxy.configure(corrupt_rate=1.0, scope="ranged")  # every byte range has one byte flipped

    proc = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, endpoint=proxy.url)
    message = assert_fails(proc, 4)
    assert f"{algorithm.lower()} mismatch for w.bin" in message, message
    assert recorded in message and "SHA256SUMS" not in message, message
    sent = proxy.stats().bytes_for("w.bin")
    assert 2 * size <= sent < 3 * size, f"downloaded twice, then exit 4: {sent} bytes sent"
    assert not (cache_dir / "m" / "r1").exists()
    assert list(blobs_dir(cache_dir).iterdir()) == []
    assert not list((cache_dir / ".weightcache" / "tmp").glob("*.part*"))


@pytest.mark.timeout(180)
def test_require_sha256_takes_only_bytes_a_sha256_vouches_for(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy
) -> None:
    weak, strong = f"s3://{BUCKET}/{uniq}/m/r1", f"s3://{BUCKET}/{uniq}/m/r2"
    put_vouched(bare_s3, f"{uniq}/m/r1",
                {"a.bin": (b"a" * 100, "SHA256"), "b.bin": (b"b" * 100, "CRC32")})  # fmt: skip
    put_vouched(bare_s3, f"{uniq}/m/r2", {"a.bin": (b"a" * 100, "SHA256")})

    # Refused before a byte is downloaded: the store vouches for b.bin with a CRC only.
    message = assert_fails(wc.fetch(weak, cache_dir, "--require-sha256", endpoint=proxy.url), 3)
    assert "'b.bin' with crc32 only" in message and "--require-sha256" in message, message
    assert f"weightcache manifest {weak}/ --write" in message, message
    assert proxy.stats().ranged_gets == 0
    assert not any(blobs_dir(cache_dir).glob("*"))
    assert_ok_path(wc.fetch(strong, cache_dir, env={"WEIGHTCACHE_REQUIRE_SHA256": "1"}),
                   cache_dir / "m" / "r2")  # fmt: skip

    # Fetched without the policy, the revision is a hit that the policy still refuses.
    assert_ok_path(wc.fetch(weak, cache_dir), cache_dir / "m" / "r1")
    message = assert_fails(wc.fetch(weak, cache_dir, "--require-sha256"), 3)
    assert "'b.bin' verified by s3:crc32" in message and "--require-sha256" in message, message


@pytest.mark.timeout(180)
def test_a_models_file_entry_may_require_sha256(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, tmp_path: Path
) -> None:
    put_vouched(bare_s3, f"{uniq}/weak/r1", {"b.bin": (b"b" * 100, "CRC32")})
    put_vouched(bare_s3, f"{uniq}/other/r1", {"b.bin": (b"c" * 100, "CRC32")})
    weak, other = f"s3://{BUCKET}/{uniq}/weak/r1", f"s3://{BUCKET}/{uniq}/other/r1"
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - source: {weak}\n    require_sha256: true\n"
                      f"  - source: {other}\n")  # fmt: skip

    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models)
    assert proc.returncode == 3, describe(proc)
    assert "'b.bin' with crc32 only" in proc.stderr, describe(proc)
    assert not (cache_dir / "weak" / "r1").exists()
    assert (cache_dir / "other" / "r1" / "b.bin").read_bytes() == b"c" * 100
    # --require-sha256 on the daemon's command line holds for every entry
    again = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models, "--require-sha256")
    assert again.returncode == 3, describe(again)
    assert "'b.bin' verified by s3:crc32" in again.stderr, describe(again)


@pytest.mark.timeout(120)
def test_file_without_checksum_and_no_manifest_is_exit_3_naming_the_manifest_command(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path
) -> None:
    prefix = f"{uniq}/m/r1"
    put_vouched(bare_s3, prefix, {"a.bin": (b"a" * 100, "CRC64NVME"), "b.bin": (b"b" * 100, None)})
    source = f"s3://{BUCKET}/{prefix}"

    message = assert_fails(wc.fetch(source, cache_dir), 3)
    assert "'b.bin'" in message and "no SHA256SUMS" in message, message
    assert f"weightcache manifest {source}/ --write" in message, message
    assert list(blobs_dir(cache_dir).iterdir()) == []


@pytest.mark.timeout(120)
def test_same_content_from_a_manifest_and_from_checksums_is_stored_once(
    wc: CLI, bare_s3: Any, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([2 * MiB + 1], name="m", rev="r1", seed="dedup")
    shard = pub.model.shard_names()[0]
    data = (pub.model.root / shard).read_bytes()
    prefix = f"{pub.prefix.rsplit('/', 2)[0]}/m/r2"
    put_vouched(bare_s3, prefix, {shard: (data, "CRC32C")})

    assert_ok_path(wc.fetch(pub.source, cache_dir), pub.local_path(cache_dir))
    assert_ok_path(wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir), cache_dir / "m" / "r2")

    a, b = cache_dir / "m" / "r1" / shard, cache_dir / "m" / "r2" / shard
    assert a.stat().st_ino == b.stat().st_ino
    blob = blobs_dir(cache_dir) / sha256_bytes(data)
    assert blob.stat().st_ino == a.stat().st_ino
    assert marker_of(cache_dir / "m" / "r1")["files"][shard]["verified"] == "sha256sums"
    assert marker_of(cache_dir / "m" / "r2")["files"][shard]["verified"] == "s3:crc32c"


@pytest.mark.timeout(120)
def test_marker_written_before_verified_existed_still_reads(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([MiB], seed="old")
    assert_ok_path(wc.fetch(pub.source, cache_dir), pub.local_path(cache_dir))
    marker = pub.local_path(cache_dir) / ".weightcache"
    old = json.loads(marker.read_text())
    for entry in old["files"].values():
        del entry["verified"]  # as weightcache wrote it before
    marker.write_text(json.dumps(old))

    hit = wc.fetch(pub.source, cache_dir, "--json")
    assert hit.returncode == 0 and json.loads(hit.stdout)["hit"] is True, describe(hit)
    ls = wc.run("ls", "--cache-dir", cache_dir, "--json")
    (row,) = map(json.loads, ls.stdout.splitlines())
    assert row["ready"] is True
    assert row["verified"] == {"sha256sums": len(pub.model.files)}


@pytest.mark.timeout(120)
def _kill9_past_half(running: Running, proxy: FaultProxy, size: int) -> None:
    """kill -9 the fetch `running` once the proxy has passed half of `size` bytes and the
    part state has had time to be saved."""
    deadline = time.monotonic() + 60
    while proxy.stats(settle=0).body_bytes < size // 2 and time.monotonic() < deadline:
        assert running.poll() is None, "the fetch ended before it could be killed"
        time.sleep(0.01)
    time.sleep(3 * SAVE_INTERVAL)  # the part state is saved at least this often
    running.kill9()


def test_a_killed_checksum_only_download_resumes_from_its_partial(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy
) -> None:
    size = 8 * MiB
    data = _bytes(size, "resume")
    prefix = f"{uniq}/m/r1"
    put_vouched(bare_s3, prefix, {"w.bin": (data, "CRC64NVME")})
    source = f"s3://{BUCKET}/{prefix}"
    proxy.configure(rate_limit=4 * MiB)

    running = wc.fetch_popen(source, cache_dir, "--part-size", "1M", endpoint=proxy.url)
    _kill9_past_half(running, proxy, size)
    (partial,) = (cache_dir / ".weightcache" / "tmp").glob("crc64nvme-*-8388608.part")
    assert partial.stat().st_size == size

    proxy.configure(rate_limit=None)
    proxy.reset_stats()
    again = wc.fetch(source, cache_dir, "--part-size", "1M", endpoint=proxy.url)
    assert_ok_path(again, cache_dir / "m" / "r1")
    assert "resuming w.bin" in again.stderr, describe(again)
    resent = proxy.stats().body_bytes
    assert resent <= size - size // 4, f"{resent} of {size} bytes downloaded again"
    assert (cache_dir / "m" / "r1" / "w.bin").read_bytes() == data
    assert marker_of(cache_dir / "m" / "r1")["files"]["w.bin"]["verified"] == "s3:crc64nvme"
    assert not partial.exists()


def put_multipart(client: Any, tmp_path: Path, key: str, data: bytes, algorithm: str) -> None:
    """Upload `data` as `aws s3 cp` does a big file: in 5 MiB parts (the smallest S3
    allows), with the checksum algorithm given."""
    from boto3.s3.transfer import TransferConfig

    path = tmp_path / "upload.bin"
    path.write_bytes(data)
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB,
                            preferred_transfer_client="classic")  # fmt: skip
    extra = {"ChecksumAlgorithm": algorithm}
    client.upload_file(str(path), BUCKET, key, ExtraArgs=extra, Config=config)


@pytest.mark.timeout(120)
def test_multipart_uploads_are_verified_by_their_composite_checksums(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, tmp_path: Path
) -> None:
    prefix = f"{uniq}/m/r1"
    big, other = _bytes(11 * MiB + 5, "big"), _bytes(6 * MiB + 1, "other")
    put_multipart(bare_s3, tmp_path, f"{prefix}/big.safetensors", big, "CRC32C")
    # As `aws s3 sync` uploads with boto3's defaults: crc32, composite for a multipart one.
    put_multipart(bare_s3, tmp_path, f"{prefix}/other.safetensors", other, "CRC32")
    put_vouched(bare_s3, prefix, {"config.json": (b"{}\n", "CRC32")})
    head = bare_s3.head_object(Bucket=BUCKET, Key=f"{prefix}/big.safetensors",
                               ChecksumMode="ENABLED")  # fmt: skip
    assert head["ChecksumCRC32C"].endswith("-3"), head  # a COMPOSITE checksum, 3 parts
    source = f"s3://{BUCKET}/{prefix}"

    miss = wc.fetch(source, cache_dir, "--part-size", "1M", "--json")
    assert miss.returncode == 0, describe(miss)
    assert json.loads(miss.stdout)["hit"] is False
    root = cache_dir / "m" / "r1"
    assert (root / "big.safetensors").read_bytes() == big
    assert (root / "other.safetensors").read_bytes() == other
    assert (blobs_dir(cache_dir) / sha256_bytes(big)).stat().st_ino == (
        (root / "big.safetensors").stat().st_ino
    )
    files = marker_of(root)["files"]
    assert {p: f["verified"] for p, f in files.items()} == {
        "big.safetensors": "s3:crc32c-composite",
        "other.safetensors": "s3:crc32-composite",
        "config.json": "s3:crc32",
    }
    assert not list((cache_dir / ".weightcache" / "tmp").glob("*.part*"))

    hit = wc.fetch(source, cache_dir, "--json")
    assert hit.returncode == 0, describe(hit)
    assert json.loads(hit.stdout)["hit"] is True


@pytest.mark.timeout(120)
def test_multipart_object_not_matching_its_composite_checksum_is_exit_4(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy, tmp_path: Path
) -> None:
    prefix = f"{uniq}/m/r1"
    put_multipart(bare_s3, tmp_path, f"{prefix}/w.bin", _bytes(10 * MiB + 3, "w"), "SHA256")
    proxy.configure(corrupt_rate=1.0, scope="ranged")  # every byte range has one byte flipped

    proc = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, endpoint=proxy.url)
    message = assert_fails(proc, 4)
    assert "sha256-composite mismatch for w.bin" in message, message
    assert not (cache_dir / "m" / "r1").exists()
    assert list(blobs_dir(cache_dir).iterdir()) == []
    assert not list((cache_dir / ".weightcache" / "tmp").glob("*.part*"))


@pytest.mark.timeout(120)
def test_part_sizes_come_from_head_part_when_get_object_attributes_is_unsupported(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy, tmp_path: Path
) -> None:
    prefix = f"{uniq}/m/r1"
    data = _bytes(10 * MiB + 3, "w")
    put_multipart(bare_s3, tmp_path, f"{prefix}/w.bin", data, "CRC32C")
    put_vouched(bare_s3, prefix, {"config.json": (b"{}\n", "CRC32C")})
    source = f"s3://{BUCKET}/{prefix}"

    # A store that tells the part sizes neither way: not vouched for, as before.
    proxy.configure(unsupported=("attributes", "partNumber"))
    message = assert_fails(wc.fetch(source, cache_dir, endpoint=proxy.url), 3)
    assert "'w.bin'" in message and f"weightcache manifest {source}/ --write" in message
    # GetObjectAttributes, then HEAD part 1 only: its refusal stops the other parts asked.
    assert proxy.stats().faults["unsupported"] == 2

    # Without GetObjectAttributes: one HeadObject with PartNumber per part.
    proxy.configure(unsupported=("attributes",))
    assert_ok_path(wc.fetch(source, cache_dir, endpoint=proxy.url), cache_dir / "m" / "r1")
    assert (cache_dir / "m" / "r1" / "w.bin").read_bytes() == data
    assert marker_of(cache_dir / "m" / "r1")["files"]["w.bin"]["verified"] == (
        "s3:crc32c-composite"
    )


@pytest.mark.timeout(120)
def test_the_part_heads_of_a_many_part_object_run_at_once(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Without GetObjectAttributes, the HeadObject per part of a 9-part object run on the
    vouching pool together, not in a row (a far store's round trip each), and the object is
    verified by its composite checksum at those part boundaries."""
    prefix = f"{uniq}/m/r1"
    data = _bytes(8 * 5 * MiB + 5, "many")  # 5 MiB parts, the smallest S3 allows: 9 parts
    put_multipart(bare_s3, tmp_path, f"{prefix}/w.bin", data, "CRC32C")
    source = f"s3://{BUCKET}/{prefix}"
    proxy.configure(unsupported=("attributes",), head_latency=0.2)

    assert_ok_path(wc.fetch(source, cache_dir, endpoint=proxy.url), cache_dir / "m" / "r1")
    assert (cache_dir / "m" / "r1" / "w.bin").read_bytes() == data
    files = marker_of(cache_dir / "m" / "r1")["files"]
    assert files["w.bin"]["verified"] == "s3:crc32c-composite"
    stats = proxy.stats()
    assert stats.faults["unsupported"] == 1, stats.faults  # GetObjectAttributes, once
    # One object: before, its 9 part HEADs went one at a time (a peak of 1).
    assert stats.peak_heads >= 4, stats.peak_heads


def _killed_multipart(
    wc: CLI, bare_s3: Any, prefix: str, cache_dir: Path, proxy: FaultProxy, tmp_path: Path
) -> tuple[bytes, Path]:
    """A multipart object (5 parts, SHA256 COMPOSITE checksum) under `prefix`, whose fetch
    through the proxy was killed -9 past half its bytes: (its data, the partial left)."""
    size = 4 * 5 * MiB + 3  # 5 parts: the last of 3 bytes
    data = _bytes(size, "multipart-resume")
    put_multipart(bare_s3, tmp_path, f"{prefix}/w.bin", data, "SHA256")
    proxy.configure(rate_limit=8 * MiB)
    source = f"s3://{BUCKET}/{prefix}"
    running = wc.fetch_popen(source, cache_dir, "--part-size", "1M", endpoint=proxy.url)
    _kill9_past_half(running, proxy, size)
    (partial,) = (cache_dir / ".weightcache" / "tmp").glob("*.part")
    assert not (cache_dir / "m" / "r1").exists()
    proxy.configure(rate_limit=None)
    proxy.reset_stats()
    return data, partial


@pytest.mark.timeout(120)
def test_a_killed_multipart_download_resumes_and_verifies_its_composite_checksum(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy, tmp_path: Path
) -> None:
    """kill -9 mid-download of a multipart object vouched for by a COMPOSITE checksum: the
    rerun downloads only what the partial lacks and publishes the verified bytes."""
    prefix = f"{uniq}/m/r1"
    data, partial = _killed_multipart(wc, bare_s3, prefix, cache_dir, proxy, tmp_path)
    again = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, "--part-size", "1M",
                     endpoint=proxy.url)  # fmt: skip
    assert_ok_path(again, cache_dir / "m" / "r1")
    assert "resuming w.bin" in again.stderr, describe(again)
    resent = proxy.stats().bytes_for("w.bin")
    assert resent <= len(data) - len(data) // 4, f"{resent} of {len(data)} bytes again"
    assert (cache_dir / "m" / "r1" / "w.bin").read_bytes() == data
    files = marker_of(cache_dir / "m" / "r1")["files"]
    assert files["w.bin"]["verified"] == "s3:sha256-composite"
    assert not partial.exists()


@pytest.mark.timeout(120)
def test_a_resumed_multipart_download_verifies_the_bytes_the_killed_fetch_wrote(
    wc: CLI, bare_s3: Any, uniq: str, cache_dir: Path, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A byte of the killed fetch's finished first part flipped on disk (the rerun does not
    download it again): the composite checksum catches it, so the object is downloaded once
    more in full (design: a mismatch is fetched twice) and only verified bytes publish."""
    prefix = f"{uniq}/m/r1"
    data, partial = _killed_multipart(wc, bare_s3, prefix, cache_dir, proxy, tmp_path)
    with open(partial, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, "--part-size", "1M",
                     endpoint=proxy.url)  # fmt: skip
    assert_ok_path(again, cache_dir / "m" / "r1")
    assert "resuming w.bin" in again.stderr, describe(again)
    assert "sha256-composite mismatch for w.bin" in again.stderr, describe(again)
    assert proxy.stats().bytes_for("w.bin") >= len(data)  # the whole object once more
    assert (cache_dir / "m" / "r1" / "w.bin").read_bytes() == data
