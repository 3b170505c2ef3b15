"""Progress of a download: a bar on a TTY, a structured log line every interval otherwise."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("weightcache.progress")
#: Seconds between reports by default: a bar redrawn twice a second on a TTY; a log line
#: every 10 s otherwise, few enough for a Pod's log.
TTY_INTERVAL = 0.5
LOG_INTERVAL = 10.0


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}TiB"


class Progress:
    """A TransferObserver that reports bytes received against a total.

    Also counts requests in flight and throttles, which the log lines carry.
    """

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        interval: float | None = None,
        started: Callable[[], None] | None = None,
    ) -> None:
        """`started()` is called once, when the first download starts (its first `expect`)."""
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = (
            interval if interval is not None else (TTY_INTERVAL if self.tty else LOG_INTERVAL)
        )
        self.received_bytes = 0
        self.inflight = 0
        self.throttles = 0
        self._start = time.monotonic()
        self._last = self._start
        self._lock = threading.Lock()
        self._line = threading.RLock()  # one writer of the TTY line at a time
        self._bar_open = False  # the bar is drawn and its line not ended yet
        self._ender = _EndsBar(self)
        self._started = started
        if self.tty:
            for handler in _handlers_on(self.stream):
                handler.addFilter(self._ender)

    def end_line(self) -> None:
        """End the bar's line, if one is drawn, with its latest state, so that what is
        written next (a log line) starts on a line of its own (they ran
        together)."""
        with self._line:
            if self._bar_open:
                self._report(time.monotonic())
                self.stream.write("\n")
                self.stream.flush()
                self._bar_open = False

    def expect(self, nbytes: int) -> None:
        """More bytes to come (called once per batch of blobs, before its GETs)."""
        with self._lock:
            self.total += nbytes
            started, self._started = self._started, None
        if started is not None:
            started()

    def request_started(self, source: str) -> None:
        with self._lock:
            self.inflight += 1

    def request_finished(self, source: str) -> None:
        with self._lock:
            self.inflight -= 1

    def throttled(self) -> None:
        with self._lock:
            self.throttles += 1

    def verify_failed(self) -> None:
        pass

    def received(self, nbytes: int, source: str) -> None:
        with self._lock:
            self.received_bytes += nbytes
            now = time.monotonic()
            if now - self._last < self.interval:
                return
            self._last = now
        self._report(now)

    def _report(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-6)
        rate = self.received_bytes / elapsed
        pct = 100.0 * self.received_bytes / self.total if self.total else 100.0
        if self.tty:
            width = 30
            filled = int(width * min(pct, 100) / 100)
            bar = "#" * filled + "-" * (width - filled)
            with self._line:
                self.stream.write(
                    f"\r{self.label} [{bar}] {pct:5.1f}% {human(self.received_bytes)}"
                    f"/{human(self.total)} {human(rate)}/s "
                )
                self.stream.flush()
                self._bar_open = True
        else:
            log.info(
                "progress revision=%s bytes=%d total=%d percent=%.1f rate_bps=%.0f "
                "inflight=%d throttled=%d",
                self.label,
                self.received_bytes,
                self.total,
                pct,
                rate,
                self.inflight,
                self.throttles,
            )

    def close(self) -> None:
        """Draw the bar's last state and end its line (unless a log line ended it), and
        stop watching the log handlers."""
        if not self.tty:
            return
        for handler in _handlers_on(self.stream):
            handler.removeFilter(self._ender)
        self.end_line()


class _EndsBar(logging.Filter):
    """On a handler writing to the bar's stream: ends the bar's line before each record."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def filter(self, record: logging.LogRecord) -> bool:
        self.progress.end_line()
        return True


def _handlers_on(stream: TextIO) -> list[logging.Handler]:
    """The root logger's handlers that write to `stream` (basicConfig's on stderr)."""
    return [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is stream]
