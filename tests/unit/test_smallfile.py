"""read_small: a small file read back from the cache, as anyone with write access to the
cache may have planted it."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from weightcache.smallfile import chmod_own, read_small


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


@pytest.mark.parametrize("most", [None, 1, 3], ids=["whole-reads", "1-byte-reads", "3-byte-reads"])
def test_a_file_that_grows_past_the_limit_while_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, most: int | None
) -> None:
    """The size fstat gave is no bound: the file grows right after it (a writer at work),
    and reads may return fewer bytes than asked (FUSE, NFS)."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8)  # under the limit when looked at
    real_fstat, real_read = os.fstat, os.read

    def fstat_then_grow(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        with path.open("ab") as f:
            f.write(b"y" * 8)
        return st

    def short_read(fd: int, n: int) -> bytes:
        return real_read(fd, n if most is None else min(n, most))

    with monkeypatch.context() as m:
        m.setattr(os, "fstat", fstat_then_grow)
        m.setattr(os, "read", short_read)
        with pytest.raises(ValueError, match="more than 10 bytes"):
            read_small(path, 10)
    path.write_bytes(b"x" * 10)  # exactly the limit, in short reads: read whole
    with monkeypatch.context() as m:
        m.setattr(os, "read", short_read)
        assert read_small(path, 10) == b"x" * 10


def test_no_descriptor_is_left_open_whatever_the_outcome(tmp_path: Path) -> None:
    """The daemon reads markers all its life: one leaked descriptor per read exhausts it."""
    (tmp_path / "ok").write_bytes(b"x")
    (tmp_path / "big").write_bytes(b"x" * 11)
    os.mkfifo(tmp_path / "fifo")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert read_small(tmp_path / "ok", 10) == b"x"
        for name in ("big", "fifo"):
            with pytest.raises(ValueError):
                read_small(tmp_path / name, 10)
    assert len(os.listdir("/proc/self/fd")) == before


def test_chmod_own_changes_the_socket_never_what_a_symlink_leads_to(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the daemon's")
    victim.chmod(0o600)
    path = tmp_path / "daemon.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        chmod_own(path, 0o666, stat.S_IFSOCK)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666
        path.unlink()
        path.symlink_to(victim)  # put in its place between bind and chmod
        with pytest.raises(ValueError, match="not what was made there"):
            chmod_own(path, 0o666, stat.S_IFSOCK)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
