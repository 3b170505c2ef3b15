"""Node coordination through the daemon (design §3 inv. 4, §5, §6): single-flight across
Pods, the GET-concurrency-per-replica signal, fallback when the daemon dies, SIGTERM."""

from __future__ import annotations

import json
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
from tests.support.checks import (
    assert_blobs_valid,
    assert_ok_path,
    assert_revision_ok,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy

SLACK = 64 * 1024
REPLICAS = "weightcache_replica_fetches_inflight"
RATIO = "weightcache_get_concurrency_per_replica"
GETS = "weightcache_origin_get_inflight"


@pytest.mark.timeout(150)
def test_six_pods_one_download_and_the_ratio(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([4 * MiB] * 3, name="herd", rev="r1", seed="herd")
    size = pub.model.total_size
    max_concurrency = 4
    # Every GET waits 0.3 s at the proxy and the daemon's node budget is 4 MiB/s: the
    # 12 MiB download takes ~3.5 s, long enough for six Python starts on two cores.
    proxy.configure(scope="all", latency=0.3)
    models = write_models(tmp_path / "models.yaml", [])
    extra = ["--bwlimit", "4M", "--max-concurrency", str(max_concurrency), "--part-size", "1M"]
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, extra=extra)

    uids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(6)]
    procs = [
        wc.fetch_popen(pub.source, cache_dir, "--json", endpoint=proxy.url, env={"POD_UID": uid})
        for uid in uids
    ]
    samples: list[dict[str, float]] = []
    deadline = time.monotonic() + 90
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        samples.append(daemon.metrics())
        time.sleep(0.05)
    results = [p.finish(timeout=30) for p in procs]
    for r in results:
        assert r.returncode == 0, describe(r)
    docs = [json.loads(r.stdout) for r in results]
    assert {Path(d["path"]).resolve() for d in docs} == {pub.local_path(cache_dir).resolve()}
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert markers(cache_dir) == [pub.local_path(cache_dir) / ".weightcache"]

    s = proxy.stats()
    assert size <= s.body_bytes <= size + SLACK, (
        f"{s.body_bytes} bytes from the store for a {size}-byte model fetched by 6 Pods"
    )

    replicas = [m[REPLICAS] for m in samples]
    print(
        "samples (replicas, gets, ratio):",
        [(m[REPLICAS], m[GETS], round(m[RATIO], 3)) for m in samples],
    )
    assert max(replicas) == 6, f"never saw 6 Pods waiting: {replicas}"
    all_waiting = [m for m in samples if m[REPLICAS] == 6]
    ratios = [m[RATIO] for m in all_waiting]
    assert max(ratios) <= max_concurrency / 6 + 1e-9, (
        f"GETs per waiting replica exceeded max-concurrency/6 while 6 waited: {ratios}"
    )
    assert max(ratios) > 0, f"the ratio stayed 0 while 6 Pods waited on a download: {ratios}"
    assert max(m[GETS] for m in samples) <= max_concurrency, [m[GETS] for m in samples]

    # A warm fetch: no replica waits, no GET in flight, the ratio is back to 0.
    hit = wc.fetch(pub.source, cache_dir, endpoint=proxy.url)
    assert_ok_path(hit, pub.local_path(cache_dir))
    m = daemon.metrics()
    assert (m[REPLICAS], m[GETS], m[RATIO]) == (0, 0, 0), m
    # Six Pods joined one download: six fetches counted (each with its own wait), plus
    # the warm one, which the daemon hears about as a hit.
    time.sleep(0.3)  # the hit notification is fire-and-forget
    m = daemon.metrics()
    assert m['weightcache_fetches_total{result="miss"}'] == 6, m
    assert m['weightcache_fetch_duration_seconds_count{result="miss"}'] == 6, m
    assert m['weightcache_fetches_total{result="hit"}'] == 1, m
    assert daemon.alive(), daemon.log()


@pytest.mark.timeout(120)
def test_fetches_fall_back_when_the_daemon_is_killed(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([4 * MiB] * 2, name="orphan", rev="r1", seed="orphan")
    proxy.configure(rate_limit=1 * MiB)  # the daemon's download crawls: 8 s for 8 MiB
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, extra=["--part-size", "1M"])

    procs = [wc.fetch_popen(pub.source, cache_dir, endpoint=proxy.url) for _ in range(3)]
    wait_for("3 Pods waiting on the daemon", lambda: daemon.metrics()[REPLICAS] == 3,
             timeout=30, every=0.05)  # fmt: skip
    assert not is_marked(cache_dir, pub)
    daemon.kill9()
    proxy.configure(rate_limit=None)

    started = time.monotonic()
    results = [p.finish(timeout=60) for p in procs]
    for r in results:
        assert_ok_path(r, pub.local_path(cache_dir))
    assert time.monotonic() - started < 30, "the fetches took long to notice the dead daemon"
    assert markers(cache_dir) == [pub.local_path(cache_dir) / ".weightcache"]
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_blobs_valid(cache_dir)


@pytest.mark.timeout(150)
def test_sigterm_mid_prefetch_leaves_resumable_partials(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([8 * MiB] * 3, name="big", rev="r1", seed="big")
    size = pub.model.total_size
    part, concurrency = 1 * MiB, 4
    models = write_models(tmp_path / "models.yaml", [entry(pub, pin=True)])
    store_args = ["--part-size", "1M", "--max-concurrency", str(concurrency)]
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url,
                           extra=["--bwlimit", "4M", *store_args])  # fmt: skip

    wait_for("8 MiB of the prefetch", lambda: proxy.stats(settle=0).body_bytes >= 8 * MiB,
             timeout=30, every=0.05)  # fmt: skip
    assert not is_marked(cache_dir, pub)
    t0 = time.monotonic()
    daemon.terminate()
    code = daemon.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"the daemon took {elapsed:.1f}s to exit after SIGTERM\n{daemon.log()}"
    assert code == 0, f"exit {code} after SIGTERM\n{daemon.log()}"
    assert not is_marked(cache_dir, pub)
    partials = list((cache_dir / ".weightcache" / "tmp").glob("*.part"))
    assert partials, f"no partial files kept in tmp/\n{daemon.log()}"
    assert_blobs_valid(cache_dir)
    first = proxy.stats().body_bytes
    assert first < size, "the prefetch finished before SIGTERM: nothing to resume"

    proxy.reset_stats()
    again = daemons.start(cache_dir, models, endpoint=proxy.url, extra=store_args)
    wait_for("the resumed prefetch", again.pins_ready, timeout=60)
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    second = proxy.stats().body_bytes
    report = f"first run {first} bytes, second run {second} bytes, model {size} bytes"
    print(report, f"SIGTERM to exit: {elapsed:.2f}s")
    assert second < size, report
    # What was on disk at SIGTERM is not fetched again: at most the parts then in flight.
    assert first + second <= size + concurrency * part + SLACK, report

    again.terminate()
    assert again.wait(timeout=15) == 0, again.log()
