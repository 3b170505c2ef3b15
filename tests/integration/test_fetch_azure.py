"""A revision in Azure Blob Storage (az://container/... and abfs://container@account.dfs...,
design §4, Revision sources), against Azurite on loopback: the same verification, resume,
dedup and exit codes as from S3, through adlfs's client with weightcache's own retries."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published
from tests.integration.test_fetch_hit_miss import WITH_MODULES, measured
from tests.support.azurite import ACCOUNT, Azurite, connection_string, upload_dir
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_revision_ok,
    blobs_dir,
    describe,
    kill9_mid_download,
    markers,
)
from tests.support.faultproxy import FaultProxy
from tests.support.modelgen import MANIFEST, Model, make_model

MiB = 1024 * 1024
CONTAINER = "models"


@pytest.fixture
def container(azurite: Azurite) -> Any:
    return azurite.service().get_container_client(CONTAINER)


@pytest.fixture
def upload(container: Any, tmp_path: Path, uniq: str) -> Callable[..., tuple[Model, str]]:
    """`upload(shard_sizes, **make_model_kwargs) -> (model, "az://models/<uniq>/m/r1")`."""

    def _upload(sizes: list[int], **kwargs: Any) -> tuple[Model, str]:
        model = make_model(tmp_path / "src" / "m" / "r1", sizes, **kwargs)
        upload_dir(container, model.root, f"{uniq}/m/r1")
        return model, f"az://{CONTAINER}/{uniq}/m/r1"

    return _upload


def _env(azurite: Azurite, endpoint: str | None = None, key: str | None = None) -> dict[str, Any]:
    """The CLI's Azure environment: the emulator's connection string, nothing else."""
    conn = connection_string(endpoint or azurite.endpoint, *([key] if key else []))
    return {"AZURE_STORAGE_CONNECTION_STRING": conn, "AZURE_STORAGE_ACCOUNT_NAME": None,
            "AZURE_STORAGE_ACCOUNT_KEY": None, "AZURE_CLIENT_ID": None}  # fmt: skip


def _fetch_json(wc: CLI, source: str, cache_dir: Path, env: dict[str, Any], *extra: str) -> Any:
    proc = wc.fetch(source, cache_dir, "--no-daemon", "--json", *extra, env=env)
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)


def test_miss_then_hit_from_az_and_abfs(
    wc: CLI, azurite: Azurite, upload: Callable[..., tuple[Model, str]], cache_dir: Path
) -> None:
    model, url = upload([5 * MiB, 1 * MiB], extra_files={"sub/dir/extra.bin": b"x" * 999})
    env = _env(azurite)
    first = _fetch_json(wc, url, cache_dir, env, "--part-size", "2M")
    assert first["hit"] is False and first["bytes_from_origin"] == model.total_size, first
    assert_revision_ok(cache_dir, "m", "r1", model)
    marker = json.loads((cache_dir / "m" / "r1" / ".weightcache").read_text())
    assert marker["source"] == url
    again = _fetch_json(wc, url, cache_dir, env)
    assert again["hit"] is True and again["bytes_from_origin"] == 0, again
    # The abfs:// form of the same blobs: its account comes from the URL's host.
    abfs = url.replace(f"az://{CONTAINER}/", f"abfs://{CONTAINER}@{ACCOUNT}.dfs.core.windows.net/")
    other = _fetch_json(wc, abfs, cache_dir, env, "--revision", "r2")
    assert other["bytes_from_origin"] == 0, other  # same content: its blobs are here
    assert_revision_ok(cache_dir, "m", "r2", model)
    assert json.loads((cache_dir / "m" / "r2" / ".weightcache").read_text())["source"] == abfs


def test_a_hit_loads_no_azure_library_and_a_miss_no_boto(
    wc: CLI, azurite: Azurite, upload: Callable[..., tuple[Model, str]], cache_dir: Path
) -> None:
    """adlfs and the Azure SDK load on a miss of an az:// source only; boto3 never does."""
    _, url = upload([1024], small_files=False)
    env = _env(azurite)
    miss, hit = (_loaded(wc, url, cache_dir, env) for _ in range(2))
    assert {"adlfs", "azure", "fsspec"} <= miss and not {"boto3", "botocore"} & miss, miss
    assert not {"adlfs", "azure", "fsspec", "aiohttp", "boto3"} & hit, hit


def _loaded(wc: CLI, url: str, cache_dir: Path, env: dict[str, Any]) -> set[str]:
    """The top-level packages `fetch url` loaded, measured inside its own process."""
    args = ["fetch", url, "--cache-dir", str(cache_dir), "--no-daemon"]
    proc, modules = measured(wc, WITH_MODULES, args, env)
    assert proc.returncode == 0, describe(proc)
    return {m.split(".")[0] for m in modules}


@pytest.mark.timeout(180)
def test_kill9_then_resume(
    wc: CLI, azurite: Azurite, upload: Callable[..., tuple[Model, str]], cache_dir: Path
) -> None:
    model, url = upload([24 * MiB], small_files=False)
    env = _env(azurite)
    args = ("--no-daemon", "--part-size", "1M", "--max-concurrency", "4")
    running = wc.fetch_popen(url, cache_dir, *args, "--bwlimit", "3M", env=env)
    kill9_mid_download(running, cache_dir)
    resumed = _fetch_json(wc, url, cache_dir, env, *args[1:])
    assert_revision_ok(cache_dir, "m", "r1", model)
    # 2.5 s at 3 MiB/s is ~7 MiB; a kill loses at most the 4 parts in flight.
    assert int(resumed["bytes_from_origin"]) <= model.total_size - 2 * MiB, resumed


def test_a_corrupted_blob_is_exit_4_and_nothing_is_published(
    wc: CLI,
    azurite: Azurite,
    upload: Callable[..., tuple[Model, str]],
    container: Any,
    uniq: str,
    cache_dir: Path,
) -> None:
    model, url = upload([2 * MiB, 1 * MiB])
    bad = model.shard_names()[0]
    data = bytearray((model.root / bad).read_bytes())
    data[MiB] ^= 0xFF  # same size, one byte differs from what SHA256SUMS says
    container.upload_blob(f"{uniq}/m/r1/{bad}", bytes(data), overwrite=True)
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon", env=_env(azurite)), 4)
    assert "sha256 mismatch" in message and bad in message, message
    assert markers(cache_dir) == []
    assert not (cache_dir / "m" / "r1").exists()
    assert not (blobs_dir(cache_dir) / model.hashes[bad]).exists()
    assert_blobs_valid(cache_dir)


def test_a_missing_blob_or_prefix_is_exit_3(
    wc: CLI,
    azurite: Azurite,
    upload: Callable[..., tuple[Model, str]],
    container: Any,
    uniq: str,
    cache_dir: Path,
) -> None:
    _, url = upload([1 * MiB])
    container.delete_blob(f"{uniq}/m/r1/config.json")
    env = _env(azurite)
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon", env=env), 3)
    assert "config.json" in message and "missing" in message, message
    nothing = f"az://{CONTAINER}/{uniq}/nothing/here"
    message = assert_fails(wc.fetch(nothing, cache_dir, "--no-daemon", env=env), 3)
    assert f"no blobs under {nothing}/" in message, message
    no_container = f"az://absent-container/{uniq}/m/r1"
    message = assert_fails(wc.fetch(no_container, cache_dir, "--no-daemon", env=env), 3)
    assert "not found" in message and "ContainerNotFound" in message, message
    assert markers(cache_dir) == []


def test_without_a_manifest_content_md5_verifies_and_a_blob_without_one_is_exit_3(
    wc: CLI, azurite: Azurite, container: Any, upload: Callable[..., tuple[Model, str]],
    cache_dir: Path, uniq: str,
) -> None:  # fmt: skip
    """No SHA256SUMS: blobs put whole carry a Content-MD5, which the fetch checks as the bytes
    land (the marker says so); a blob committed from blocks has none, and then the fetch is
    exit 3 naming the command that makes a manifest."""
    model, url = upload([1 * MiB], manifest=False)
    proc = wc.fetch(url, cache_dir, "--no-daemon", env=_env(azurite))
    assert proc.returncode == 0, describe(proc)
    assert_revision_ok(cache_dir, "m", "r1", model)
    marker = json.loads((cache_dir / "m" / "r1" / ".weightcache").read_text())
    assert {f["verified"] for f in marker["files"].values()} == {"az:md5"}, marker
    client = container.get_blob_client(f"{uniq}/m2/r1/blocks.bin")
    client.stage_block("b0", b"x" * 70_000)
    client.commit_block_list(["b0"])
    bare = f"az://{CONTAINER}/{uniq}/m2/r1"
    message = assert_fails(wc.fetch(bare, cache_dir, "--no-daemon", env=_env(azurite)), 3)
    assert f"no {MANIFEST} at {bare}/{MANIFEST}" in message, message
    assert f"weightcache manifest {bare}/" in message, message


def test_a_wrong_key_is_exit_3_naming_the_credentials(
    wc: CLI, azurite: Azurite, upload: Callable[..., tuple[Model, str]], cache_dir: Path
) -> None:
    _, url = upload([1024])
    wrong = base64.b64encode(b"not the account key" * 3).decode()
    proc = wc.fetch(url, cache_dir, "--no-daemon", env=_env(azurite, key=wrong))
    message = assert_fails(proc, 3)
    assert "access denied (HTTP 403" in message, message
    assert "AZURE_STORAGE_CONNECTION_STRING" in message, message


def test_no_account_is_a_usage_error(wc: CLI, cache_dir: Path) -> None:
    env = {"AZURE_STORAGE_CONNECTION_STRING": None, "AZURE_STORAGE_ACCOUNT_NAME": None}
    proc = wc.fetch(f"az://{CONTAINER}/a/m/r1", cache_dir, "--no-daemon", env=env)
    message = assert_fails(proc, 2)
    assert "AZURE_STORAGE_ACCOUNT_NAME" in message, message


def test_server_busy_is_retried_by_weightcache_and_throttles(
    wc: CLI, azurite: Azurite, upload: Callable[..., tuple[Model, str]], cache_dir: Path
) -> None:
    """503s reach weightcache's retries (the SDK's are off): each is logged as an attempt,
    and the fetch completes."""
    model, url = upload([4 * MiB], small_files=False)
    with FaultProxy(azurite.endpoint, seed="azure-busy") as proxy:
        proxy.configure(scope="data", script=("slowdown", "slowdown", "slowdown"))
        env = _env(azurite, endpoint=proxy.url)
        proc = wc.fetch(url, cache_dir, "--no-daemon", "--part-size", "1M", env=env)
        assert proc.returncode == 0, describe(proc)
        assert proxy.stats().faults.get("slowdown") == 3
    assert proc.stderr.count("failed (HTTP 503") == 3, describe(proc)
    assert_revision_ok(cache_dir, "m", "r1", model)


def test_the_same_file_from_s3_and_from_azure_is_stored_once(
    wc: CLI,
    azurite: Azurite,
    publish: Callable[..., Published],
    container: Any,
    uniq: str,
    cache_dir: Path,
) -> None:
    pub = publish([2 * MiB, 1 * MiB], name="m", rev="r1")
    upload_dir(container, pub.model.root, f"{uniq}/m/r1")
    env = _env(azurite)
    first = _fetch_json(wc, pub.source, cache_dir, env)
    assert first["bytes_from_origin"] == pub.model.total_size, first
    url = f"az://{CONTAINER}/{uniq}/m/r1"
    second = _fetch_json(wc, url, cache_dir, env, "--revision", "from-azure")
    assert second["bytes_from_origin"] == 0, second
    assert_revision_ok(cache_dir, "m", "from-azure", pub.model)
    assert assert_blobs_valid(cache_dir) == len(set(pub.model.hashes.values()))


def test_manifest_prints_the_sums_of_an_azure_prefix(
    wc: CLI, azurite: Azurite, upload: Callable[..., tuple[Model, str]]
) -> None:
    model, url = upload([3 * MiB, 0, 100_000], manifest=False)
    proc = wc.run("manifest", url, "--part-size", "1M", env=_env(azurite))
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout == model.manifest_text


def test_vouches_for_the_content_md5_azure_holds(
    azurite: Azurite, container: Any, uniq: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob written in one Put Blob has a Content-MD5 (vouched for, as 32 lowercase hex
    digits); one committed from blocks has none (absent)."""
    from weightcache.transfer.backends.azure import AzureRevision

    single, blocks = b"one put" * 1000, [b"a" * 70_000, b"b" * 5]
    container.upload_blob(f"{uniq}/m/r1/single.bin", single)
    client = container.get_blob_client(f"{uniq}/m/r1/sub/blocks.bin")
    ids = [uuid.uuid4().hex for _ in blocks]
    for block_id, data in zip(ids, blocks, strict=True):
        client.stage_block(block_id, data)
    client.commit_block_list(ids)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    revision = AzureRevision(f"az://{CONTAINER}/{uniq}/m/r1", CONTAINER, f"{uniq}/m/r1", 30.0)
    assert revision.list_sizes() == {"single.bin": len(single), "sub/blocks.bin": 70_005}
    assert revision.vouches() == {"single.bin": ("md5", hashlib.md5(single).hexdigest())}
