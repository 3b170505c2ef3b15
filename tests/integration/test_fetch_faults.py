"""`fetch` under a misbehaving store: throttling, resets, truncation, corruption, outages
(design §4 Retries and Corruption; exit codes 4 and 6 of §2.2)."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, dead_endpoint
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    write_models,
)
from tests.support.checks import (
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    markers,
)
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024


@pytest.mark.timeout(240)
def test_throttling_resets_and_truncation_on_the_data_plane_are_retried(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([4 * MiB] * 4, name="flaky", rev="r1")
    # 20% SlowDown, 5% resets, 5% truncated bodies on every ranged GET, each kind forced
    # once up front; never more than 4 faults in a row on one object, so a client with a
    # sane retry budget (design §4: bounded attempts) is sure to get through.
    proxy.configure(
        scope="ranged", slowdown_rate=0.20, reset_rate=0.05, truncate_rate=0.05,
        script=("slowdown", "reset", "truncate", "slowdown"), max_consecutive=4,
    )  # fmt: skip
    proc = wc.fetch(pub.source, cache_dir, "--part-size", "1M", "--max-concurrency", "4",
                    endpoint=proxy.url, timeout=200)  # fmt: skip
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)

    s = proxy.stats()
    assert s.faults.get("slowdown", 0) >= 2 and s.faults.get("reset", 0) >= 1, s.faults
    assert s.faults.get("truncate", 0) >= 1, s.faults
    # Retries resume where a part broke (design §4): the bytes re-sent after resets and
    # truncations are at most the broken parts again, not the file again.
    broken = s.faults.get("reset", 0) + s.faults.get("truncate", 0)
    assert s.body_bytes <= pub.model.total_size + broken * 1 * MiB + 64 * 1024, s


def mean_concurrency(timeline: list[tuple[float, int]]) -> float:
    """Time-weighted mean of ranged GETs in progress, from the first to the last change."""
    if len(timeline) < 2:
        return 0.0
    area = sum(n * (t1 - t0) for (t0, n), (t1, _) in itertools.pairwise(timeline))
    return area / (timeline[-1][0] - timeline[0][0])


@pytest.mark.timeout(180)
def test_throttling_halves_concurrency_and_is_counted(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """503 SlowDown makes the downloader send fewer GETs at once (AIMD, README "How a miss
    downloads"), and the daemon counts each in weightcache_origin_throttled_total."""
    pub = publish([4 * MiB] * 4, name="throttled", rev="r1", seed="throttled")
    max_concurrency = 8
    # 64 parts; every ranged GET takes >= 0.2 s at the proxy, so a downloader that keeps 8
    # workers busy has ~8 in flight; 25% of them answer SlowDown (never 4 in a row on one
    # object). Halving at each throttle (at most once a second) and adding one slot per
    # `limit` successes keeps the mean below 4 (measured: 3.3-3.8); ignoring the 503s keeps
    # it near 6 (measured: 6.0-6.2). A loaded CPU only lowers both.
    proxy.configure(scope="ranged", latency=0.2, slowdown_rate=0.25, max_consecutive=3,
                    script=("slowdown",) * 4)  # fmt: skip
    models = write_models(tmp_path / "models.yaml", [])
    extra = ["--max-concurrency", str(max_concurrency), "--part-size", "256K"]
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, extra=extra)
    before = daemon.metrics().get("weightcache_origin_throttled_total", 0.0)

    proc = wc.fetch(pub.source, cache_dir, endpoint=proxy.url, timeout=150)
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)

    slowdowns = proxy.stats().faults.get("slowdown", 0)
    timeline = proxy.concurrency()
    mean = mean_concurrency(timeline)
    peak = max(n for _, n in timeline)
    print(f"slowdowns={slowdowns} mean={mean:.2f} peak={peak}")
    assert slowdowns >= 4
    assert mean <= 0.6 * max_concurrency, (
        f"{mean:.2f} ranged GETs in flight on average (peak {peak}) with {slowdowns} "
        f"SlowDown answers: the downloader does not back off on throttling"
    )
    throttled = daemon.metrics().get("weightcache_origin_throttled_total", 0.0) - before
    assert throttled == slowdowns, (
        f"weightcache_origin_throttled_total rose by {throttled} for {slowdowns} SlowDowns"
    )


@pytest.mark.timeout(120)
def test_bwlimit_bounds_the_rate_of_a_fetch(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """--bwlimit is an upper bound on the bytes/s over all connections: 16 MiB at 2 MiB/s
    cannot take less than (16 MiB - one burst of 0.5 MiB) / 2 MiB/s = 7.75 s, however the
    CPU is loaded (a loaded CPU only makes it slower). Unlimited, it takes ~0.5-2 s."""
    pub = publish([4 * MiB] * 4, name="paced", rev="r1", seed="paced")
    proc = wc.fetch(pub.source, cache_dir, "--no-daemon", "--json", "--bwlimit", "2M",
                    "--part-size", "1M", endpoint=proxy.url, timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    # The fetch's own clock: the proxy's can't tell, its sends land in socket buffers.
    seconds = doc["seconds"]
    rate = doc["bytes_from_origin"] / seconds
    print(f"{doc['bytes_from_origin']} bytes in {seconds:.2f}s: {rate / MiB:.2f} MiB/s")
    assert doc["bytes_from_origin"] >= pub.model.total_size, doc
    assert seconds >= 7.0, f"16 MiB in {seconds:.2f}s ({rate / MiB:.1f} MiB/s) with --bwlimit 2M"


@pytest.mark.timeout(180)
def test_faults_on_manifest_and_listing_are_retried(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """Every GET is fair game, including the first ones (SHA256SUMS, listings)."""
    pub = publish([2 * MiB, 1 * MiB], name="flakymeta", rev="r1")
    proxy.configure(scope="all", slowdown_rate=0.2, reset_rate=0.05, truncate_rate=0.05,
                    script=("slowdown", "truncate", "reset"), max_consecutive=3)  # fmt: skip
    proc = wc.fetch(pub.source, cache_dir, "--part-size", "1M", endpoint=proxy.url, timeout=150)
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert sum(proxy.stats().faults.values()) >= 3


@pytest.mark.timeout(180)
def test_corrupted_data_is_never_published(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """A flipped byte in every object response: download once more, then exit 4 naming
    the file and both hashes; no marker, no blob."""
    pub = publish([2 * MiB, 2 * MiB], name="corrupt", rev="r1")
    proxy.configure(scope="data", corrupt_rate=1.0)
    proc = wc.fetch(pub.source, cache_dir, "--part-size", "1M", endpoint=proxy.url, timeout=150)
    message = assert_fails(proc, 4)

    named = [f for f in pub.model.files if f.relpath in message]
    assert named, f"the error names no file of the manifest: {message}"
    bad = max(named, key=lambda f: len(f.relpath))
    assert re.search(r"expected", message, re.I), message
    assert re.search(r"actual|got|computed", message, re.I), message
    assert bad.sha256[:12] in message, f"expected hash of {bad.relpath} not in: {message}"
    others = set(re.findall(r"[0-9a-f]{12,}", message)) - {
        h for h in re.findall(r"[0-9a-f]{12,}", message) if bad.sha256.startswith(h)
    }
    assert others, f"no actual hash in: {message}"

    # design §4: "a mismatch downloads that file once more".
    assert proxy.stats().bytes_for("/" + bad.relpath) >= 2 * bad.size
    assert markers(cache_dir) == []
    assert not (cache_dir / pub.name / pub.rev).exists()
    blobs = sorted(blobs_dir(cache_dir).iterdir()) if blobs_dir(cache_dir).exists() else []
    assert blobs == [], f"corrupt data published as blobs: {blobs}"


# --- the store is down -------------------------------------------------------------------


TIMEOUT_S = 5
SLACK_S = 12  # Python start, backoff granularity, a loaded 2-core box


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outage", ["refused", "hang", "stall-mid-body"])
def test_store_down_cold_fetch_gives_up_with_exit_6(
    wc: CLI,
    publish: Callable[..., Published],
    proxy: FaultProxy,
    cache_dir: Path,
    outage: str,
) -> None:
    pub = publish([2 * MiB], name="down", rev="r1")
    endpoint = proxy.url
    if outage == "refused":
        endpoint = dead_endpoint()
    elif outage == "hang":
        proxy.set_down("hang")  # connections accepted, never answered
    else:
        proxy.configure(scope="data", stall_rate=1.0)  # headers, some bytes, then silence

    t0 = time.monotonic()
    proc = wc.fetch(pub.source, cache_dir, "--timeout", f"{TIMEOUT_S}s", endpoint=endpoint,
                    timeout=90)  # fmt: skip
    elapsed = time.monotonic() - t0
    message = assert_fails(proc, 6)
    assert elapsed <= TIMEOUT_S + SLACK_S, f"gave up after {elapsed:.1f}s: {message}"
    assert markers(cache_dir) == []


@pytest.mark.timeout(120)
def test_warm_hit_while_store_hangs(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([1 * MiB], name="warm", rev="r1")
    assert_ok_path(wc.fetch(pub.source, cache_dir, endpoint=proxy.url), pub.local_path(cache_dir))
    proxy.set_down("hang")
    before = proxy.stats(settle=0).connections
    proc = wc.fetch(pub.source, cache_dir, "--timeout", "5s", endpoint=proxy.url, timeout=60)
    assert_ok_path(proc, pub.local_path(cache_dir))
    # Not timed (a loaded machine makes any bound flaky): a hit that contacted the store,
    # however briefly, would have waited on it.
    assert proxy.stats(settle=0).connections == before, "a hit contacted the store"
