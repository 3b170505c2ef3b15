"""Pure pacing objects: token bucket, AIMD concurrency gate, backoff. Clocks are injected.

All three are thread-safe; none of them does I/O, so they are unit-tested with a fake clock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
