"""The models file is untrusted input (design §2.3): an alias bomb, deep nesting or a FIFO
in its place is one error line and exit 2 for `prefetch` and a daemon starting, and a
running daemon keeps its last good state and goes on converging the next good file."""

from __future__ import annotations

import os
import subprocess
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
    wait_for,
    write_models,
)
from tests.support.checks import assert_fails
from tests.support.faultproxy import FaultProxy


def alias_bomb(levels: int) -> str:
    """Each entry's pin lists the one before it nine times (9**levels leaves); a few more
    levels than here took `prefetch` minutes of CPU and gigabytes."""
    lines = ["models:", "  - {source: s3://m/a/r0, pin: &a0 [x, x, x, x, x, x, x, x, x]}"]
    for i in range(1, levels + 1):
        pins = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"  - {{source: s3://m/a/r{i}, pin: &a{i} [{pins}]}}")
    return "\n".join(lines) + "\n"


DEEP = "models: " + "[" * 100_000 + "]" * 100_000 + "\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param(alias_bomb(6), "anchors and aliases", id="alias-bomb"),
        pytest.param(DEEP, "nested deeper than", id="deep"),
    ],
)
def test_prefetch_refuses_a_hostile_models_file_in_one_line(
    wc: CLI, proxy: FaultProxy, cache_dir: Path, tmp_path: Path, text: str, why: str
) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(text)
    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models,
                  "--endpoint-url", proxy.url)  # fmt: skip
    message = assert_fails(proc, 2)
    assert str(models) in message and why in message, message
    assert len(proc.stderr) < 1000, proc.stderr[:2000]


@pytest.mark.timeout(90)
def test_a_daemon_given_a_fifo_exits_2_instead_of_waiting_on_it(
    proxy: FaultProxy, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    models = tmp_path / "models.yaml"
    os.mkfifo(models)  # nobody writes it: open() would wait for good, deaf to SIGTERM
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, wait=False)
    code = daemon.wait(timeout=60)
    stderr = daemon.stderr_path.read_text()
    message = assert_fails(subprocess.CompletedProcess(daemon.args, code, "", stderr), 2)
    assert f"cannot read the models file {models}: it is not a regular file" in message


@pytest.mark.timeout(240)
def test_a_running_daemon_outlives_a_hostile_models_file(
    publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """A FIFO, an alias bomb and deep nesting in turn: each is logged once, the last good
    state stays (pinned, served, healthy), and the next good file is followed."""
    a = publish([1 * MiB], name="alpha", rev="r1", seed="alpha")
    b = publish([1 * MiB], name="beta", rev="r1", seed="beta")
    models = write_models(tmp_path / "models.yaml", [entry(a, pin=True)])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url)  # reloads every 0.5 s
    wait_for("alpha to be prefetched", daemon.pins_ready, timeout=60)

    def replace(text: str | None) -> None:
        tmp = models.with_name("next.yaml")
        if text is None:
            os.mkfifo(tmp)
        else:
            tmp.write_text(text)
        os.replace(tmp, models)

    for text, said in [(None, "not a regular file"), (alias_bomb(6), "anchors and aliases"),
                       (DEEP, "nested deeper than")]:  # fmt: skip
        replace(text)
        wait_for(f"{said!r} to be logged", lambda s=said: s in daemon.log(), timeout=30)  # type: ignore[misc]
        assert daemon.get("/healthz")[0] == 200, daemon.log()
        assert daemon.pins_ready(), daemon.log()

    write_models(models, [entry(a, pin=True), entry(b)])
    wait_for("beta to be prefetched", lambda: is_marked(cache_dir, b), timeout=60)
    log = daemon.log()
    assert "Traceback" not in log and len(log) < 20_000, log[-6000:]
