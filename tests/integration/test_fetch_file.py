"""A revision in a directory on a mounted filesystem (file:///path or /path, design §4,
Revision sources): the same verification, resume and dedup as from S3, no store involved."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
    kill9_mid_download,
    markers,
    mounted_tmpfs,
)
from tests.support.modelgen import MANIFEST, Model, make_model

MiB = 1024 * 1024


def _model(tmp_path: Path, sizes: list[int], **kwargs: object) -> Model:
    """A model at tmp_path/volume/llama/v1, as a PVC would hold it."""
    return make_model(tmp_path / "volume" / "llama" / "v1", sizes, **kwargs)  # type: ignore[arg-type]


def _fetch_json(wc: CLI, source: str, cache_dir: Path, *extra: str) -> dict[str, object]:
    proc = wc.fetch(source, cache_dir, "--no-daemon", "--json", *extra)
    assert proc.returncode == 0, describe(proc)
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_miss_then_hit_from_a_file_url(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    model = _model(tmp_path, [3 * MiB, 1 * MiB], extra_files={"sub/dir/extra.bin": b"x" * 999})
    url = f"file://{model.root}"
    first = _fetch_json(wc, url, cache_dir, "--part-size", "256K")
    assert first["hit"] is False and first["bytes_from_origin"] == model.total_size, first
    assert_revision_ok(cache_dir, "llama", "v1", model)
    marker = json.loads((cache_dir / "llama" / "v1" / ".weightcache").read_text())
    assert marker["source"] == url
    again = _fetch_json(wc, url, cache_dir)
    assert again["hit"] is True and again["bytes_from_origin"] == 0, again


def test_a_plain_absolute_path_is_the_same_source(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    model = _model(tmp_path, [2 * MiB])
    proc = wc.fetch(f"{model.root}/", cache_dir, "--no-daemon")
    assert_ok_path(proc, cache_dir / "llama" / "v1")
    assert_revision_ok(cache_dir, "llama", "v1", model)
    # The marker records file:///...: the URL form is a hit of the same revision.
    assert _fetch_json(wc, f"file://{model.root}", cache_dir)["hit"] is True
    named = _fetch_json(wc, str(model.root), cache_dir, "--name", "other", "--revision", "r9")
    assert named["bytes_from_origin"] == 0  # its blobs are already here
    assert_revision_ok(cache_dir, "other", "r9", model)


def test_a_volume_on_another_filesystem(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    """A PVC is never the cache's filesystem: its files are copied and verified, not linked
    or renamed across devices (which would fail with EXDEV)."""
    with mounted_tmpfs(tmp_path / "pvc", "16m") as volume:
        model = make_model(volume / "llama" / "v1", [3 * MiB, 1 * MiB])
        assert os.stat(volume).st_dev != os.stat(cache_dir.parent).st_dev
        first = _fetch_json(wc, f"file://{model.root}", cache_dir, "--part-size", "256K")
        assert first["hit"] is False and first["bytes_from_origin"] == model.total_size, first
        assert_revision_ok(cache_dir, "llama", "v1", model)
        assert assert_blobs_valid(cache_dir) == len({f.sha256 for f in model.files})
    # The volume is gone (unmounted): the revision is a hit from the cache's own disk.
    assert _fetch_json(wc, f"file://{model.root}", cache_dir)["hit"] is True


@pytest.mark.timeout(180)
def test_kill9_then_resume(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    model = _model(tmp_path, [24 * MiB], small_files=False)
    args = ("--no-daemon", "--part-size", "1M", "--max-concurrency", "4")
    running = wc.fetch_popen(str(model.root), cache_dir, *args, "--bwlimit", "3M")
    kill9_mid_download(running, cache_dir)
    resumed = _fetch_json(wc, str(model.root), cache_dir, *args)
    assert_revision_ok(cache_dir, "llama", "v1", model)
    # 2.5 s at 3 MiB/s is ~7 MiB; a kill loses at most the 4 parts in flight.
    assert int(str(resumed["bytes_from_origin"])) <= model.total_size - 2 * MiB, resumed


def test_a_corrupted_file_is_exit_4_and_nothing_is_published(
    wc: CLI, tmp_path: Path, cache_dir: Path
) -> None:
    model = _model(tmp_path, [2 * MiB, 1 * MiB])
    bad = model.shard_names()[0]
    with open(model.root / bad, "r+b") as f:  # same size, one byte differs
        f.seek(MiB)
        byte = f.read(1)
        f.seek(MiB)
        f.write(bytes([byte[0] ^ 0xFF]))
    message = assert_fails(wc.fetch(str(model.root), cache_dir, "--no-daemon"), 4)
    assert "sha256 mismatch" in message and bad in message, message
    assert markers(cache_dir) == []
    assert not (cache_dir / "llama" / "v1").exists()
    assert not (blobs_dir(cache_dir) / model.hashes[bad]).exists()
    assert_blobs_valid(cache_dir)


def test_a_missing_file_is_exit_3(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    model = _model(tmp_path, [1 * MiB])
    (model.root / "config.json").unlink()
    message = assert_fails(wc.fetch(str(model.root), cache_dir, "--no-daemon"), 3)
    assert "config.json" in message and "missing" in message, message
    assert markers(cache_dir) == []


def test_no_manifest_is_exit_3_saying_how_to_make_one(
    wc: CLI, tmp_path: Path, cache_dir: Path
) -> None:
    model = _model(tmp_path, [1 * MiB], manifest=False)
    message = assert_fails(wc.fetch(f"file://{model.root}", cache_dir, "--no-daemon"), 3)
    assert f"no {MANIFEST} at file://{model.root}/{MANIFEST}" in message, message
    command = f"weightcache manifest {model.root} > {model.root}/{MANIFEST}"
    assert f"`{command}`" in message, message
    # what that command does, and then the fetch works
    made = wc.run("-q", "manifest", model.root)
    assert made.returncode == 0, made.stderr
    (model.root / MANIFEST).write_text(made.stdout)
    assert_ok_path(wc.fetch(f"file://{model.root}", cache_dir, "--no-daemon"),
                   cache_dir / model.root.parent.name / model.root.name)  # fmt: skip


def test_a_missing_directory_is_exit_3(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    message = assert_fails(wc.fetch(str(tmp_path / "nope" / "m" / "v1"), cache_dir), 3)
    assert "mounted" in message, message


def test_a_symlink_out_of_the_directory_is_refused(
    wc: CLI, tmp_path: Path, cache_dir: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not a model file")
    model = _model(tmp_path, [1 * MiB])
    (model.root / "inside.json").symlink_to(model.root / "config.json")  # stays in: fine
    (model.root / "leak.txt").symlink_to(secret)
    message = assert_fails(wc.fetch(str(model.root), cache_dir, "--no-daemon"), 3)
    assert "leak.txt" in message and "outside" in message, message
    (model.root / "leak.txt").unlink()
    proc = wc.fetch(str(model.root), cache_dir, "--no-daemon")
    assert proc.returncode == 0, describe(proc)


def _plant(path: Path, what: str) -> None:
    """Put at `path` what a volume may hold instead of a small regular file."""
    path.unlink(missing_ok=True)
    if what == "fifo":
        os.mkfifo(path)  # no writer: a plain open() waits forever
    elif what == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero: endless
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")
    else:
        with open(path, "wb") as f:
            f.truncate(100 * MiB)  # sparse: 100 MiB of zeros on no disk


@pytest.mark.timeout(180)
@pytest.mark.parametrize("what", ["fifo", "device", "huge"])
def test_a_manifest_that_is_no_small_regular_file_is_exit_3_at_once(
    wc: CLI, tmp_path: Path, cache_dir: Path, what: str
) -> None:
    model = _model(tmp_path, [64 * 1024])
    _plant(model.root / MANIFEST, what)
    proc = wc.fetch(f"file://{model.root}", cache_dir, "--no-daemon", timeout=90)
    message = assert_fails(proc, 3)
    assert f"file://{model.root}/{MANIFEST}" in message, message
    expected = "more than 64 MiB" if what == "huge" else "not a regular file"
    assert expected in message, message
    assert markers(cache_dir) == []


@pytest.mark.timeout(180)
def test_a_weight_file_that_is_not_a_regular_file_is_refused(
    wc: CLI, tmp_path: Path, cache_dir: Path
) -> None:
    model = _model(tmp_path, [64 * 1024, 64 * 1024])
    _plant(model.root / model.files[0].relpath, "fifo")  # listed in SHA256SUMS
    proc = wc.fetch(f"file://{model.root}", cache_dir, "--no-daemon", timeout=90)
    message = assert_fails(proc, 3)
    assert model.files[0].relpath in message and "not a regular file" in message, message


def test_a_symlink_loop_is_exit_3_naming_it(wc: CLI, tmp_path: Path, cache_dir: Path) -> None:
    model = _model(tmp_path, [64 * 1024])
    (model.root / "a.bin").symlink_to("b.bin")
    (model.root / "b.bin").symlink_to("a.bin")
    message = assert_fails(wc.fetch(str(model.root), cache_dir, "--no-daemon"), 3)
    assert "a.bin" in message and "symbolic links" in message, message


@pytest.mark.parametrize(
    "source", ["file://host/m/llama/v1", "relative/llama/v1", "/m/../llama/v1", "/v1"]
)
def test_bad_paths_are_usage_errors(wc: CLI, cache_dir: Path, source: str) -> None:
    message = assert_fails(wc.fetch(source, cache_dir, "--no-daemon"), 2)
    assert "file:///path/<name>/<revision>" in message, message


def test_the_same_file_from_s3_and_from_a_directory_is_stored_once(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([2 * MiB, 1 * MiB], name="m", rev="r1")  # also on disk at pub.model.root
    assert _fetch_json(wc, pub.source, cache_dir)["bytes_from_origin"] == pub.model.total_size
    local = _fetch_json(wc, str(pub.model.root), cache_dir, "--revision", "from-disk")
    assert local["bytes_from_origin"] == 0, local
    assert_revision_ok(cache_dir, "m", "r1", pub.model)
    assert_revision_ok(cache_dir, "m", "from-disk", pub.model)
    assert assert_blobs_valid(cache_dir) == len(set(pub.model.hashes.values()))


def test_publish_to_a_directory_is_refused(wc: CLI, tmp_path: Path) -> None:
    model = _model(tmp_path, [1024])
    message = assert_fails(wc.run("publish", model.root, f"file://{tmp_path}/out/m/v1"), 2)
    assert "s3:// only" in message, message


def test_manifest_hashes_a_directory_in_place_and_writes_only_to_s3(
    wc: CLI, tmp_path: Path
) -> None:
    """`manifest` reads a directory through the same revision source as a fetch; its
    SHA256SUMS is printed (the directory may be a read-only volume), never written."""
    model = _model(tmp_path, [3 * MiB, 0, 100_000])
    (model.root / MANIFEST).unlink()
    proc = wc.run("manifest", f"file://{model.root}", "--part-size", "1M")
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout == model.manifest_text
    refused = wc.run("manifest", str(model.root), "--write")
    assert refused.returncode == 2, describe(refused)
    assert "s3:// only" in refused.stderr and not (model.root / MANIFEST).exists()
