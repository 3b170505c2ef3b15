"""A prefix without SHA256SUMS on moto's S3 server, a store that answers HeadObject for a
multipart upload with its COMPOSITE checksum but without the "-<parts>" suffix and without
a checksum type (design §4, Verification without SHA256SUMS): the ETag's "-<parts>" says
multipart, and GetObjectAttributes tells the type."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, CLI
from tests.support.checks import assert_fails, describe
from tests.support.faultproxy import FaultProxy
from tests.support.modelgen import random_bytes

MiB = 1024 * 1024


def _bytes(size: int, seed: str) -> bytes:
    return b"".join(random_bytes(size, seed))


def put_multipart(client: Any, key: str, data: bytes, algorithm: str) -> None:
    """Upload `data` as the AWS CLI does a file over 8 MiB: in parts (5 MiB, the smallest S3
    allows), with the checksum algorithm given."""
    import io

    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB,
                            preferred_transfer_client="classic")  # fmt: skip
    extra = {"ChecksumAlgorithm": algorithm}
    client.upload_fileobj(io.BytesIO(data), BUCKET, key, ExtraArgs=extra, Config=config)


def _fetch(
    wc: CLI, prefix: str, cache_dir: Path, proxy: FaultProxy
) -> subprocess.CompletedProcess[str]:
    return wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, "--part-size", "1M",
                    endpoint=proxy.url, timeout=170)  # fmt: skip


@pytest.fixture
def moto_proxy(moto: Any, request: pytest.FixtureRequest) -> Any:
    """A fault proxy in front of moto (it counts the bytes the fetch downloads)."""
    with FaultProxy(moto.url, seed=request.node.nodeid) as p:
        yield p


@pytest.mark.timeout(180)
def test_composite_checksums_moto_heads_without_their_suffix_are_verified_at_one_download(
    wc: CLI, moto: Any, moto_proxy: FaultProxy, uniq: str, cache_dir: Path
) -> None:
    client = moto.client(wc.store.env)
    prefix = f"{uniq}/m/r1"
    files = {
        "a.safetensors": (_bytes(11 * MiB + 5, "a"), "CRC32"),  # the AWS CLI's default
        "b.safetensors": (_bytes(10 * MiB + 1, "b"), "SHA256"),
        "c.safetensors": (_bytes(6 * MiB + 3, "c"), "SHA1"),
    }
    for relpath, (data, algorithm) in files.items():
        put_multipart(client, f"{prefix}/{relpath}", data, algorithm)
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/config.json", Body=b"{}\n",
                      ChecksumAlgorithm="CRC32")  # fmt: skip
    head = client.head_object(Bucket=BUCKET, Key=f"{prefix}/a.safetensors",
                              ChecksumMode="ENABLED")  # fmt: skip
    assert "-" not in head["ChecksumCRC32"] and "ChecksumType" not in head, head
    assert head["ETag"].endswith('-3"'), head  # multipart, 3 parts

    miss = _fetch(wc, prefix, cache_dir, moto_proxy)
    assert miss.returncode == 0, describe(miss)
    root = cache_dir / "m" / "r1"
    for relpath, (data, _) in files.items():
        assert (root / relpath).read_bytes() == data, relpath
    verified = json.loads((root / ".weightcache").read_text())["files"]
    assert {p: f["verified"] for p, f in verified.items()} == {
        "a.safetensors": "s3:crc32-composite",
        "b.safetensors": "s3:sha256-composite",
        "c.safetensors": "s3:sha1-composite",
        "config.json": "s3:crc32",
    }
    total = sum(len(data) for data, _ in files.values()) + 3
    assert moto_proxy.stats().body_bytes <= total + 64 * 1024, "downloaded more than once"


@pytest.mark.timeout(180)
def test_a_checksum_whose_type_the_store_does_not_tell_is_ambiguous_not_a_differing_object(
    wc: CLI, moto: Any, moto_proxy: FaultProxy, uniq: str, cache_dir: Path
) -> None:
    client = moto.client(wc.store.env)
    prefix = f"{uniq}/m/r1"
    data = _bytes(11 * MiB + 5, "w")
    put_multipart(client, f"{prefix}/w.bin", data, "CRC32")
    moto_proxy.configure(unsupported=("attributes",))  # GetObjectAttributes refused

    message = assert_fails(_fetch(wc, prefix, cache_dir, moto_proxy), 3)
    assert "ambiguous checksum" in message and "'w.bin'" in message, message
    assert "differs" not in message, message
    assert f"weightcache manifest s3://{BUCKET}/{prefix}/ --write" in message, message
    assert moto_proxy.stats().body_bytes <= len(data) + 64 * 1024, "downloaded more than once"
    assert not (cache_dir / "m" / "r1").exists()
    assert not list((cache_dir / ".weightcache" / "tmp").glob("*.part*"))
