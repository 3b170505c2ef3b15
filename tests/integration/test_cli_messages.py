"""What the command line says at first contact, beyond its errors' exit codes: a gc's
target and what keeps it from being met, a mistyped command, ambiguous units, a wrong
endpoint or secret, a file:// revision without SHA256SUMS (design §2)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import entry, write_models
from tests.support.checks import assert_fails, assert_ok_path, describe

KiB = 1024


@pytest.mark.timeout(120)
def test_gc_states_its_target_and_what_keeps_it_from_being_met(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path, tmp_path: Path
) -> None:
    pub = publish([64 * KiB], name="pinned", rev="r1")
    assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), pub.local_path(cache_dir))

    roomy = wc.run("gc", "--capacity", "90%", "--dry-run", "--cache-dir", cache_dir)
    assert roomy.returncode == 0, describe(roomy)
    usage, target = re.search(r"usage (\d+) -> \d+ \(target (\d+)\)", roomy.stdout).groups()
    assert int(target) > int(usage) > 0, f"the target is 90% of the disk\n{describe(roomy)}"
    assert roomy.stderr == "", describe(roomy)

    # The pin keeps the cache above a 1 KiB bound: done as far as it can, and said so.
    models = write_models(tmp_path / "models.yaml", [entry(pub, pin=True)])
    for dry in (["--dry-run"], []):
        gc = wc.run("gc", "--capacity", "1KiB", "--models", models, *dry, "--cache-dir", cache_dir)
        assert gc.returncode == 0, describe(gc)
        warning = gc.stderr.strip()
        assert warning.startswith("weightcache: warning:") and "\n" not in warning, describe(gc)
        assert "pinned/r1" in warning and "1024" in warning, describe(gc)
    assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), pub.local_path(cache_dir))


def test_a_mistyped_command_gets_the_closest_one(wc: CLI) -> None:
    for typed, meant in (("fech", "fetch"), ("prefech", "prefetch"), ("dmeo", "demo")):
        message = assert_fails(wc.run(typed, timeout=60), 2)
        assert f"No such command '{typed}'" in message and f"'{meant}'" in message, message
    message = assert_fails(wc.run("zzzzzz", timeout=60), 2)
    assert "Did you mean" not in message, message
