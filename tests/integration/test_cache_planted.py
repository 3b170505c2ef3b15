"""Whoever can write the cache (a Pod on the read-write fallback runs as the daemon's uid)
can plant a symlink at a name a fetch or the daemon is about to write: nothing is written
through it, to a file outside the cache (design §3, invariant 5)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import CLI, dead_endpoint
from tests.integration.daemon_helpers import (  # noqa: F401
    Daemons,
    daemons,
    write_models,
)
from tests.support.checks import assert_ok_path, assert_revision_ok, describe
from tests.support.inotify import IN_MOVED_FROM, Watch
from tests.support.modelgen import Model, make_model

MiB = 1024 * 1024
PRECIOUS = "precious: not the cache's to write\n"


def _victim(tmp_path: Path, name: str, text: str = PRECIOUS) -> Path:
    """A file outside the cache that a planted symlink points to (SQLite makes a database
    of an empty file, and refuses one of other content)."""
    path = tmp_path / "victims" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def _model(tmp_path: Path, sizes: list[int]) -> Model:
    return make_model(tmp_path / "volume" / "planted" / "v1", sizes)


def _internal(cache_dir: Path, *parts: str) -> Path:
    path = cache_dir.joinpath(".weightcache", *parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.timeout(120)
def test_symlinks_at_the_names_a_fetch_writes_are_not_followed(
    wc: CLI, tmp_path: Path, cache_dir: Path
) -> None:
    model = _model(tmp_path, [1 * MiB, 64 * 1024])
    planted = {
        _internal(cache_dir, "locks", "rev-planted@v1.lock"): _victim(tmp_path, "rev"),
        _internal(cache_dir, "state.db"): _victim(tmp_path, "statedb", ""),
        _internal(cache_dir, "state.db-shm"): _victim(tmp_path, "shm"),
    }
    for i, f in enumerate(model.files):
        lock = _internal(cache_dir, "locks", f"blob-{f.sha256}.lock")
        planted[lock] = _victim(tmp_path, f"blob{i}")
    for link, victim in planted.items():
        link.symlink_to(victim)
    before = {victim: victim.read_bytes() for victim in planted.values()}

    proc = wc.fetch(f"file://{model.root}", cache_dir, "--no-daemon")
    assert_ok_path(proc, cache_dir / "planted" / "v1")
    assert_revision_ok(cache_dir, "planted", "v1", model)
    for link, victim in planted.items():
        assert victim.read_bytes() == before[victim], f"written through {link}"
        assert not link.is_symlink(), f"{link} still leads out of the cache"


@pytest.mark.timeout(120)
def test_the_daemon_lock_is_not_opened_through_a_symlink(
    tmp_path: Path,
    cache_dir: Path,
    daemons: Daemons,  # noqa: F811
) -> None:
    victim = _victim(tmp_path, "daemon-lock")
    _internal(cache_dir, "daemon.lock").symlink_to(victim)
    daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", []),
                           endpoint=dead_endpoint())  # fmt: skip
    assert victim.read_text() == PRECIOUS, daemon.log()
    assert not (cache_dir / ".weightcache" / "daemon.lock").is_symlink()


@pytest.mark.timeout(180)
def test_part_state_temporaries_are_not_written_through_a_planted_symlink(
    wc: CLI, tmp_path: Path, cache_dir: Path
) -> None:
    """The attacker watches tmp/ (inotify) and plants a symlink at every temporary name
    once it is renamed away, for the fetch's next save of its part state."""
    model = _model(tmp_path, [3 * MiB])
    victim = _victim(tmp_path, "part-state")
    tmp = _internal(cache_dir, "tmp", "x").parent
    tmp.mkdir(exist_ok=True)
    watch = Watch(tmp)
    running = wc.fetch_popen(f"file://{model.root}", cache_dir, "--no-daemon",
                             "--bwlimit", "1M", "--max-concurrency", "2",
                             "--part-size", "256K")  # fmt: skip
    seen: set[str] = set()
    try:
        while running.poll() is None:
            for mask, name in watch.events():
                if mask & IN_MOVED_FROM and name.endswith(".tmp") and name not in seen:
                    seen.add(name)
                    (tmp / name).symlink_to(victim)
            time.sleep(0.005)
    finally:
        watch.close()
    proc = running.finish()
    assert proc.returncode == 0, describe(proc)
    assert seen, "the fetch renamed no temporary in tmp/"
    assert victim.read_text() == PRECIOUS, f"written through one of {sorted(seen)}"
    assert_revision_ok(cache_dir, "planted", "v1", model)


@pytest.mark.timeout(120)
def test_a_fetching_directory_planted_as_a_symlink_is_neither_written_nor_swept(
    wc: CLI,
    tmp_path: Path,
    cache_dir: Path,
    daemons: Daemons,  # noqa: F811
) -> None:
    """`fetching/` leading out of the cache: a fetch alone writes no record there, and the
    daemon, counting fetches at each scrape, removes no "ghost" record from there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.json").write_text(PRECIOUS)
    _internal(cache_dir, "fetching").symlink_to(outside)
    watch = Watch(outside)
    try:
        model = _model(tmp_path, [64 * 1024])
        assert_ok_path(wc.fetch(f"file://{model.root}", cache_dir, "--no-daemon"),
                       cache_dir / "planted" / "v1")  # fmt: skip
        assert watch.events() == [], "the fetch wrote its record outside the cache"
    finally:
        watch.close()
    daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", []),
                           endpoint=dead_endpoint())  # fmt: skip
    assert daemon.get("/metrics")[0] == 200, daemon.log()
    assert (outside / "precious.json").read_text() == PRECIOUS, daemon.log()
