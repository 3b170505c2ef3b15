"""Progress of a download: a bar on a TTY, a structured log line every interval otherwise."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger("weightcache.progress")


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
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval if interval is not None else (0.5 if self.tty else 10.0)
        self.received_bytes = 0
        self.inflight = 0
        self.throttles = 0
        self._start = time.monotonic()
        self._last = self._start
        self._lock = threading.Lock()

    def expect(self, nbytes: int) -> None:
        """More bytes to come (called once per batch of blobs)."""
        with self._lock:
            self.total += nbytes

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
            self.stream.write(
                f"\r{self.label} [{bar}] {pct:5.1f}% {human(self.received_bytes)}"
                f"/{human(self.total)} {human(rate)}/s "
            )
            self.stream.flush()
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
        if self.tty and self.received_bytes:
            self._report(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
