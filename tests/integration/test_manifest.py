"""`weightcache manifest SOURCE [--write]`: an existing prefix without SHA256SUMS adopts
weightcache in one command (README Usage; exit codes of design §2.2)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, CLI, put_objects
from tests.support.checks import assert_fails
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024


def nested_objects(seed: str) -> dict[str, bytes]:
    """Files as `aws s3 sync` leaves them: nested folders, an empty file and one of
    several parts (at --part-size 1M), none of them a SHA256SUMS."""
    rnd = hashlib.sha256(seed.encode()).digest()
    big = (rnd * (MiB // len(rnd) + 1))[:MiB]
    return {
        "config.json": b'{"model_type": "llama"}\n',
        "model-00001-of-00002.safetensors": os.urandom(3 * MiB + 17),
        "model-00002-of-00002.safetensors": big * 5 + b"tail",  # 5 MiB + 4: six parts
        "tokenizer/tokenizer.json": b"{}" * 1000,
        "tokenizer/sub/deep/vocab.txt": b"a\nb\nc\n",
        "empty.bin": b"",
    }


def sha256sums(objects: dict[str, bytes]) -> str:
    """What `sha256sum` prints over the same bytes, sorted by path."""
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {p}\n" for p, d in sorted(objects.items()))


def source_of(uniq: str) -> str:
    return f"s3://{BUCKET}/{uniq}/m/r1"


def put(s3: Any, uniq: str, objects: dict[str, bytes]) -> str:
    put_objects(s3, BUCKET, f"{uniq}/m/r1", objects)
    return source_of(uniq)


def get_manifest(s3: Any, uniq: str) -> bytes:
    body: bytes = s3.get_object(Bucket=BUCKET, Key=f"{uniq}/m/r1/SHA256SUMS")["Body"].read()
    return body


@pytest.mark.timeout(120)
def test_manifest_prints_the_sha256_of_every_file_under_the_prefix(
    wc: CLI, s3: Any, uniq: str
) -> None:
    objects = nested_objects(uniq)
    source = put(s3, uniq, objects)
    # What a fetch refuses is skipped, with a warning naming it: a folder marker (as
    # consoles create), and the name weightcache reserves for its marker.
    put_objects(s3, BUCKET, f"{uniq}/m/r1", {"folder/": b"", ".weightcache/x": b"x"})

    proc = wc.run("manifest", source, "--part-size", "1M", "--max-concurrency", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sha256sums(objects)
    assert "skipping" in proc.stderr and "folder/" in proc.stderr, proc.stderr
    assert ".weightcache/x" in proc.stderr, proc.stderr
    # Printing writes nothing to the store.
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{uniq}/m/r1/SHA256SUMS")


@pytest.mark.timeout(180)
def test_write_lets_fetch_verify_a_prefix_that_had_no_manifest(
    wc: CLI, s3: Any, uniq: str, cache_dir: Path
) -> None:
    objects = nested_objects(uniq)
    source = put(s3, uniq, objects)
    # Before: the fetch says which command adopts the prefix.
    message = assert_fails(wc.fetch(source, cache_dir, "--no-daemon"), 3)
    assert f"weightcache manifest {source}/ --write" in message, message

    proc = wc.run("manifest", source, "--write", "--part-size", "1M")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert f"wrote {source}/SHA256SUMS (6 files)" in proc.stderr, proc.stderr
    assert get_manifest(s3, uniq).decode() == sha256sums(objects)

    miss = wc.fetch(source, cache_dir, "--no-daemon", "--json")
    assert miss.returncode == 0, miss.stderr
    result = json.loads(miss.stdout)
    assert result["hit"] is False
    root = Path(result["path"])
    for path, data in objects.items():
        assert (root / path).read_bytes() == data, path
    hit = wc.fetch(source, cache_dir, "--no-daemon", "--json")
    assert hit.returncode == 0, hit.stderr
    assert json.loads(hit.stdout)["hit"] is True

    # Writing again the same manifest changes nothing and says so.
    again = wc.run("manifest", source, "--write")
    assert again.returncode == 0, again.stderr
    assert "left it unchanged" in again.stderr, again.stderr


@pytest.mark.timeout(120)
def test_a_different_manifest_is_replaced_only_with_force(wc: CLI, s3: Any, uniq: str) -> None:
    objects = nested_objects(uniq)
    source = put(s3, uniq, objects)
    stale = f"{'0' * 64}  config.json\n".encode()
    put_objects(s3, BUCKET, f"{uniq}/m/r1", {"SHA256SUMS": stale})

    message = assert_fails(wc.run("manifest", source, "--write"), 2)
    assert f"{source}/SHA256SUMS exists and differs" in message and "--force" in message
    assert get_manifest(s3, uniq) == stale

    # Printing is allowed, and lists the files (not the old manifest).
    printed = wc.run("manifest", source)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == sha256sums(objects)
    assert "differs" in printed.stderr, printed.stderr

    forced = wc.run("manifest", source, "--write", "--force")
    assert forced.returncode == 0, forced.stderr
    assert f"replaced {source}/SHA256SUMS" in forced.stderr, forced.stderr
    assert get_manifest(s3, uniq).decode() == sha256sums(objects)


@pytest.mark.timeout(120)
def test_an_empty_prefix_or_a_missing_bucket_is_a_source_error(wc: CLI, s3: Any, uniq: str) -> None:
    message = assert_fails(wc.run("manifest", source_of(uniq)), 3)
    assert f"no files under {source_of(uniq)}/" in message, message

    message = assert_fails(wc.run("manifest", "s3://no-such-bucket-wc/m/r1", "--timeout", "5s"), 3)
    assert "bucket does not exist" in message, message

    # A prefix holding only what a fetch refuses is empty too.
    put_objects(s3, BUCKET, f"{uniq}/m/r1", {"folder/": b""})
    assert_fails(wc.run("manifest", source_of(uniq)), 3)


@pytest.mark.timeout(120)
def test_force_without_write_and_other_schemes_are_usage_errors(wc: CLI) -> None:
    message = assert_fails(wc.run("manifest", "s3://models/a/b", "--force"), 2)
    assert "--force only applies with --write" in message
    message = assert_fails(wc.run("manifest", "ftp://models/a/b"), 2)
    assert "s3://" in message


@pytest.mark.timeout(240)
def test_throttling_and_broken_bodies_mid_file_are_retried(
    wc: CLI, s3: Any, uniq: str, proxy: FaultProxy
) -> None:
    objects = nested_objects(uniq)
    source = put(s3, uniq, objects)
    # 503 SlowDown, resets and truncated bodies on the ranged GETs, each kind forced early;
    # never more than 3 in a row on one object, so bounded retries always get through.
    proxy.configure(scope="ranged", slowdown_rate=0.2, reset_rate=0.1, truncate_rate=0.1,
                    script=("slowdown", "none", "reset", "truncate", "slowdown"),
                    max_consecutive=3)  # fmt: skip
    env = {"AWS_ENDPOINT_URL": proxy.url}
    proc = wc.run("manifest", source, "--part-size", "1M", "--max-concurrency", "4",
                  "--endpoint-url", proxy.url, env=env, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sha256sums(objects)
    faults = proxy.stats().faults
    assert faults.get("slowdown", 0) >= 2 and faults.get("reset", 0) >= 1, faults
    assert faults.get("truncate", 0) >= 1, faults
    assert "attempt 1/8" in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_bwlimit_bounds_the_rate_of_hashing(wc: CLI, s3: Any, uniq: str) -> None:
    """8 MiB at 1 MiB/s cannot hash in less than (8 - one burst of 0.25 MiB) / 1 MiB/s
    = 7.75 s, however loaded the CPU (load only slows it); unlimited it takes under 1 s."""
    objects = nested_objects(uniq)
    source = put(s3, uniq, objects)
    proc = wc.run("manifest", source, "--bwlimit", "1M", "--part-size", "1M", timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sha256sums(objects)
    seconds = float(re.search(r"hashed 6 files \(.*\) under .* in ([\d.]+)s", proc.stderr)[1])
    assert seconds >= 7.5, proc.stderr
