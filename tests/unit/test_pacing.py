"""pacing: token bucket, AIMD concurrency gate and backoff, driven by a fake clock."""

from __future__ import annotations

import logging
import random
import threading
from typing import TYPE_CHECKING

import pytest

from weightcache.errors import Interrupted, SourceError, TransientError
from weightcache.transfer.pacing import (
    AIMDGate,
    Backoff,
    Retries,
    TokenBucket,
    Verdict,
    abandoned_on,
    retrying,
    tries,
)

if TYPE_CHECKING:
    from tests.unit.conftest import FakeClock

# -- TokenBucket -------------------------------------------------------------------------------


def test_token_bucket_validates_and_defaults(clock: FakeClock) -> None:
    with pytest.raises(ValueError):
        TokenBucket(0, clock=clock, sleep=clock.sleep)
    with pytest.raises(ValueError):
        TokenBucket(-1, clock=clock, sleep=clock.sleep)
    # A quarter second of traffic, at least 64 KiB.
    assert TokenBucket(4 << 20, clock=clock).burst == 1 << 20
    assert TokenBucket(1000, clock=clock).burst == 64 << 10
    assert TokenBucket(1000, burst=10, clock=clock).burst == 10


@pytest.mark.parametrize("sizes", [[300] * 100, [1000] * 100, [7, 5000, 1, 333, 2048] * 20])
def test_token_bucket_long_run_rate_never_exceeds_the_limit(
    clock: FakeClock, sizes: list[int]
) -> None:
    rate, burst = 1000.0, 500.0
    bucket = TokenBucket(rate, burst=burst, clock=clock, sleep=clock.sleep)
    start = clock()
    taken = 0
    for n in sizes:
        bucket.take(n)
        taken += n
        elapsed = clock() - start
        # Whatever has been taken by now fits in the burst plus the rate times the time.
        assert taken <= burst + rate * elapsed + 1e-6
    # ... and the bucket does not throttle harder than it must.
    assert clock() - start == pytest.approx((taken - burst) / rate)


def test_token_bucket_sleeps_exactly_the_debt(clock: FakeClock) -> None:
    bucket = TokenBucket(1000, burst=500, clock=clock, sleep=clock.sleep)
    bucket.take(500)  # the burst: free
    assert clock.sleeps == []
    bucket.take(250)
    assert clock.sleeps == [pytest.approx(0.25)]
    clock.advance(10.0)  # idle: refills, but only up to the burst
    bucket.take(500)
    assert clock.sleeps == [pytest.approx(0.25)]
    bucket.take(1)
    assert clock.sleeps[-1] == pytest.approx(0.001)


def test_token_bucket_burst_bound_after_a_long_idle(clock: FakeClock) -> None:
    bucket = TokenBucket(1000, burst=500, clock=clock, sleep=clock.sleep)
    clock.advance(3600.0)
    assert bucket.reserve(500) == 0.0
    assert bucket.reserve(1) == pytest.approx(0.001)
    clock.advance(3600.0)
    # An hour of idling buys the burst, not an hour of traffic.
    assert bucket.reserve(1500) == pytest.approx(1.0)


def test_token_bucket_debts_of_concurrent_callers_add_up(clock: FakeClock) -> None:
    # Two connections taking at the same instant share one budget: the second waits for both.
    bucket = TokenBucket(1000, burst=100, clock=clock, sleep=clock.sleep)
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(1000) == pytest.approx(1.0)
    assert bucket.reserve(1000) == pytest.approx(2.0)
    clock.advance(2.0)
    assert bucket.reserve(0) == pytest.approx(0.0)
    assert bucket.reserve(500) == pytest.approx(0.5)


def test_token_bucket_threads_share_one_budget(clock: FakeClock) -> None:
    lock = threading.Lock()
    waits: list[float] = []
    bucket = TokenBucket(1000, burst=100, clock=clock, sleep=lambda s: None)

    def worker() -> None:
        for _ in range(50):
            w = bucket.reserve(10)
            with lock:
                waits.append(w)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    # 200 takes of 10 bytes at one instant: 2000 bytes, 100 of them free.
    assert len(waits) == 200
    assert max(waits) == pytest.approx((2000 - 100) / 1000)


# -- AIMDGate ----------------------------------------------------------------------------------


def test_gate_starts_at_maximum_and_clamps_minimum(clock: FakeClock) -> None:
    gate = AIMDGate(16, clock=clock)
    assert (gate.limit, gate.minimum, gate.maximum, gate.inflight) == (16, 1, 16, 0)
    assert AIMDGate(4, minimum=10, clock=clock).minimum == 4
    assert AIMDGate(4, minimum=0, clock=clock).minimum == 1


def test_gate_halves_on_throttle_with_cooldown(clock: FakeClock) -> None:
    gate = AIMDGate(16, cooldown=1.0, clock=clock)
    gate.on_throttle()
    assert gate.limit == 8
    clock.advance(0.5)
    gate.on_throttle()  # same burst of 503s: counts once
    assert gate.limit == 8
    clock.advance(0.499)
    gate.on_throttle()
    assert gate.limit == 8
    clock.advance(0.001)  # a full cooldown since the last decrease
    gate.on_throttle()
    assert gate.limit == 4


def test_gate_never_goes_below_minimum(clock: FakeClock) -> None:
    gate = AIMDGate(16, cooldown=1.0, clock=clock)
    for _ in range(10):
        gate.on_throttle()
        clock.advance(1.0)
    assert gate.limit == 1
    floored = AIMDGate(16, minimum=3, cooldown=1.0, clock=clock)
    seen = []
    for _ in range(6):
        floored.on_throttle()
        seen.append(floored.limit)
        clock.advance(1.0)
    assert seen == [8, 4, 3, 3, 3, 3]


def test_gate_additive_increase_after_limit_successes(clock: FakeClock) -> None:
    gate = AIMDGate(8, cooldown=1.0, clock=clock)
    gate.on_throttle()
    clock.advance(1.0)
    gate.on_throttle()
    assert gate.limit == 2
    gate.on_success()
    assert gate.limit == 2
    gate.on_success()
    assert gate.limit == 3  # 2 successes at limit 2
    for _ in range(2):
        gate.on_success()
    assert gate.limit == 3
    gate.on_success()
    assert gate.limit == 4  # 3 successes at limit 3
    for _ in range(1000):
        gate.on_success()
    assert gate.limit == 8  # never above the maximum


def test_gate_throttle_breaks_the_run_of_successes(clock: FakeClock) -> None:
    gate = AIMDGate(8, cooldown=10.0, clock=clock)
    gate.on_throttle()
    clock.advance(10.0)
    gate.on_throttle()
    assert gate.limit == 2
    gate.on_success()
    clock.advance(1.0)
    gate.on_throttle()  # within the cooldown: no decrease, but the run starts over
    assert gate.limit == 2
    gate.on_success()
    assert gate.limit == 2
    gate.on_success()
    assert gate.limit == 3


def test_gate_acquire_counts_inflight_and_stops_at_the_limit(clock: FakeClock) -> None:
    gate = AIMDGate(2, clock=clock)
    stop = threading.Event()
    assert gate.acquire(stop) is True
    assert gate.acquire(stop) is True
    assert gate.inflight == 2
    stop.set()
    assert gate.acquire(stop) is False  # full: a set stop returns instead of waiting
    assert gate.inflight == 2
    gate.release()
    assert gate.acquire(stop) is True  # a free slot is taken even with stop set
    assert gate.inflight == 2


def test_gate_acquire_blocks_until_a_release(clock: FakeClock) -> None:
    gate = AIMDGate(1, clock=clock)
    assert gate.acquire()
    stop = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(gate.acquire(stop)), daemon=True)
    waiter.start()
    try:
        waiter.join(timeout=0.1)
        assert waiter.is_alive(), "acquire did not block at the limit"
        assert gate.inflight == 1
        gate.release()
        waiter.join(timeout=2.0)
        assert not waiter.is_alive()
        assert result == [True]
        assert gate.inflight == 1
    finally:
        stop.set()
        waiter.join(timeout=1.0)


def test_gate_lowered_below_inflight_admits_nobody_until_drained(clock: FakeClock) -> None:
    gate = AIMDGate(4, clock=clock)
    for _ in range(4):
        assert gate.acquire()
    gate.on_throttle()
    assert gate.limit == 2
    stop = threading.Event()
    stop.set()
    for expected_inflight in (3, 2):
        gate.release()
        assert gate.inflight == expected_inflight
        assert gate.acquire(stop) is False
    gate.release()
    assert gate.acquire(stop) is True
    assert gate.inflight == 2


def test_gate_increase_wakes_a_waiter(clock: FakeClock) -> None:
    gate = AIMDGate(2, clock=clock)
    gate.on_throttle()
    assert gate.limit == 1
    assert gate.acquire()
    stop = threading.Event()
    acquired = threading.Event()

    def wait() -> None:
        if gate.acquire(stop):
            acquired.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        assert not acquired.wait(0.1)
        gate.on_success()
        assert gate.limit == 2
        assert acquired.wait(2.0)
        assert gate.inflight == 2
    finally:
        stop.set()
        waiter.join(timeout=1.0)


# -- Backoff -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("base", "cap"), [(0.2, 20.0), (1.0, 5.0), (0.05, 0.05)])
def test_backoff_delay_within_full_jitter_bounds(base: float, cap: float) -> None:
    backoff = Backoff(base=base, cap=cap, rng=random.Random(1234))
    for attempt in range(1, 16):
        bound = min(cap, base * 2 ** (attempt - 1))
        delays = [backoff.delay(attempt) for _ in range(300)]
        assert all(0.0 <= d <= bound for d in delays), (attempt, bound, max(delays))
        # Full jitter: the whole interval is used, not just its top or bottom.
        assert min(delays) < 0.1 * bound
        assert max(delays) > 0.9 * bound


def test_backoff_grows_exponentially_then_caps() -> None:
    backoff = Backoff(base=0.2, cap=20.0, rng=random.Random(7))
    means = [sum(backoff.delay(a) for _ in range(2000)) / 2000 for a in (1, 2, 3, 4, 10, 20)]
    expected = [0.1, 0.2, 0.4, 0.8, 10.0, 10.0]  # half of min(cap, base * 2**(n-1))
    for mean, want in zip(means, expected, strict=True):
        assert mean == pytest.approx(want, rel=0.1)


def test_backoff_is_reproducible_with_a_seeded_rng() -> None:
    a = Backoff(rng=random.Random(99))
    b = Backoff(rng=random.Random(99))
    assert [a.delay(n) for n in range(1, 20)] == [b.delay(n) for n in range(1, 20)]


def test_backoff_caps_a_very_high_attempt_number() -> None:
    backoff = Backoff(base=0.2, cap=20.0, rng=random.Random(0))
    assert 0.0 <= backoff.delay(1100) <= 20.0


class _Fixed(Backoff):
    """A backoff of `wait` seconds before every retry."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.wait = wait

    def delay(self, attempt: int) -> float:
        return self.wait


def test_retries_stop_at_the_attempts_or_when_the_budget_would_be_passed() -> None:
    now = [100.0]
    retries = Retries(budget=10.0, attempts=4, backoff=_Fixed(2.0), clock=lambda: now[0])
    assert [retries.pause(a, 100.0) for a in (1, 2, 3)] == [2.0, 2.0, 2.0]
    assert retries.pause(4, 100.0) is None  # the fourth try was the last
    now[0] = 107.9  # the pause would end at 109.9, within the budget
    assert retries.pause(1, 100.0) == 2.0
    now[0] = 108.1  # it would end at 110.1: past the budget
    assert retries.pause(1, 100.0) is None
    # a budget shorter than one try: that try is the only one
    assert Retries(1.0, 6, _Fixed(0.0), clock=lambda: 101.5).pause(1, 100.0) is None


def test_tries_reads_as_english() -> None:
    assert (tries(1), tries(6)) == ("1 attempt", "6 attempts")


# -- retrying ----------------------------------------------------------------------------------


class _Flaky:
    """An attempt that fails with each of `failures` in turn, then returns "done"."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "done"


def _classify(e: Exception) -> Verdict:
    """Timeouts are worth another attempt; anything else is a refusal."""
    if isinstance(e, TimeoutError):
        return f"timed out: {e}"
    return SourceError(f"refused: {e}")


class _Stop(threading.Event):
    """A stop switch whose waits pass on the fake clock; set on its `at`-th wait."""

    def __init__(self, clock: FakeClock, at: int = 0) -> None:
        super().__init__()
        self.clock, self.at, self.waits = clock, at, 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.clock.sleep(timeout or 0.0)
        if self.waits == self.at:
            self.set()
        return self.is_set()


def _retries(clock: FakeClock, attempts: int = 4, wait: float = 2.0) -> Retries:
    return Retries(60.0, attempts, _Fixed(wait), clock=clock, sleep=clock.sleep)


def test_retrying_tries_again_what_classify_calls_retryable(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    call = _Flaky(TimeoutError("a"), TimeoutError("b"))
    caplog.set_level(logging.DEBUG, logger="weightcache.transfer.pacing")
    assert retrying("GET x", call, _classify, _retries(clock), "try again") == "done"
    assert call.calls == 3 and clock.sleeps == [2.0, 2.0]
    # the first failure a warning, the next a debug line, each counted against the attempts
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "GET x: attempt 1/4 failed (timed out: a); retrying in 2.0s"),
        (logging.DEBUG, "GET x: attempt 2/4 failed (timed out: b); retrying in 2.0s"),
    ]


def test_retrying_raises_the_translation_of_what_no_retry_fixes(clock: FakeClock) -> None:
    call = _Flaky(TimeoutError("a"), PermissionError("no"))
    with pytest.raises(SourceError, match="refused: no") as raised:
        retrying("GET x", call, _classify, _retries(clock), "try again")
    assert call.calls == 2 and isinstance(raised.value.__cause__, PermissionError)
    own = _Flaky(SourceError("missing"))  # a translation the attempt raised itself
    with pytest.raises(SourceError, match="missing") as raised:
        retrying("GET x", own, lambda e: e, _retries(clock), "try again")
    assert raised.value.__cause__ is None and own.calls == 1


def test_retrying_gives_up_in_one_wording_counting_attempts_and_time(clock: FakeClock) -> None:
    call = _Flaky(*[TimeoutError(str(n)) for n in range(9)])
    with pytest.raises(TransientError) as raised:
        retrying("LIST s3://b/p/", call, _classify, _retries(clock), "check the store")
    assert str(raised.value) == (
        "giving up on LIST s3://b/p/ after 4 attempts in 6s, last: timed out: 3; check the store"
    )
    assert call.calls == 4 and isinstance(raised.value.__cause__, TimeoutError)


def test_retrying_stops_when_interrupted_between_attempts(clock: FakeClock) -> None:
    stop = _Stop(clock, at=1)  # set during the pause after the first failure
    call = _Flaky(TimeoutError("a"), TimeoutError("b"))
    with pytest.raises(Interrupted):
        retrying("GET x", call, _classify, _retries(clock), "try again", stop)
    assert call.calls == 1 and stop.waits == 1
    # set before the call: nothing is tried; set while it failed: not retried, not refused
    stop.set()
    with pytest.raises(Interrupted):
        retrying("GET x", call, _classify, _retries(clock), "try again", stop)
    assert call.calls == 1
    failing = _Flaky(PermissionError("a connection shut down"))
    other = _Stop(clock)

    def interrupted_attempt() -> str:
        other.set()
        return failing()

    with pytest.raises(Interrupted):
        retrying("GET x", interrupted_attempt, _classify, _retries(clock), "try again", other)


def test_retrying_stops_once_its_thread_is_abandoned_not_others(clock: FakeClock) -> None:
    """A request in the background whose caller gave up tries nothing more, even during a
    long pause, while the client's `stop` (the main download's) stays unset; after it, the
    thread's calls retry again."""
    abandoned, stop = threading.Event(), _Stop(clock)
    call = _Flaky(TimeoutError("a"), TimeoutError("b"))

    def abandoning() -> str:
        threading.Timer(0.05, abandoned.set).start()  # set during the attempt or the pause
        return call()

    with abandoned_on(abandoned), pytest.raises(Interrupted):
        retrying("GET x", abandoning, _classify, _retries(clock, wait=30.0), "", stop)
    assert call.calls == 1 and not stop.is_set()
    again = _Flaky(TimeoutError("a"))
    assert retrying("GET x", again, _classify, _retries(clock), "", stop) == "done"
    assert again.calls == 2
