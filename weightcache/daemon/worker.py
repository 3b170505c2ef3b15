"""The daemon's background loops, supervised: a failing step is contained, retried with a
backoff and reported to /healthz; a loop that dies is reported too (design §5, Roles).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def backoff(failures: int, base: float, cap: float) -> float:
    """Seconds to wait after `failures` failures in a row (1 for the first): doubling."""
    return min(cap, base * 2.0 ** min(max(failures - 1, 0), 30))


class Worker:
    """One of the daemon's loops: `step()` every `interval` seconds on its own thread,
    until `stopping` is set.

    Nothing a step raises ends the loop (a sqlite3.Error or OSError used to end the
    prefetch thread silently): the failure is logged as one line and the step is
    retried after a backoff doubling up to `max_delay`. `problem()` is what /healthz
    reports: the thread died, the step failed UNHEALTHY_AFTER times in a row, or one step
    has run longer than `stuck_after` seconds (a read blocked on a sick disk or mount:
    nothing raises, and without this the daemon would say it is fine while it is not).
    """

    UNHEALTHY_AFTER = 3

    def __init__(
        self,
        name: str,
        step: Callable[[], None],
        interval: float,
        stopping: threading.Event,
        max_delay: float = 30.0,
        stuck_after: float | None = None,
    ) -> None:
        self.name = name
        self.step = step
        self.interval = interval
        self.stopping = stopping
        self.max_delay = max_delay
        self.stuck_after = stuck_after
        self._running_since: float | None = None  # monotonic start of the step running
        self.failures = 0  # failed steps in a row
        self.error: str | None = None  # the last one, as `Type: message`
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def run_once(self) -> None:
        """One step, its failure contained and counted."""
        self._running_since = time.monotonic()
        try:
            self.step()
        except Exception as e:
            self.failures += 1
            self.error = f"{type(e).__name__}: {e}"
            log.error(
                "the %s step failed (%d in a row), retrying in %.0fs: %s",
                self.name,
                self.failures,
                self._delay(),
                self.error,
            )
            log.debug("the %s step failed", self.name, exc_info=True)
            return
        finally:
            self._running_since = None
        if self.failures:
            log.info("the %s step works again after %d failure(s)", self.name, self.failures)
        self.failures = 0

    def problem(self) -> str | None:
        """None while the loop runs and its step succeeds, else one line."""
        died = self._thread.ident is not None and not self._thread.is_alive()
        if died and not self.stopping.is_set():
            return f"the {self.name} worker died ({self.error or 'no error recorded'})"
        if self.failures >= self.UNHEALTHY_AFTER:
            return f"the {self.name} step failed {self.failures} times in a row: {self.error}"
        since = self._running_since
        running = 0.0 if since is None else time.monotonic() - since
        if self.stuck_after is not None and running > self.stuck_after:
            return (
                f"the {self.name} step has been running for {running:.0f}s (more than "
                f"{self.stuck_after:.0f}s): it is stuck, on a disk or mount that does not answer"
            )
        return None

    def _delay(self) -> float:
        if not self.failures:
            return self.interval
        return max(self.interval, backoff(self.failures, self.interval, self.max_delay))

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self.run_once()
                self.stopping.wait(self._delay())
        except BaseException as e:  # SystemExit & co. end the thread: problem() says so
            self.error = f"{type(e).__name__}: {e}"
            log.critical("the %s worker died: %s", self.name, self.error)
