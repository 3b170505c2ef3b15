"""The daemon's loops survive what they do not expect (design §5, Roles): a models entry that
fails with an OSError never stops the others and is retried with a backoff; a loop whose
step keeps failing makes /healthz fail with one line, and /healthz recovers with it."""

from __future__ import annotations

import os
import re
import shutil
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
    wait_for,
    write_models,
)
from tests.support.checks import assert_revision_ok, describe, error_lines
from tests.support.faultproxy import FaultProxy


@pytest.mark.timeout(150)
def test_an_entry_failing_with_an_oserror_never_stops_the_others(
    publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path, tmp_path: Path,
    daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    blocked = publish([1 * MiB], name="blocked", rev="r1", seed="blocked")
    good = publish([2 * MiB], name="good", rev="r1", seed="good")
    # A file where the model's directory goes: every attempt at `blocked` raises an
    # OSError (FileExistsError from mkdir), not a weightcache error.
    cache_dir.mkdir()
    (cache_dir / blocked.name).write_text("not a directory\n")
    models = write_models(
        tmp_path / "models.yaml", [entry(blocked, pin=True), entry(good, pin=True)]
    )
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url)

    wait_for("the good model to be prefetched", lambda: is_marked(cache_dir, good), timeout=60)
    assert_revision_ok(cache_dir, good.name, good.rev, good.model)
    status, body = daemon.get("/readyz")  # serving: an unfetchable pin is an alert, not NotReady
    expected = "ready; pinned revisions not cached yet: blocked/r1\n"
    assert (status, body) == (200, expected), daemon.log()
    blocked_series = 'weightcache_revision_ready{name="blocked",pinned="true",revision="r1"}'
    assert daemon.metrics()[blocked_series] == 0, daemon.metrics()
    # A bad entry is the entry's problem, not the daemon's: /healthz stays 200.
    assert daemon.get("/healthz") == (200, "ok\n"), daemon.log()
    failed = [line for line in daemon.log().splitlines() if "prefetch of blocked/r1 failed" in line]
    assert failed, daemon.log()
    assert re.search(r"\(retry in 10s\): unexpected \w+Error: ", failed[0]), failed
    assert "Traceback" not in daemon.log(), daemon.log()

    # Repaired, it is fetched on a later retry (10 s, then 20 s: not every 0.5 s reload).
    (cache_dir / blocked.name).unlink()
    wait_for("the pins ready", daemon.pins_ready, timeout=60)
    assert_revision_ok(cache_dir, blocked.name, blocked.rev, blocked.model)
    failed = [line for line in daemon.log().splitlines() if "prefetch of blocked/r1 failed" in line]
    assert len(failed) <= 3, failed
    assert daemon.alive(), daemon.log()


@pytest.mark.timeout(150)
def test_a_step_that_keeps_failing_makes_healthz_fail_until_it_works(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB], name="alpha", rev="r1", seed="alpha")
    models = write_models(tmp_path / "models.yaml", [entry(pub, pin=True)])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url)
    wait_for("the prefetch", daemon.pins_ready, timeout=60)
    assert daemon.get("/healthz") == (200, "ok\n")

    # A file where the blob directory is expected: surveying the cache for the capacity
    # bound raises NotADirectoryError at every step of the lease and capacity loop.
    blobs = cache_dir / ".weightcache" / "blobs" / "sha256"
    aside = blobs.with_name("sha256.aside")
    os.rename(blobs, aside)
    blobs.write_text("not a directory\n")

    def unhealthy() -> tuple[int, str] | None:
        assert daemon.alive(), daemon.log()
        answer = daemon.get("/healthz")
        return answer if answer[0] == 503 else None

    _, body = wait_for("/healthz 503", unhealthy, timeout=60)
    assert body.count("\n") == 1 and "NotADirectoryError" in body, body
    # The lease and capacity loop surveys the blobs; on a loaded machine the converge loop
    # may reach its third failure first (it checks the pinned revision's blobs too).
    assert re.search(r"(lease and capacity|converge) step failed", body), body
    assert "Traceback" not in daemon.log(), daemon.log()

    blobs.unlink()
    os.rename(aside, blobs)
    wait_for("/healthz 200 again", lambda: daemon.get("/healthz") == (200, "ok\n"), timeout=60)
    assert daemon.get("/readyz")[0] == 200
    # The fetch socket still works: a Pod's fetch of another revision goes through it.
    other = publish([1 * MiB], name="alpha", rev="r2", seed="alpha2")
    started = time.monotonic()
    proc = wc.fetch(other.source, cache_dir, endpoint=proxy.url)
    assert proc.returncode == 0, (proc.stderr, time.monotonic() - started)
    assert is_marked(cache_dir, other)
    shutil.rmtree(tmp_path / "src", ignore_errors=True)


@pytest.mark.timeout(120)
def test_prefetch_goes_past_an_entry_failing_with_an_oserror(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    blocked = publish([1 * MiB], name="blocked", rev="r1", seed="blocked")
    good = publish([1 * MiB], name="good", rev="r1", seed="good")
    cache_dir.mkdir()
    (cache_dir / blocked.name).write_text("not a directory\n")
    models = write_models(tmp_path / "models.yaml", [entry(blocked), entry(good)])

    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models,
                  "--endpoint-url", proxy.url, env={"AWS_ENDPOINT_URL": proxy.url})  # fmt: skip
    assert proc.returncode != 0, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, describe(proc)
    assert "blocked" in errors[0], errors
    assert proc.stdout.splitlines() == [str(good.local_path(cache_dir))], describe(proc)
    assert_revision_ok(cache_dir, good.name, good.rev, good.model)


@pytest.mark.timeout(120)
def test_failing_node_labels_never_stop_convergence_nor_fail_healthz(
    publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path, tmp_path: Path,
    daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    a = publish([1 * MiB], name="alpha", rev="r1", seed="alpha")
    b = publish([1 * MiB], name="beta", rev="r1", seed="beta")
    models = write_models(tmp_path / "models.yaml", [entry(a)])
    # --node-name outside a cluster: there is no API server to label the node through.
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, extra=["--node-name", "n1"],
                           env={"KUBERNETES_SERVICE_HOST": None})  # fmt: skip
    wait_for("alpha", lambda: is_marked(cache_dir, a), timeout=60)
    write_models(models, [entry(a), entry(b)])
    wait_for("beta, after the models file changed", lambda: is_marked(cache_dir, b), timeout=60)
    time.sleep(3)  # six converge steps at 0.5 s
    assert daemon.get("/healthz") == (200, "ok\n"), daemon.log()
    # Said once, in one line that a newcomer reads, not as a KeyError at each change.
    said = [line for line in daemon.log().splitlines() if "could not label node n1" in line]
    assert len(said) == 1, daemon.log()
    assert "outside a Kubernetes cluster" in said[0] and "KeyError" not in said[0], said
    assert "labels are off" in said[0], said
    assert "Traceback" not in daemon.log(), daemon.log()
