"""Progress (design §4): a bar on a TTY, periodic structured log lines otherwise; stdout
keeps only the path either way."""

from __future__ import annotations

import os
import pty
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, cli_env

MiB = 1024 * 1024
pytestmark = pytest.mark.timeout(120)


def test_log_lines_when_stderr_is_not_a_tty(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([2 * MiB, 2 * MiB], name="prog", rev="r1")
    # 4 MiB at 2 MiB/s: about two seconds, several reports at a 0.3 s interval.
    done = wc.fetch(pub.source, cache_dir, "--bwlimit", "2M", "--part-size", "1M",
                    "--progress-interval", "0.3s")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{pub.local_path(cache_dir)}\n"
    lines = [line for line in done.stderr.splitlines() if "progress revision=prog/r1" in line]
    assert len(lines) >= 3, done.stderr
    total = pub.model.total_size
    assert all(f" total={total} " in line and "rate_bps=" in line for line in lines), lines
    seen = [int(line.split(" bytes=")[1].split()[0]) for line in lines]
    assert seen == sorted(seen) and seen[0] < seen[-1] <= total, seen


def test_bar_when_stderr_is_a_tty(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([1 * MiB, 1 * MiB], name="bar", rev="r1")
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            wc.argv(*CLI.fetch_args(pub.source, cache_dir, "--bwlimit", "2M", endpoint=None)),
            env=cli_env(wc.store),
            stdout=subprocess.PIPE,
            stderr=slave,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )
        os.close(slave)
        slave = -1
        shown = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        if slave != -1:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0
    assert proc.stdout.decode() == f"{pub.local_path(cache_dir)}\n"
    text = shown.decode(errors="replace")
    assert "bar/r1 [" in text and "100.0%" in text, text
    # The bar's line ends before a log line starts: no log line is
    # written onto the end of the bar.
    lines = text.replace("\r\n", "\n").split("\n")
    logged = [line for line in lines if "INFO weightcache" in line]
    assert any("ready bar/r1 at" in line for line in logged), text
    assert all(re.match(r"\d{4}-\d\d-\d\d ", line) for line in logged), logged
