"""A cache lives on one filesystem (design §3): a volume mounted inside it, at tmp/ or at a
model's directory, makes every rename and link between them EXDEV. fetch, gc and the
daemon say so in one line naming the directory (exit 2), never a traceback."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import CLI, dead_endpoint
from tests.integration.daemon_helpers import (  # noqa: F401
    Daemons,
    daemons,
    write_models,
)
from tests.support.checks import assert_fails, assert_ok_path, mounted_tmpfs
from tests.support.modelgen import Model, make_model

KiB = 1024


def _refused(proc: subprocess.CompletedProcess[str], directory: Path) -> None:
    """Exit 2, one line naming `directory` as on another filesystem."""
    message = assert_fails(proc, 2)
    assert str(directory) in message and "another filesystem" in message, message


def _model(tmp_path: Path) -> Model:
    return make_model(tmp_path / "volume" / "mounted" / "v1", [64 * KiB])


@pytest.mark.timeout(180)
def test_a_tmp_on_another_filesystem_is_exit_2_naming_it(
    wc: CLI, tmp_path: Path, cache_dir: Path, daemons: Daemons  # noqa: F811
) -> None:  # fmt: skip
    model = _model(tmp_path)
    tmp = cache_dir / ".weightcache" / "tmp"
    with mounted_tmpfs(tmp, "16m"):
        _refused(wc.fetch(str(model.root), cache_dir, "--no-daemon"), tmp)

        _refused(wc.run("gc", "--capacity", "1B", "--cache-dir", cache_dir), tmp)

        daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", []),
                               endpoint=dead_endpoint(), wait=False)  # fmt: skip
        assert daemon.proc.wait(timeout=60) == 2, daemon.log()
        assert str(tmp) in daemon.log() and "Traceback" not in daemon.log(), daemon.log()


@pytest.mark.timeout(180)
def test_a_model_directory_on_another_filesystem_is_exit_2_naming_it(
    wc: CLI, tmp_path: Path, cache_dir: Path, daemons: Daemons  # noqa: F811
) -> None:  # fmt: skip
    model = _model(tmp_path)
    assert_ok_path(wc.fetch(str(model.root), cache_dir, "--no-daemon"),
                   cache_dir / "mounted" / "v1")  # fmt: skip
    saved = tmp_path / "saved"
    shutil.move(cache_dir / "mounted", saved)
    name_dir = cache_dir / "mounted"
    with mounted_tmpfs(name_dir, "16m"):
        # gc meets the revision (copied there) on the other filesystem.
        shutil.copytree(saved / "v1", name_dir / "v1")
        _refused(wc.run("gc", "--capacity", "1B", "--cache-dir", cache_dir), name_dir)
        shutil.rmtree(name_dir / "v1")

        _refused(wc.fetch(str(model.root), cache_dir, "--no-daemon"), name_dir)

        models = write_models(tmp_path / "models.yaml", [])
        daemon = daemons.start(cache_dir, models, endpoint=dead_endpoint(),
                               allow_source=[str(model.root)])  # fmt: skip
        _refused(wc.fetch(str(model.root), cache_dir), name_dir)
        assert daemon.alive(), daemon.log()
        assert "Traceback" not in daemon.log(), daemon.log()
