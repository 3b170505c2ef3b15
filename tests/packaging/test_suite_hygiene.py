"""The test suite cleans up after itself: a passing test's temporary directory goes at once
(the suite writes models of tens of MiB into hundreds of them), so a run does not leave
gigabytes in pytest's base temporary directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_a_passing_tests_tmp_path_is_removed_a_failing_ones_kept(tmp_path: Path) -> None:
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_writes.py").write_text(
        "def test_passes(tmp_path):\n"
        "    (tmp_path / 'model').write_bytes(b'x' * 4096)\n"
        "def test_fails(tmp_path):\n"
        "    (tmp_path / 'model').write_bytes(b'x' * 4096)\n"
        "    assert False\n"
    )
    basetemp = tmp_path / "basetemp"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path / "suite"), "-p", "no:cacheprovider", "-p", "no:xdist",
         "-q", f"--basetemp={basetemp}", str(tmp_path / "suite")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path / "suite",
    )  # fmt: skip
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    left = sorted(p.name for p in basetemp.iterdir() if not p.is_symlink())
    assert left == ["test_fails0"], left
