"""The models file (design §2.3): missing or invalid, it is a usage error
(exit 2) for `prefetch` and for a daemon starting; a running daemon whose file vanishes or
turns invalid keeps its last good state and says so once, not at every reload."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    entry,
    is_marked,
    ls_json,
    wait_for,
    write_models,
)
from tests.support.checks import assert_fails
from tests.support.faultproxy import FaultProxy

INVALID_YAML = "models:\n  - source: s3://models/a/b\n   pin: [true\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("problem", ["invalid", "missing"])
def test_prefetch_with_an_unusable_models_file_exits_2(
    wc: CLI, proxy: FaultProxy, cache_dir: Path, tmp_path: Path, problem: str
) -> None:
    models = tmp_path / "models.yaml"
    if problem == "invalid":
        models.write_text(INVALID_YAML)
    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models,
                  "--endpoint-url", proxy.url)  # fmt: skip
    message = assert_fails(proc, 2)
    assert str(models) in message, message
    assert ("not valid YAML" if problem == "invalid" else "cannot read") in message, message


@pytest.mark.timeout(60)
def test_daemon_without_its_models_file_exits_2_at_once(
    proxy: FaultProxy, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    models = tmp_path / "absent" / "models.yaml"
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, wait=False)
    code = daemon.wait(timeout=30)
    stderr = daemon.stderr_path.read_text()
    proc = subprocess.CompletedProcess(daemon.args, code, "", stderr)
    message = assert_fails(proc, 2)
    assert f"cannot read the models file {models}" in message, message
    assert stderr.strip() == f"weightcache: error: {message}", stderr
    assert not (cache_dir / ".weightcache" / "daemon.sock").exists()


@pytest.mark.timeout(150)
def test_daemon_keeps_the_last_good_models_file_and_says_so_once(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    a = publish([1 * MiB], name="alpha", rev="r1", seed="alpha")
    b = publish([1 * MiB], name="beta", rev="r1", seed="beta")
    models = write_models(tmp_path / "models.yaml", [entry(a, pin=True)])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url)  # reloads every 0.5 s
    wait_for("alpha to be prefetched", daemon.pins_ready, timeout=60)

    def count(text: str) -> int:
        return daemon.log().count(text)

    def still_the_last_good_state() -> None:
        assert daemon.alive(), daemon.log()
        assert daemon.pins_ready(), daemon.log()
        assert ls_json(wc, cache_dir)[(a.name, a.rev)]["pinned"] is True
        assert daemon.get("/healthz")[0] == 200, daemon.log()

    # The ConfigMap's file vanishes: logged once, however many reloads follow.
    models.unlink()
    gone = f"cannot read the models file {models}"
    wait_for("the vanished file to be logged", lambda: count(gone) >= 1, timeout=30)
    time.sleep(4)  # about 8 more reloads
    assert count(gone) == 1, daemon.log()
    still_the_last_good_state()

    # It comes back invalid: a new error, logged once too.
    models.write_text(INVALID_YAML)
    wait_for("the invalid file to be logged", lambda: count("is not valid YAML") >= 1, timeout=30)
    time.sleep(4)
    assert count("is not valid YAML") == 1, daemon.log()
    assert count(gone) == 1, daemon.log()
    still_the_last_good_state()

    # Valid again, with one more model: the daemon follows it.
    write_models(models, [entry(a, pin=True), entry(b)])
    wait_for("beta to be prefetched", lambda: is_marked(cache_dir, b), timeout=60)
    assert count("is usable again") == 1, daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()
