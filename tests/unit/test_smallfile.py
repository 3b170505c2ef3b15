"""read_small: a small file read back from the cache, as anyone with write access to the
cache may have planted it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightcache.smallfile import read_small


def test_a_regular_file_is_read_whole_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_small(path, 10) == b"x" * 10
    path.write_bytes(b"")
    assert read_small(path, 10) == b""


def test_a_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match="more than 10 bytes"):
        read_small(path, 10)


@pytest.mark.timeout(10)
def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "f"
    os.mkfifo(path)  # no writer: a plain open() would block forever
    with pytest.raises(ValueError, match="not a regular file"):
        read_small(path, 10)


def test_a_symlink_is_refused_even_to_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"ok")
    (tmp_path / "f").symlink_to(tmp_path / "real")
    (tmp_path / "zero").symlink_to("/dev/zero")  # would fill memory if followed
    for name in ("f", "zero"):
        with pytest.raises(ValueError, match="symbolic link"):
            read_small(tmp_path / name, 10)


def test_a_directory_is_refused_and_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a regular file"):
        read_small(tmp_path, 10)
    with pytest.raises(FileNotFoundError):
        read_small(tmp_path / "absent", 10)
