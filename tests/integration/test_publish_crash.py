"""Publishing survives a failure or a crash at every one of its steps (design §3 inv. 1, 2).

A fetch runs in-process against the real store with a `FileOps` that fails at its n-th
filesystem call, for every n of a clean publish: once with an error (then the cleanup
runs) and once with a simulated kill -9 (that call and every later one fail, so nothing
is cleaned up: the disk is left as the kill would leave it). After each, no revision
carries a marker unless it is complete and verified, and the next fetch completes with
the right bytes. This replaces the random kill timing that found a marker written before
the links only 2 runs in 9.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Published
from tests.support.checks import assert_blobs_valid, assert_revision_ok
from tests.support.modelgen import sha256_file
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache, FileOps
from weightcache.config import OriginSettings
from weightcache.fetch import Fetcher
from weightcache.sourceurl import Source

KiB = 1024
pytestmark = pytest.mark.timeout(300)


class Crash(BaseException):
    """The process died here: not an OSError, so no `except OSError` or ignore_errors
    cleanup swallows it."""


class RecordingOps(FileOps):
    """Real filesystem calls that fail at call number `fail_at` (1-based; 0: never).

    `crash`: that call and every later one raise Crash (a kill: nothing after it reaches
    the disk); otherwise only that call raises EIO and the code's cleanup runs.
    """

    def __init__(self, fail_at: int = 0, crash: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at
        self.crash = crash

    def _step(self, what: str) -> None:
        self.calls.append(re.sub(r"-[0-9a-f]{16}\b", "-<random>", what))
        n = len(self.calls)
        if self.crash and self.fail_at and n >= self.fail_at:
            raise Crash(f"killed at step {n} ({what})")
        if n == self.fail_at:
            raise OSError(errno.EIO, f"injected failure at step {n} ({what})")

    def mkdir(self, path: Path, exist_ok: bool = False) -> None:
        self._step(f"mkdir {path.name}")
        super().mkdir(path, exist_ok)

    def link(self, src: Path, dst: Path) -> bool:
        self._step(f"link {dst.name}")
        return super().link(src, dst)

    def write_durably(self, path: Path, text: str) -> None:
        self._step(f"write {path.name}")
        super().write_durably(path, text)

    def fsync_dir(self, path: Path) -> None:
        self._step(f"fsync_dir {path.name}")
        super().fsync_dir(path)

    def chmod(self, path: Path, mode: int) -> None:
        self._step(f"chmod {path.name}")
        super().chmod(path, mode)

    def rename(self, src: Path, dst: Path) -> None:
        self._step(f"rename {src.name} -> {dst.name}")
        super().rename(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        self._step(f"replace {src.name}")
        super().replace(src, dst)

    def unlink(self, path: Path) -> None:
        self._step(f"unlink {path.name}")
        super().unlink(path)

    def rmtree(self, path: Path) -> None:
        self._step(f"rmtree {path.name}")
        super().rmtree(path)


@pytest.fixture
def aws_env(store: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[OriginSettings]:
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    yield OriginSettings(endpoint_url=store.endpoint_url, part_size=256 * KiB, max_attempts=2)


def _fetcher(settings: OriginSettings) -> Callable[[Path, Source, FileOps], None]:
    """fetch(cache_dir, source, ops), sharing one downloader (one boto3 client) between
    the many fetches of a test."""
    from weightcache.transfer.backends.s3.client import Origin
    from weightcache.transfer.downloader import RangedDownloader

    downloader, origin = RangedDownloader(settings), Origin(settings)

    def fetch(cache_dir: Path, source: Source, ops: FileOps) -> None:
        layout = Layout.open(cache_dir)
        cache = Cache(layout, ops)
        Fetcher(layout, settings, downloader=downloader, cache=cache, origin=origin).fetch(source)

    return fetch


def _assert_no_marker_on_an_incomplete_revision(cache_dir: Path, step: str) -> None:
    """Every revision with a marker holds exactly the marker's files, each verified."""
    layout = Layout.open(cache_dir)
    store = Cache(layout)
    for name, revision in layout.revisions():
        marker = store.read_marker(name, revision)
        if marker is None:
            continue
        root = layout.revision_dir(name, revision)
        on_disk = {
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.is_file() and p.name != ".weightcache"
        }
        assert on_disk == set(marker.files), f"after {step}: marked {name}/{revision} misses files"
        for path, (sha256, size) in marker.files.items():
            assert os.stat(root / path).st_size == size, f"after {step}: size of {path}"
            assert sha256_file(root / path) == sha256, f"after {step}: sha256 of {path}"


def _damage(cache_dir: Path, pub: Published) -> None:
    """A fetched revision with one file truncated (so the fetch repairs and replaces it)."""
    os.truncate(pub.local_path(cache_dir) / pub.model.shard_names()[0], 10)


@pytest.mark.parametrize("crash", [False, True], ids=["error", "kill"])
@pytest.mark.parametrize("start", ["empty", "damaged"])
def test_a_failure_at_every_publishing_step_leaves_no_false_marker(
    publish: Callable[..., Published],
    aws_env: OriginSettings,
    tmp_path: Path,
    crash: bool,
    start: str,
) -> None:
    pub = publish([300 * KiB], name="crash", rev="r1", seed="crash", small_files=False,
                  extra_files={"sub/dir/extra.bin": b"extra" * 100})  # fmt: skip
    source = Source.parse(pub.source)
    _fetch = _fetcher(aws_env)

    def prepare(cache_dir: Path) -> None:
        if start == "damaged":
            _fetch(cache_dir, source, FileOps())
            _damage(cache_dir, pub)

    clean = RecordingOps()
    prepare(tmp_path / "clean")
    _fetch(tmp_path / "clean", source, clean)
    assert_revision_ok(tmp_path / "clean", pub.name, pub.rev, pub.model)
    steps = clean.calls
    assert any(s.startswith("link") for s in steps) and any(s.startswith("write") for s in steps)

    for n, step in enumerate(steps, 1):
        cache_dir = tmp_path / f"cache-{n}"
        prepare(cache_dir)
        ops = RecordingOps(fail_at=n, crash=crash)
        with pytest.raises((OSError, Crash)):
            _fetch(cache_dir, source, ops)
        label = f"{'kill' if crash else 'error'} at step {n}/{len(steps)} ({step})"
        assert ops.calls[n - 1] == step, f"{label}: the steps differ from the clean run"
        _assert_no_marker_on_an_incomplete_revision(cache_dir, label)

        _fetch(cache_dir, source, FileOps())  # the next fetch completes
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
        assert_blobs_valid(cache_dir)
