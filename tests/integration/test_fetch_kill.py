"""kill -9 at random instants: never a marker on bad data, and the next run resumes, within
a part too (design §3 invariant 1, §4 Resume)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, Running
from tests.support.checks import (
    assert_blobs_valid,
    assert_ok_path,
    assert_revision_ok,
    markers,
)
from tests.support.faultproxy import FaultProxy
from weightcache.transfer.downloader import BUFFER
from weightcache.transfer.partial import SAVE_INTERVAL

MiB = 1024 * 1024
PART = 1 * MiB
CONCURRENCY = 4
SLACK = 64 * 1024


@dataclass
class Killed:
    trigger: str  # what the kill waited for
    run_bytes: int  # body bytes the proxy sent during this run
    exited_by_itself: int | None  # exit code if the run finished before the kill


def _run_until(
    running: Running,
    proxy: FaultProxy,
    base: int,
    *,
    after_s: float | None,
    after_bytes: int | None,
    then_sleep: float = 0.0,
    deadline_s: float = 60,
) -> int | None:
    """Poll until `after_s` seconds passed or the run got `after_bytes` through the proxy,
    sleep `then_sleep`, then SIGKILL. Returns the exit code if the process ended first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        code = running.poll()
        if code is not None:
            return code
        if after_s is not None and time.monotonic() - t0 >= after_s:
            break
        if after_bytes is not None and proxy.stats(settle=0).body_bytes - base >= after_bytes:
            break
        time.sleep(0.003)
    else:
        raise AssertionError("the fetch neither finished nor reached its kill point")
    if then_sleep:
        time.sleep(then_sleep)
        code = running.poll()
        if code is not None:
            return code
    running.kill9()
    return None


def _check_invariants(cache_dir: Path, pub: Published) -> bool:
    """After any kill: a marker only on a verified revision, every blob matches its name.
    Returns whether the revision is marked."""
    found = markers(cache_dir)
    assert found in ([], [pub.local_path(cache_dir) / ".weightcache"]), found
    assert_blobs_valid(cache_dir)
    if found:
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    return bool(found)


@pytest.mark.timeout(240)
def test_kill9_at_random_moments_then_resume(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([8 * MiB] * 4, name="killme", rev="r1")
    size = pub.model.total_size
    args = ("--part-size", "1M", "--max-concurrency", str(CONCURRENCY))
    rng = random.Random(20261129)
    # The proxy paces the store at 8 MiB/s so each kill lands where it was aimed.
    proxy.configure(rate_limit=8 * MiB)

    kills = 12
    big = rng.randrange(kills)  # one run goes far enough that whole parts are surely done
    history: list[Killed] = []
    for i in range(kills):
        base = proxy.stats().body_bytes
        if i == big:
            trigger, after_s, after_bytes = "bytes>=6MiB", None, 6 * MiB
        elif rng.random() < 0.3:  # startup, lock, manifest and listing
            after_s = rng.uniform(0.05, 0.8)
            trigger, after_bytes = f"t={after_s:.2f}s", None
        else:
            after_bytes = rng.randrange(0, 2 * MiB)
            trigger, after_s = f"bytes>={after_bytes}", None
        running = wc.fetch_popen(pub.source, cache_dir, *args, endpoint=proxy.url)
        code = _run_until(running, proxy, base, after_s=after_s, after_bytes=after_bytes)
        run_bytes = proxy.stats().body_bytes - base
        history.append(Killed(trigger, run_bytes, code))
        if code is not None:
            assert code == 0, running.finish().stderr
        _check_invariants(cache_dir, pub)

    completed_early = any(k.exited_by_itself == 0 for k in history)
    killed_bytes = proxy.stats().body_bytes

    proxy.configure(rate_limit=None)
    final = wc.fetch(pub.source, cache_dir, *args, endpoint=proxy.url)
    assert_ok_path(final, pub.local_path(cache_dir))
    assert _check_invariants(cache_dir, pub)
    final_bytes = proxy.stats().body_bytes - killed_bytes
    total = killed_bytes + final_bytes

    report = f"history={history} final_bytes={final_bytes} size={size}"
    # A kill may lose the parts in flight (at most CONCURRENCY of them), nothing else: a
    # run that got B bytes left at least B - CONCURRENCY * PART of whole parts on disk
    # (minus a little for the manifest and listing it read).
    in_flight = CONCURRENCY * PART + 16 * 1024
    assert total <= size + kills * in_flight + SLACK, report
    if completed_early:
        assert final_bytes == 0, report
    else:
        saved = sum(max(0, k.run_bytes - in_flight) for k in history)
        assert saved >= 1 * MiB, f"the kill schedule left nothing to resume: {report}"
        assert final_bytes <= size - saved + SLACK, report


@pytest.mark.timeout(240)
def test_kill9_on_a_slow_link_resumes_every_part_where_it_was_written(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """Killed every few seconds on a slow link, no 16 MiB part ever completes in one run;
    each run resumes every part where the last one wrote it, so across the kills the store
    resends only what each kill lost: per worker the buffer it was filling, plus what was
    written since the last save of the part state."""
    pub = publish([32 * MiB], name="slowlink", rev="r1")
    size = pub.model.total_size
    rate, concurrency, kills, per_run = 2 * MiB, 2, 5, 3 * MiB  # 1.5 MiB a part a run
    args = ("--part-size", "16M", "--max-concurrency", str(concurrency))
    proxy.configure(rate_limit=rate)
    runs: list[int] = []
    for _ in range(kills):
        base = proxy.stats().body_bytes
        running = wc.fetch_popen(pub.source, cache_dir, *args, endpoint=proxy.url)
        code = _run_until(running, proxy, base, after_s=None, after_bytes=per_run)
        assert code is None, running.finish().stderr  # killed: it cannot finish in time
        runs.append(proxy.stats().body_bytes - base)
        assert not _check_invariants(cache_dir, pub)

    proxy.configure(rate_limit=None)
    final = wc.fetch(pub.source, cache_dir, *args, endpoint=proxy.url)
    assert_ok_path(final, pub.local_path(cache_dir))
    assert _check_invariants(cache_dir, pub)
    refetched = proxy.stats().body_bytes - size
    lost_per_kill = concurrency * BUFFER + int(rate * SAVE_INTERVAL) + SLACK
    report = f"runs={runs} refetched={refetched} bound={kills * lost_per_kill} size={size}"
    print(report)
    # The old part state (a done bit per part) resent every byte of every killed run here.
    assert sum(runs) >= 2 * kills * lost_per_kill, f"the kills came too early: {report}"
    assert refetched <= kills * lost_per_kill, report


@pytest.mark.timeout(240)
def test_a_fetch_resumed_with_another_part_size_keeps_what_the_killed_one_wrote(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([8 * MiB], name="regrid", rev="r1")
    size = pub.model.total_size
    proxy.configure(rate_limit=4 * MiB)
    running = wc.fetch_popen(pub.source, cache_dir, "--part-size", "1M", endpoint=proxy.url)
    code = _run_until(running, proxy, 0, after_s=None, after_bytes=size // 2,
                      then_sleep=3 * SAVE_INTERVAL)  # fmt: skip
    assert code is None, running.finish().stderr
    base = proxy.stats().body_bytes

    proxy.configure(rate_limit=None)
    again = wc.fetch(pub.source, cache_dir, "--part-size", "2M", endpoint=proxy.url)
    assert_ok_path(again, pub.local_path(cache_dir))
    assert _check_invariants(cache_dir, pub)
    assert "resuming" in again.stderr, again.stderr
    resent = proxy.stats().body_bytes - base
    assert resent <= size - size // 4, f"{resent} of {size} bytes downloaded again"


@pytest.mark.timeout(240)
def test_kill9_near_completion_never_marks_bad_data(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, tmp_path: Path
) -> None:
    """Kills aimed at the end: last bytes arriving, hashing, linking, renaming, marking."""
    pub = publish([2 * MiB] * 4, name="finish", rev="r1")
    size = pub.model.total_size
    rng = random.Random(7)
    outcomes: list[str] = []
    for i in range(12):
        if i >= 6 and "killed-before-marker" in outcomes:
            break
        cache_dir = tmp_path / f"cache{i}"
        proxy.configure(rate_limit=16 * MiB)
        base = proxy.stats().body_bytes
        running = wc.fetch_popen(pub.source, cache_dir, "--part-size", "1M",
                                 endpoint=proxy.url)  # fmt: skip
        code = _run_until(running, proxy, base, after_s=None,
                          after_bytes=size - rng.randrange(0, 768 * 1024),
                          then_sleep=rng.choice([0.0, rng.uniform(0.0, 0.06)]))  # fmt: skip
        if code is not None:
            assert code == 0, running.finish().stderr
            outcomes.append("finished")
        marked = _check_invariants(cache_dir, pub)
        if code is None:
            outcomes.append("killed-after-marker" if marked else "killed-before-marker")
        proxy.configure(rate_limit=None)
        again = wc.fetch(pub.source, cache_dir, endpoint=proxy.url)
        assert_ok_path(again, pub.local_path(cache_dir))
        assert _check_invariants(cache_dir, pub)
    # The test only means something if some kills landed before the marker.
    assert "killed-before-marker" in outcomes, outcomes


def test_sigterm_stops_the_fetch_saying_so_and_the_next_run_resumes(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """The kubelet deleting a Pod sends SIGTERM: the fetch stops after its current reads,
    saves where each part got to, and says so in one line with exit 143; nothing marked."""
    import json
    import signal

    pub = publish([16 * MiB], name="sigterm", rev="r1")
    proxy.configure(rate_limit=4 * MiB)
    running = wc.fetch_popen(pub.source, cache_dir, "--part-size", "8M", endpoint=proxy.url)
    t0 = time.monotonic()
    while proxy.stats(settle=0).body_bytes < 4 * MiB:
        assert running.poll() is None and time.monotonic() - t0 < 60
        time.sleep(0.01)
    running.proc.send_signal(signal.SIGTERM)
    done = running.finish(timeout=60)
    assert done.returncode == 143, done.stderr
    assert "weightcache: error: download interrupted; partial files are kept for resume" in (
        done.stderr
    ), done.stderr
    assert "Traceback" not in done.stderr
    got = proxy.stats().body_bytes
    states = [json.loads(p.read_text()) for p in (cache_dir / ".weightcache" / "tmp").glob(
        "*.part.json")]  # fmt: skip
    shard = max(states, key=lambda state: state["size"])
    assert shard["size"] == 16 * MiB
    saved = sum(shard["written"])
    # Everything else the proxy sent is the small files, published whole.
    small = pub.model.total_size - 16 * MiB
    assert got - small - saved <= 2 * BUFFER + SLACK, (got, saved)  # saved as it stopped
    assert not _check_invariants(cache_dir, pub)
    proxy.configure(rate_limit=None)
    assert_ok_path(wc.fetch(pub.source, cache_dir, endpoint=proxy.url), pub.local_path(cache_dir))
