"""Assertions on the real on-disk cache tree and on the CLI's output, per design §2.2 and §3.

Layout under test (the contract, not the implementation):
    DIR/<name>/<rev>/...                 the files, hard links to blobs
    DIR/<name>/<rev>/.weightcache        completion marker (JSON)
    DIR/.weightcache/blobs/sha256/<hex>  content-addressed blobs
    DIR/.weightcache/tmp/                partial downloads
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.modelgen import MANIFEST, Model, sha256_file

if TYPE_CHECKING:
    from tests.conftest import Running

MARKER = ".weightcache"
ERROR_PREFIX = "weightcache: error: "


def blobs_dir(cache_dir: Path) -> Path:
    return cache_dir / MARKER / "blobs" / "sha256"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(ERROR_PREFIX)]


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    """The process's exit code and output, for assertion messages."""
    return (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n"
        f"{proc.stderr[-6000:]}"
    )


def assert_fails(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """Exit `code`, exactly one `weightcache: error: ` line, no traceback, nothing on
    stdout; returns the message (without the prefix)."""
    assert proc.returncode == code, describe(proc)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, f"expected one error line\n{describe(proc)}"
    assert "Traceback" not in proc.stderr, describe(proc)
    assert proc.stdout == "", describe(proc)
    message = lines[0][len(ERROR_PREFIX) :]
    assert len(message) > 15, f"error message too short to help: {message!r}"
    return message


def assert_ok_path(proc: subprocess.CompletedProcess[str], expected: Path) -> Path:
    """Exit 0 and stdout is exactly one line: the revision's path."""
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1, describe(proc)
    printed = Path(proc.stdout.rstrip("\n"))
    assert printed.is_absolute(), describe(proc)
    assert os.path.realpath(printed) == os.path.realpath(expected), describe(proc)
    return printed


def revision_files(rev_dir: Path) -> dict[str, Path]:
    """Regular files under a revision directory (relative posix path -> path), marker
    excluded."""
    out = {}
    for p in rev_dir.rglob("*"):
        rel = p.relative_to(rev_dir).as_posix()
        if rel == MARKER or p.is_dir():
            continue
        out[rel] = p
    return out


def assert_revision_ok(cache_dir: Path, name: str, rev: str, model: Model) -> None:
    """Design §3 invariant 1 on one revision: a JSON marker, exactly the manifest's files
    (a copy of SHA256SUMS itself is tolerated if it is byte-identical), each with the
    manifest's size and sha256, all regular files (not symlinks)."""
    rev_dir = cache_dir / name / rev
    marker = rev_dir / MARKER
    assert marker.is_file(), f"no marker at {marker}"
    json.loads(marker.read_text())
    files = revision_files(rev_dir)
    if MANIFEST in files and MANIFEST not in model.hashes:
        assert files.pop(MANIFEST).read_text() == model.manifest_text
    assert sorted(files) == sorted(model.hashes), f"files in {rev_dir} differ from manifest"
    for rel, path in files.items():
        assert not path.is_symlink(), f"{path} is a symlink"
        assert path.stat().st_size == model.sizes[rel], f"size of {path}"
        assert sha256_file(path) == model.hashes[rel], f"sha256 of {path}"


def assert_linked_to_blobs(cache_dir: Path, name: str, rev: str, model: Model) -> None:
    """Every file of the revision is a hard link to DIR/.weightcache/blobs/sha256/<hex>."""
    rev_dir = cache_dir / name / rev
    for rel, digest in model.hashes.items():
        blob = blobs_dir(cache_dir) / digest
        assert blob.is_file(), f"no blob {blob} for {rel}"
        assert os.path.samefile(rev_dir / rel, blob), f"{rel} is not a hard link to {blob}"


def markers(cache_dir: Path) -> list[Path]:
    """Completion markers of revisions: DIR/<name>/<rev>/.weightcache files."""
    if not cache_dir.is_dir():
        return []
    return sorted(
        p for p in cache_dir.glob(f"*/*/{MARKER}") if p.is_file() and p.parts[-3] != MARKER
    )


def assert_blobs_valid(cache_dir: Path) -> int:
    """Every published blob's content hashes to its name; returns how many there are."""
    blobs = blobs_dir(cache_dir)
    if not blobs.is_dir():
        return 0
    count = 0
    for blob in blobs.iterdir():
        assert sha256_file(blob) == blob.name, f"blob {blob} does not match its name"
        count += 1
    return count


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of everything under `root` (links not followed)."""
    out = {}
    if root.exists():
        for p in root.rglob("*"):
            st = p.lstat()
            out[p.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


def kill9_mid_download(running: Running, cache_dir: Path, seconds: float = 2.5) -> None:
    """Let the fetch `running` download for `seconds` after its first partial appears in
    `cache_dir`, then kill -9 it; asserts it was still running and marked nothing."""
    tmp = cache_dir / ".weightcache" / "tmp"
    started = None
    while started is None or time.monotonic() - started < seconds:
        assert running.poll() is None, running.finish().stderr
        if started is None and any(tmp.glob("*.part")):
            started = time.monotonic()
        time.sleep(0.02)
    running.kill9()
    assert markers(cache_dir) == []


@contextlib.contextmanager
def mounted(mountpoint: Path, *source: str) -> Iterator[Path]:
    """`mount *source mountpoint` (mountpoint created), unmounted after (lazily if busy).
    Skips the test without root or when mount(2) fails here."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(f"mounting {' '.join(source)} needs root")
    proc = subprocess.run(["mount", *source, str(mountpoint)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount {' '.join(source)} here: {proc.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def mounted_tmpfs(mountpoint: Path, size: str) -> contextlib.AbstractContextManager[Path]:
    """A tmpfs of `size` (mount's units: 48m) at `mountpoint`: a small disk for ENOSPC, or
    a filesystem other than the cache's (see `mounted`)."""
    return mounted(mountpoint, "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs")
