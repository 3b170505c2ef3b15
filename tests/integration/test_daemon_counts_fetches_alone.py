"""Every fetch on a node is visible to the node's daemon: fetches that
download without it (`--no-daemon`, a source it refuses) register in the cache dir, and
its /metrics counts them and their GETs while they run, and forgets them when their
process is gone, `kill -9` included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    wait_for,
    write_models,
)
from tests.support.checks import assert_ok_path, describe
from tests.support.faultproxy import FaultProxy

KiB = 1024
ALONE = "weightcache_fetches_alone_inflight"
ALONE_GETS = "weightcache_fetches_alone_origin_get_inflight"
GETS = "weightcache_origin_get_inflight"
REPLICAS = "weightcache_replica_fetches_inflight"
DOWNLOADS = "weightcache_downloads_inflight"
COPIES = "weightcache_copies_inflight"
GAUGES = (ALONE, ALONE_GETS, GETS, REPLICAS, DOWNLOADS, COPIES)
THROTTLED = "weightcache_origin_throttled_total"
#: A few seconds in the brief; generous for a loaded 2-core box.
SETTLE_S = 10.0


@pytest.mark.timeout(240)
def test_fetches_alone_are_counted_while_they_run_and_only_then(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Three fetches alone on three revisions, slowed down by the proxy: two with
    --no-daemon, one refused by the daemon (so falling back). The daemon downloads
    nothing itself, so every GET it reports is theirs."""
    pubs = [publish([192 * KiB] * 2, name=f"alone{i}", rev="r1", seed=f"a{i}") for i in range(3)]
    uniq = pubs[0].prefix.split("/")[0]
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url,
                           allow_source=[f"s3://models/{uniq}/other"])  # fmt: skip
    assert daemon.metrics()[GETS] == daemon.metrics()[REPLICAS] == 0

    proxy.configure(scope="data", trickle_rate=8 * KiB)  # ~24 s per object
    first = wc.fetch_popen(pubs[0].source, cache_dir, "--no-daemon", endpoint=proxy.url)
    refused = wc.fetch_popen(pubs[1].source, cache_dir, endpoint=proxy.url)
    killed = wc.fetch_popen(pubs[2].source, cache_dir, "--no-daemon", endpoint=proxy.url)

    def all_three_pulling() -> dict[str, float] | None:
        m = daemon.metrics()
        # GETS >= 3 may be two fetches' GETs before the third's first: wait for its copy too.
        return m if m[REPLICAS] == 3 and m[GETS] >= 3 and m[COPIES] == 3 else None

    # The gauges the seed's ratio is made of, and the new ones that break them down.
    seen = wait_for("three fetches alone, each with GETs in flight", all_three_pulling, 60)
    assert seen[ALONE] == 3 and seen[DOWNLOADS] == 3, seen
    assert seen[ALONE_GETS] == seen[GETS], seen  # the daemon itself downloads nothing
    assert seen["weightcache_get_concurrency_per_replica"] == seen[GETS] / 3, seen

    killed.kill9()
    records = cache_dir / ".weightcache" / "fetching"
    assert any(r.name.startswith(f"{killed.pid}-") for r in records.glob("*.json")), (
        "kill -9 left no record behind: nothing to prove about ghosts"
    )

    def killed_forgotten() -> bool:
        running = sum(r.poll() is None for r in (first, refused))
        return daemon.metrics()[ALONE] == running

    wait_for("the killed fetch forgotten", killed_forgotten, SETTLE_S)
    proxy.configure(trickle_rate=None)  # let the others finish
    for running, pub in ((first, pubs[0]), (refused, pubs[1])):
        assert_ok_path(running.finish(180), pub.local_path(cache_dir))
    assert "fetching alone" in refused.finish().stderr, describe(refused.finish())

    def idle() -> dict[str, float] | None:
        m = daemon.metrics()
        return m if all(m[g] == 0 for g in GAUGES) else None

    last = wait_for("every gauge back to 0", idle, SETTLE_S)
    assert last["weightcache_max_concurrency"] == 16, last  # the daemon's default
    assert list(records.iterdir()) == [], "records left behind"

    # A hit registers nothing and does not even import the registry.
    hit = wc.fetch(pubs[0].source, cache_dir, "--no-daemon", endpoint=proxy.url,
                   env={"PYTHONPROFILEIMPORTTIME": "1"})  # fmt: skip
    assert_ok_path(hit, pubs[0].local_path(cache_dir))
    assert "weightcache.cache.alone" not in hit.stderr and "weightcache.fetch" in hit.stderr


@pytest.mark.timeout(240)
def test_the_throttles_of_a_fetch_alone_are_the_daemons_too(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """503 SlowDown answered to a --no-daemon fetch shows in the daemon's throttle counter,
    which WeightcacheOriginThrottled reads; and two fetches of one revision are one copy."""
    pub = publish([192 * KiB] * 2, name="alone-throttled", rev="r1", seed="t")
    daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", []),
                           endpoint=proxy.url)  # fmt: skip
    assert daemon.metrics()[THROTTLED] == 0
    proxy.configure(scope="data", script=("slowdown",) * 3, trickle_rate=8 * KiB)
    first = wc.fetch_popen(pub.source, cache_dir, "--no-daemon", endpoint=proxy.url)
    second = wc.fetch_popen(pub.source, cache_dir, "--no-daemon", endpoint=proxy.url)

    def throttled_while_pulling() -> dict[str, float] | None:
        m = daemon.metrics()
        return m if m[THROTTLED] >= 1 and m[ALONE] == 2 and m[GETS] >= 1 else None

    seen = wait_for("the fetch's 503s counted by the daemon", throttled_while_pulling, 90)
    assert seen[COPIES] == 1 and seen[DOWNLOADS] == 1, seen  # the second waits on the lock
    proxy.configure(trickle_rate=None)
    for running in (first, second):
        assert_ok_path(running.finish(180), pub.local_path(cache_dir))
