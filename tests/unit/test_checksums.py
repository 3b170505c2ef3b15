"""Source checksums (design §4, Verification without SHA256SUMS): the digest converters, the
algorithms against reference values, S3's HeadObject fields, the fetch's plan, the marker."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import shutil
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from weightcache.cache.marker import Marker
from weightcache.errors import IntegrityError, SourceError
from weightcache.fetch.vouched import Vouched, plan_vouched
from weightcache.transfer.checksums import Vouch, b64_to_hex, new_hasher, s3_vouched

CHECK = b"123456789"  # the CRC catalogue's check input


def digest(algorithm: str, data: bytes, chunk: int = 4, parts: tuple[int, ...] = ()) -> str:
    """`data` hashed in `chunk`-byte pieces, as the downloader feeds it."""
    h = new_hasher(algorithm, len(data), parts)
    for i in range(0, len(data), chunk):
        h.update(memoryview(bytearray(data[i : i + chunk])))
    return h.hexdigest()


def test_b64_to_hex() -> None:
    assert b64_to_hex("4waSgw==") == "e3069283"
    sha = hashlib.sha256(b"x").digest()
    assert b64_to_hex(base64.b64encode(sha).decode()) == sha.hex()
    with pytest.raises(ValueError):
        b64_to_hex("not base64!")


def test_crcs_match_the_catalogue_check_values() -> None:
    assert digest("crc32c", CHECK) == "e3069283"  # CRC-32C/ISCSI
    assert digest("crc64nvme", CHECK) == "ae8b14860a799888"  # CRC-64/NVME
    assert digest("md5", CHECK) == hashlib.md5(CHECK).hexdigest()
    assert digest("sha256", CHECK) == hashlib.sha256(CHECK).hexdigest()
    assert digest("crc32", CHECK) == "cbf43926"  # CRC-32/ISO-HDLC
    assert digest("sha1", CHECK) == hashlib.sha1(CHECK).hexdigest()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize(
    "data", [b"", b"hello\n", bytes(range(256)) * 40], ids=["empty", "text", "binary"]
)
def test_git_sha1_is_the_git_blob_id(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "f"
    path.write_bytes(data)
    expected = subprocess.run(["git", "hash-object", str(path)], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    assert digest("git-sha1", data, chunk=7) == expected


def test_s3_full_object_checksums_are_vouched() -> None:
    sha = base64.b64encode(hashlib.sha256(b"x").digest()).decode()
    assert s3_vouched({"ChecksumSHA256": sha}) == Vouch("sha256", hashlib.sha256(b"x").hexdigest())
    crc64 = {"ChecksumCRC64NVME": "Fg5AiE8Eaws=", "ChecksumType": "FULL_OBJECT"}
    assert s3_vouched(crc64) == Vouch("crc64nvme", "160e40884f046b0b")
    # sha256 is preferred: it needs no second digest
    assert s3_vouched({**crc64, "ChecksumSHA256": sha}) == s3_vouched({"ChecksumSHA256": sha})
    # crc32: what boto3 and the AWS CLI add to every upload by default
    assert s3_vouched({"ChecksumCRC32": "iH6F8A=="}) == Vouch("crc32", "887e85f0")
    assert s3_vouched({"ChecksumCRC32C": "@@@"}) is None
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==", "ChecksumType": "COMPOSITE"}) is None
    assert s3_vouched({}) is None


def test_s3_composite_checksums_are_vouched_with_their_part_count() -> None:
    composite = Vouch("crc32c-composite", "6990eedb-2")
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-2", "ChecksumType": "COMPOSITE"}) == composite
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-2"}) == composite  # no type: the suffix tells
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-2", "ChecksumType": "FULL_OBJECT"}) is None
    assert s3_vouched({"ChecksumCRC64NVME": "Fg5AiE8Eaws=-2"}) is None  # full-object only
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-0"}) is None
    # S3 allows 10,000 parts: a claim of more would plan a part HEAD for each of them
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-10000"}) == Vouch(
        "crc32c-composite", "6990eedb-10000"
    )
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-10001"}) is None
    assert s3_vouched({"ChecksumCRC32C": "aZDu2w==-99999999999", "ChecksumCRC32": "iH6F8A=="}) == (
        Vouch("crc32", "887e85f0")
    )
    sha = base64.b64encode(hashlib.sha256(b"x").digest()).decode()
    assert s3_vouched({"ChecksumSHA256": f"{sha}-3"}) == Vouch(
        "sha256-composite", f"{hashlib.sha256(b'x').hexdigest()}-3"
    )


def test_a_multipart_objects_checksum_without_suffix_or_type_is_ambiguous() -> None:
    etag = '"df8202e2cf2b70ff2e8576ce68638276-3"'  # the ETag of a 3-part upload
    bare = {"ChecksumCRC32": "iH6F8A==", "ETag": etag}  # moto's HeadObject
    assert s3_vouched(bare) == Vouch("crc32", "887e85f0", ambiguous=True)
    # the type, once GetObjectAttributes tells it, decides; the ETag gives the part count
    assert s3_vouched({**bare, "ChecksumType": "COMPOSITE"}) == Vouch("crc32-composite",
                                                                     "887e85f0-3")  # fmt: skip
    assert s3_vouched({**bare, "ChecksumType": "FULL_OBJECT"}) == Vouch("crc32", "887e85f0")
    # not multipart: a full-object checksum, as before; COMPOSITE then has no part count
    single = {"ChecksumCRC32": "iH6F8A==", "ETag": '"df8202e2cf2b70ff2e8576ce68638276"'}
    assert s3_vouched(single) == Vouch("crc32", "887e85f0")
    assert s3_vouched({**single, "ChecksumType": "COMPOSITE"}) is None
    # S3 defines crc64nvme for full objects only: nothing to be unsure about
    crc64 = {"ChecksumCRC64NVME": "Fg5AiE8Eaws=", "ETag": etag}
    assert s3_vouched(crc64) == Vouch("crc64nvme", "160e40884f046b0b")


MiB = 1024 * 1024


def _crc32c(data: bytes) -> bytes:
    import google_crc32c

    return int(google_crc32c.value(data)).to_bytes(4, "big")


def _crc32(data: bytes) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _sha1(data: bytes) -> bytes:
    return hashlib.sha1(data).digest()


@pytest.mark.parametrize(
    ("algorithm", "fn"),
    [("crc32c", _crc32c), ("crc32", _crc32), ("sha256", _sha256), ("sha1", _sha1)],
)
@pytest.mark.parametrize("chunk", [1000, 4096, 7 * MiB])
def test_composite_is_the_checksum_of_the_part_checksums(
    algorithm: str, fn: Callable[[bytes], bytes], chunk: int
) -> None:
    data = bytes(range(256)) * (11 * MiB // 256) + b"tail"
    parts = (5 * MiB, 5 * MiB, MiB + 4)
    bounds = [0, 5 * MiB, 10 * MiB, len(data)]
    raw = b"".join(fn(data[a:b]) for a, b in itertools.pairwise(bounds))
    expected = f"{fn(raw).hex()}-3"
    h = new_hasher(f"{algorithm}-composite", len(data), parts)
    for i in range(0, len(data), chunk):
        h.update(memoryview(data[i : i + chunk]))
    assert h.hexdigest() == expected


def test_composite_literal_vectors() -> None:
    # S3's value for b"123456789" + b"abc" uploaded in parts of 9 and 3 bytes: crc32c of
    # crc32c(b"123456789") || crc32c(b"abc"), big-endian (e3069283 || 364b3fb7).
    assert digest("crc32c-composite", b"123456789abc", parts=(9, 3)) == (
        f"{_crc32c(bytes.fromhex('e3069283364b3fb7')).hex()}-2"
    )
    one = digest("crc32c-composite", CHECK, parts=(9,))  # one part: still a composite
    assert one == f"{_crc32c(bytes.fromhex('e3069283')).hex()}-1"
    # a file shorter or longer than its parts never matches the vouched digest
    assert digest("crc32c-composite", CHECK[:5], parts=(5, 4)) != digest(
        "crc32c-composite", CHECK, parts=(5, 4)
    )
    assert digest("crc32c-composite", CHECK + b"x", parts=(9,)) != one
    with pytest.raises(ValueError):
        new_hasher("crc32c-composite", 9)  # without its parts


HINT = "write it with `weightcache manifest s3://b/m/r/ --write`"


def test_plan_sorts_files_by_what_vouches_for_them() -> None:
    sha = "ab" * 32
    plan = plan_vouched(
        "s3://b/m/r",
        {"a": 10, "b": 20, "c/d": 30},
        {"a": ("sha256", sha), "b": ("crc32c", "0123abcd"), "c/d": ("git-sha1", "1" * 40)},
        HINT,
    )
    assert [e.path for e in plan.known] == ["a"]
    assert plan.pending == (Vouched("b", 20, "crc32c", "0123abcd"),
                            Vouched("c/d", 30, "git-sha1", "1" * 40))  # fmt: skip
    assert plan.verified == {"a": "s3:sha256", "b": "s3:crc32c", "c/d": "s3:git-sha1"}
    manifest = plan.manifest({"b": "cd" * 32, "c/d": "ef" * 32})
    assert [(e.path, e.sha256, e.size) for e in manifest.entries] == [
        ("a", sha, 10), ("b", "cd" * 32, 20), ("c/d", "ef" * 32, 30)
    ]  # fmt: skip
    text = f"{sha}  a\n{'cd' * 32}  b\n{'ef' * 32}  c/d\n".encode()
    assert manifest.digest == hashlib.sha256(text).hexdigest()  # `weightcache manifest`'s


def test_plan_refuses_a_file_vouched_for_by_nothing_usable() -> None:
    vouches = {"a": ("crc32c", "0123abcd"), "b": ("crc32c", "not hex!"), "c": ("xxh", "00")}
    with pytest.raises(SourceError) as e:
        plan_vouched("s3://b/m/r", {"a": 1, "b": 1, "c": 1, "d": 1}, vouches, HINT)
    assert "3 of its 4 file(s)" in str(e.value) and "'b'" in str(e.value)
    assert str(e.value).endswith(HINT)
    with pytest.raises(SourceError, match=r"^no SHA256SUMS at s3://b/m/r/SHA256SUMS; write"):
        plan_vouched("s3://b/m/r", {"a": 1}, {}, HINT)  # a source that vouches nothing


def test_one_sha256_at_two_sizes_is_an_integrity_error() -> None:
    sha = "ab" * 32
    plan = plan_vouched("s3://b/m/r", {"a": 1, "b": 2},
                        {"a": ("sha256", sha), "b": ("crc32c", "0123abcd")}, HINT)  # fmt: skip
    with pytest.raises(IntegrityError):
        plan.manifest({"b": sha})


def test_marker_records_how_each_file_was_verified_and_reads_old_ones() -> None:
    files = {"a": ("1" * 64, 1), "b": ("2" * 64, 2)}
    marker = Marker("m", "r", "s3://b/m/r", "d" * 64, files, 0.0, {"b": "s3:crc64nvme"})
    back = Marker.from_json(marker.to_json())
    assert back == marker
    assert json.loads(marker.to_json())["files"]["a"]["verified"] == "sha256sums"
    assert back.verification() == {"s3:crc64nvme": 1, "sha256sums": 1}

    old = json.loads(marker.to_json())
    for entry in old["files"].values():
        del entry["verified"]
    assert Marker.from_json(json.dumps(old)).verification() == {"sha256sums": 2}

    old["files"]["a"]["verified"] = "../x"
    with pytest.raises(ValueError, match="verified by"):
        Marker.from_json(json.dumps(old))


def test_plan_takes_an_ambiguous_sha256_as_pending_not_as_a_manifest_entry() -> None:
    # Its mismatch must say "ambiguous", which only the vouched download knows to say.
    plan = plan_vouched("s3://b/m/r", {"a": 10},
                        {"a": Vouch("sha256", "ab" * 32, ambiguous=True)}, HINT)  # fmt: skip
    assert plan.known == ()
    assert plan.pending == (Vouched("a", 10, "sha256", "ab" * 32, ambiguous=True),)


def test_plan_takes_a_composite_checksum_only_with_parts_that_make_up_the_file() -> None:
    vouch = Vouch("crc32c-composite", "0123abcd-2", (6, 4))
    plan = plan_vouched("s3://b/m/r", {"a": 10}, {"a": vouch}, HINT)
    assert plan.pending == (Vouched("a", 10, "crc32c-composite", "0123abcd-2", (6, 4)),)
    assert plan.verified == {"a": "s3:crc32c-composite"}
    assert plan.pending[0].key == "crc32c-composite-0123abcd-2-10"
    for bad in (
        vouch._replace(parts=(6, 5)),  # not the file's size
        vouch._replace(parts=(10,)),  # not as many parts as the digest says
        vouch._replace(parts=()),  # the part sizes unknown
        vouch._replace(digest="0123abcd"),  # no part count
        Vouch("crc64nvme-composite", "0123456789abcdef-2", (6, 4)),  # not an S3 composite
        Vouch("crc32c", "0123abcd", (6, 4)),  # parts of a full-object checksum
    ):
        with pytest.raises(SourceError, match=r"1 of its 2 file\(s\).*'a'"):
            plan_vouched("s3://b/m/r", {"a": 10, "b": 1}, {"a": bad, "b": ("crc32", "00" * 4)},
                         HINT)  # fmt: skip


def test_plan_with_sha256_required_refuses_every_other_checksum() -> None:
    sha = "ab" * 32
    sha256s = {"a": ("sha256", sha), "b": Vouch("sha256-composite", f"{sha}-2", (6, 4))}
    plan = plan_vouched("s3://b/m/r", {"a": 1, "b": 10}, sha256s, HINT, require_sha256=True)
    assert plan.verified == {"a": "s3:sha256", "b": "s3:sha256-composite"}
    for weak in (("crc32", "0123abcd"), ("md5", "00" * 16), ("sha1", "00" * 20),
                 ("crc64nvme", "00" * 8), ("git-sha1", "00" * 20)):  # fmt: skip
        with pytest.raises(SourceError) as e:
            plan_vouched("s3://b/m/r", {"a": 1, "c": 2}, {**sha256s, "c": weak}, HINT,
                         require_sha256=True)  # fmt: skip
        message = str(e.value)
        assert f"'c' with {weak[0]} only" in message and "--require-sha256" in message, message
        assert message.endswith(HINT), message


def test_marker_tells_the_files_verified_by_other_than_sha256() -> None:
    files = {p: (f"{i}" * 64, 1) for i, p in enumerate("abcd", 1)}
    verified = {"b": "s3:sha256-composite", "c": "s3:crc32", "d": "hf:sha256"}
    marker = Marker("m", "r", "s3://b/m/r", "d" * 64, files, 0.0, verified)
    assert marker.not_by_sha256() == {"c": "s3:crc32"}
