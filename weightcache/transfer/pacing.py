"""Pure pacing objects: token bucket, AIMD concurrency gate, backoff, and the one retry
loop of every control-plane call (`retrying`). Clocks are injected.

The objects are thread-safe; none of them does I/O, so they are unit-tested with a fake clock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from weightcache.errors import Interrupted, TransientError

log = logging.getLogger(__name__)
T = TypeVar("T")
_thread = threading.local()  # `abandoned_on`'s Event of this thread, if any
Clock = Callable[[], float]
Sleep = Callable[[float], None]


class TokenBucket:
    """One byte budget shared by every connection of a process (`--bwlimit`).

    `take(n)` debits n bytes and sleeps as long as the bucket is in debt, so the long-run
    rate never exceeds `rate` and bursts never exceed `burst` bytes.
    """

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = float(rate)
        # A quarter second of traffic (at least 64 KiB): smooth at the scale of seconds.
        self.burst = float(burst if burst is not None else max(rate / 4, 64 << 10))
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Debit n bytes now; return how many seconds the caller must wait."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def take(self, n: int) -> None:
        wait = self.reserve(n)
        if wait > 0:
            self._sleep(wait)


class AIMDGate:
    """Concurrency limit with additive increase, multiplicative decrease (§4 throttling).

    `acquire()` blocks while `limit` requests are in flight. A throttle halves the limit,
    at most once per `cooldown` seconds so that one burst of 503s from a single window
    of requests counts once; `limit` successes in a row add one slot back.
    """

    def __init__(
        self,
        maximum: int,
        minimum: int = 1,
        cooldown: float = 1.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.maximum = maximum
        self.minimum = max(1, min(minimum, maximum))
        self.limit = maximum
        self.inflight = 0
        self._cooldown = cooldown
        self._clock = clock
        self._last_decrease = float("-inf")
        self._successes = 0
        self._cond = threading.Condition()

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait for a slot; False if `stop` was set while waiting."""
        with self._cond:
            while self.inflight >= self.limit:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(0.2)
            self.inflight += 1
            return True

    def release(self) -> None:
        with self._cond:
            self.inflight -= 1
            self._cond.notify()

    def on_success(self) -> None:
        with self._cond:
            self._successes += 1
            if self._successes >= self.limit and self.limit < self.maximum:
                self.limit += 1
                self._successes = 0
                self._cond.notify()

    def on_throttle(self) -> None:
        with self._cond:
            now = self._clock()
            self._successes = 0
            if now - self._last_decrease >= self._cooldown:
                self.limit = max(self.minimum, self.limit // 2)
                self._last_decrease = now


@dataclass
class Backoff:
    """Exponential backoff with full jitter: sleep U(0, min(cap, base * 2**attempt))."""

    base: float = 0.2
    cap: float = 20.0
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int) -> float:
        """Delay before retry number `attempt` (1 for the first retry)."""
        exponent = min(max(attempt - 1, 0), 62)  # 2**62 is past any cap; no overflow
        return self.rng.uniform(0, min(self.cap, self.base * 2**exponent))


@dataclass
class Retries:
    """When one control-plane call (a listing, a HEAD, a manifest GET) is tried again
    (design §4): at most `attempts` tries, and another only if its backoff ends within
    `budget` seconds (`--timeout`) of the first try's start."""

    budget: float
    attempts: int
    backoff: Backoff = field(default_factory=Backoff)
    clock: Clock = time.monotonic
    sleep: Sleep = time.sleep

    def pause(self, attempt: int, began: float) -> float | None:
        """The pause before try `attempt + 1` of a call begun at `began` (this clock), or
        None when the call has had its tries."""
        delay = self.backoff.delay(attempt)
        if attempt >= self.attempts or self.clock() + delay > began + self.budget:
            return None
        return delay


def retry_level(attempt: int) -> int:
    """The log level of a control-plane call's failed `attempt` before it is tried again:
    the first is a warning, the next ones debug lines (-vv), as the error that ends them
    counts them all: a wrong endpoint printed 14 warnings before its one error line."""
    return logging.WARNING if attempt <= 1 else logging.DEBUG


def tries(n: int) -> str:
    """ "1 attempt", "3 attempts": for messages."""
    return "1 attempt" if n == 1 else f"{n} attempts"


#: A backend's reading of one failed attempt (`classify`): a str is its cause, and another
#: attempt may fix it; an exception is raised as it is (the backend's translation).
Verdict = str | Exception


@contextmanager
def abandoned_on(event: threading.Event) -> Iterator[None]:
    """Within it, every `retrying` of this thread stops as its `stop` would once `event` is
    set: a request made in the background that its caller no longer waits for, stopped
    without stopping the client (the main download) it shares."""
    _thread.abandoned = event
    try:
        yield
    finally:
        _thread.abandoned = None


def retrying(
    what: str,
    attempt: Callable[[], T],
    classify: Callable[[Exception], Verdict],
    retries: Retries,
    advice: str,
    stop: threading.Event | None = None,
) -> T:
    """`attempt()`'s result, tried again after a backoff while `classify` names its failure
    a cause worth retrying, within `retries`. Each failed attempt is logged as `attempt
    2/6` (`retry_level`). `what` names the call in messages; `advice` says what to do once
    the attempts are spent.

    Raises what `classify` returns for a failure no retry fixes (chained to it); Interrupted
    once `stop` (or `abandoned_on`'s Event) is set (before an attempt, after a failure, or
    during the pause);
    TransientError "giving up on <what> after N attempts in Ts, last: <cause>; <advice>"
    when the attempts or the budget are spent, chained to the last failure."""
    stops = [s for s in (stop, getattr(_thread, "abandoned", None)) if s is not None]
    began, n = retries.clock(), 0
    while True:
        n += 1
        if any(s.is_set() for s in stops):
            raise Interrupted()
        try:
            return attempt()
        except Exception as e:
            if any(s.is_set() for s in stops):  # a connection shut down by interrupt()
                raise Interrupted() from e
            verdict = classify(e)
            if isinstance(verdict, Exception):
                if verdict is e:
                    raise
                raise verdict from e
            delay = retries.pause(n, began)
            if delay is None:
                raise TransientError(
                    f"giving up on {what} after {tries(n)} in {retries.clock() - began:.0f}s, "
                    f"last: {verdict}; {advice}"
                ) from e
            log.log(retry_level(n), "%s: attempt %d/%d failed (%s); retrying in %.1fs",
                    what, n, retries.attempts, verdict, delay)  # fmt: skip
            if _pause(stops, delay, retries.sleep):
                raise Interrupted() from e


def _pause(stops: list[threading.Event], delay: float, sleep: Sleep) -> bool:
    """Wait `delay` seconds, or less if one of `stops` is set (then True)."""
    if not stops:
        sleep(delay)
        return False
    if len(stops) == 1:
        return stops[0].wait(delay)
    end = time.monotonic() + delay
    while not any(s.is_set() for s in stops):
        left = end - time.monotonic()
        if left <= 0:
            return False
        stops[0].wait(min(left, 0.1))  # the others are polled: one wait cannot watch two
    return True


class Background(Generic[T]):
    """`fn()` run in a thread; `result()` waits and returns or raises what it did. The
    interpreter waits for it before it exits: a daemon thread still in a TLS handshake while
    the interpreter finalizes crashed the process (SIGSEGV after the error line). So a
    caller that gives up on it calls `abandon()`: its control-plane calls try nothing more
    (`abandoned_on`), and the attempt in flight is its last."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._value: T | None = None
        self._error: Exception | None = None
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            with abandoned_on(self._abandoned):
                self._value = self._fn()
        except Exception as e:  # re-raised in the caller's thread by result()
            self._error = e

    def abandon(self) -> None:
        """Nobody reads the result: stop retrying (what it raises then is never read)."""
        self._abandoned.set()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value
