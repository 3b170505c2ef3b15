"""`prefetch` and the daemon's convergence to the models file (design §2.3, §5): readiness,
reloading the file, pins."""

from __future__ import annotations

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
from tests.support.checks import (
    assert_blobs_valid,
    assert_revision_ok,
    describe,
    error_lines,
    markers,
)
from tests.support.faultproxy import FaultProxy


@pytest.mark.timeout(120)
def test_prefetch_two_models(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    a = publish([2 * MiB, 1 * MiB], name="alpha", rev="r1", seed="alpha")
    b = publish([3 * MiB], name="beta", rev="2026-10-01", seed="beta")
    models = write_models(tmp_path / "models.yaml", [entry(a, pin=True), entry(b)])

    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models,
                  "--endpoint-url", proxy.url, env={"AWS_ENDPOINT_URL": proxy.url})  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    assert markers(cache_dir) == sorted(
        [a.local_path(cache_dir) / ".weightcache", b.local_path(cache_dir) / ".weightcache"]
    )
    assert_revision_ok(cache_dir, a.name, a.rev, a.model)
    assert_revision_ok(cache_dir, b.name, b.rev, b.model)
    size = a.model.total_size + b.model.total_size
    assert size <= proxy.stats().body_bytes <= size + 64 * 1024

    # Converged already: a second run is a no-op that downloads nothing.
    proxy.reset_stats()
    again = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models,
                   "--endpoint-url", proxy.url, env={"AWS_ENDPOINT_URL": proxy.url})  # fmt: skip
    assert again.returncode == 0, describe(again)
    assert proxy.stats().body_bytes == 0


@pytest.mark.timeout(120)
def test_prefetch_bad_entry_does_not_stop_good_one(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    good = publish([1 * MiB], name="good", rev="r1", seed="good")
    bad_source = "s3://models/only-one-segment"
    # The bad entry comes first: it must not stop the valid one after it.
    models = write_models(tmp_path / "models.yaml", [{"source": bad_source}, entry(good)])

    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models,
                  "--endpoint-url", proxy.url, env={"AWS_ENDPOINT_URL": proxy.url})  # fmt: skip
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    errors = error_lines(proc.stderr)
    assert len(errors) >= 1, describe(proc)
    assert any(bad_source in line for line in errors), describe(proc)
    assert not any(good.source in line for line in errors), describe(proc)
    assert markers(cache_dir) == [good.local_path(cache_dir) / ".weightcache"]
    assert_revision_ok(cache_dir, good.name, good.rev, good.model)


@pytest.mark.timeout(120)
def test_prefetch_says_a_failure_is_not_retried(
    wc: CLI, cache_dir: Path, tmp_path: Path, uniq: str
) -> None:
    """`prefetch` converges once and exits: its log must not promise a retry that never
    comes (the daemon's converger retries; this process does not)."""
    absent = f"s3://models/{uniq}/absent/r1"
    models = write_models(tmp_path / "models.yaml", [{"source": absent}])
    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models)
    assert proc.returncode == 3, describe(proc)
    failed = [line for line in proc.stderr.splitlines() if "prefetch of" in line]
    assert len(failed) == 1, describe(proc)
    assert "retry in" not in failed[0] and "not retried" in failed[0], failed


@pytest.mark.timeout(150)
def test_daemon_readiness_follows_models_file(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    a = publish([3 * MiB], name="alpha", rev="r1", seed="alpha")
    b = publish([3 * MiB], name="beta", rev="r1", seed="beta")
    c = publish([1 * MiB], name="gamma", rev="r1", seed="gamma")
    # ~6 MiB at 3 MiB/s: two seconds during which the pins are not ready yet.
    proxy.configure(rate_limit=3 * MiB)
    models = write_models(tmp_path / "models.yaml", [entry(a, pin=True), entry(b, pin=True)])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url)

    assert daemon.get("/healthz")[0] == 200
    # Readiness means serving: 200 while the pins download, the body
    # naming them; their progress is the metric, which starts at 0 for every pin.
    status, body = daemon.get("/readyz")
    assert status == 200, (status, body, daemon.log())
    assert len(markers(cache_dir)) < 2, "the prefetch finished before /readyz was asked"
    assert "pinned revisions not cached yet:" in body and "beta/r1" in body, body
    pinned = {k: v for k, v in daemon.metrics().items() if 'pinned="true"' in k}
    beta = f'weightcache_revision_ready{{name="{b.name}",pinned="true",revision="r1"}}'
    assert pinned.get(beta) == 0, pinned
    wait_for("the pins ready", daemon.pins_ready, timeout=60, every=0.05)
    assert len(markers(cache_dir)) == 2
    assert daemon.get("/readyz") == (200, "ready\n")
    assert_revision_ok(cache_dir, a.name, a.rev, a.model)
    assert_revision_ok(cache_dir, b.name, b.rev, b.model)
    assert daemon.get("/healthz")[0] == 200

    rows = ls_json(wc, cache_dir)
    assert rows[(a.name, a.rev)]["pinned"] is True, rows
    assert rows[(b.name, b.rev)]["pinned"] is True, rows

    # A ConfigMap update adds a third model: the daemon notices and prefetches it.
    proxy.configure(rate_limit=None)
    write_models(models, [entry(a, pin=True), entry(b, pin=True), entry(c)])
    wait_for("the added model to be prefetched", lambda: is_marked(cache_dir, c), timeout=30)
    assert_revision_ok(cache_dir, c.name, c.rev, c.model)
    assert daemon.get("/readyz")[0] == 200

    # Removing a model from the file unpins it (it stays cached: capacity is ample).
    write_models(models, [entry(b, pin=True), entry(c)])

    def alpha_unpinned() -> bool:
        return ls_json(wc, cache_dir)[(a.name, a.rev)]["pinned"] is False

    wait_for("alpha to be unpinned", alpha_unpinned, timeout=15, every=0.3)
    rows = ls_json(wc, cache_dir)
    assert rows[(b.name, b.rev)]["pinned"] is True, rows
    assert rows[(c.name, c.rev)]["pinned"] is False, rows
    assert rows[(a.name, a.rev)]["ready"] is True, rows
    assert daemon.get("/readyz")[0] == 200
    assert_blobs_valid(cache_dir)
    assert daemon.alive(), daemon.log()
