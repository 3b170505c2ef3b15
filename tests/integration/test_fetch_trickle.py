"""A store that trickles bytes (design §4, Stall bound): the stall clock moves with the bytes
received, checked after every socket read, so a trickle ends in exit 6 after `--timeout`
while a slow but steady store still completes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.support.checks import assert_fails, assert_ok_path, assert_revision_ok, markers
from tests.support.faultproxy import FaultProxy

KiB = 1024
TIMEOUT_S = 5
SLACK_S = 20  # Python start, the last socket read, a loaded 2-core box


@pytest.mark.timeout(150)
def test_a_store_trickling_one_byte_a_second_is_exit_6_after_the_timeout(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """Each read gets a byte well within the socket timeout, so only a stall clock that
    looks at every read (not at whole 256 KiB buffers) ever gives up."""
    pub = publish([64 * KiB], name="trickle", rev="r1", small_files=False)
    proxy.configure(scope="data", trickle_rate=1.0)
    t0 = time.monotonic()
    try:
        proc = wc.fetch(pub.source, cache_dir, "--timeout", f"{TIMEOUT_S}s",
                        endpoint=proxy.url, timeout=90)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the fetch from a trickling store was still running after 90s")
    elapsed = time.monotonic() - t0
    message = assert_fails(proc, 6)
    assert elapsed <= TIMEOUT_S + SLACK_S, f"gave up after {elapsed:.1f}s: {message}"
    assert "model-00001-of-00001.safetensors" in message, message
    assert markers(cache_dir) == []
    assert 0 < proxy.stats().bytes_for(".safetensors") < 64 * KiB, "no trickle happened"


@pytest.mark.timeout(150)
def test_a_slow_but_steady_store_completes_past_the_timeout(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """8 KiB/s for ~8s with --timeout 5s: every read is progress, the fetch succeeds."""
    pub = publish([64 * KiB], name="steady", rev="r1", small_files=False)
    proxy.configure(scope="data", trickle_rate=8 * KiB)
    t0 = time.monotonic()
    proc = wc.fetch(pub.source, cache_dir, "--timeout", f"{TIMEOUT_S}s",
                    endpoint=proxy.url, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - t0
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert elapsed >= 64 / 8 - 1, f"took {elapsed:.1f}s: the store did not trickle"


@pytest.mark.timeout(150)
def test_waiting_for_bwlimit_tokens_is_not_a_stall(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    """--bwlimit 32K makes the first 256 KiB read wait ~6s for tokens, longer than
    --timeout 3s: that wait is ours, not the store's, and must not end the fetch."""
    pub = publish([320 * KiB], name="paced", rev="r1", small_files=False)
    t0 = time.monotonic()
    proc = wc.fetch(pub.source, cache_dir, "--timeout", "3s", "--bwlimit", "32K", timeout=120)
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert time.monotonic() - t0 >= 5, "the bandwidth limit was not applied"


@pytest.mark.timeout(150)
def test_a_starved_response_at_the_hash_frontier_is_overtaken_on_another_connection(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    """The first part's response crawls (128 KiB/s: 16 s for its 2 MiB) while the others
    flow (4 MiB/s): after a second another worker reads the rest of that part on its own
    kept-alive connection, and the starved reader stops where that begins, its connection
    dropped (kept with a body unread, its next request would fail), then takes more parts."""
    pub = publish([16 << 20], name="straggler", rev="r1", small_files=False)
    proxy.configure(scope="data", script=("slow",), slow_rate=128 * KiB, rate_limit=4 << 20)
    t0 = time.monotonic()
    proc = wc.fetch(pub.source, cache_dir, "--part-size", "2M", "--max-concurrency", "2",
                    endpoint=proxy.url, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - t0
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert "attempt" not in proc.stderr, proc.stderr  # no request failed
    stats = proxy.stats()
    assert stats.faults.get("slow") == 1
    assert stats.requests_for(".safetensors") == 8 + 1  # eight parts and the first one's tail
    assert elapsed < 16, f"{elapsed:.1f}s: the fetch waited for the starved response"
