"""SIGTERM and SIGINT turned into a call made on a thread of their own.

A Python signal handler runs in the main thread between two of its bytecodes, so it may
run inside a `with lock:` of the very object it would stop: a handler calling
`threading.Event.set()` while the main thread is inside `Event.wait()` or `set()`, or the
fetcher's `interrupt()` while the main thread builds a downloader under the same lock,
waits for a lock its own thread holds, for ever. Seen: the daemon sent SIGINT and SIGTERM
together (Ctrl-C in the demo) hung in a second `Event.set()` inside the first. And it runs
late or never when the kernel gives the signal to another thread while the main thread
waits on a lock. So the signal's number goes through `signal.set_wakeup_fd` (written by
the C handler, in whichever thread got it) to a thread that makes the call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def calling_on(signals: Iterable[signal.Signals], call: Callable[[], None]) -> Iterator[None]:
    """While inside, each of `signals` makes `call()` run at once on another thread; their
    previous handlers come back on leaving. Signals are the main thread's: called from
    another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = {int(s) for s in signals}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def relay() -> None:
        while numbers := os.read(read_end, 64):  # b"": the write end closed on leaving
            if wanted.intersection(numbers):  # not SIGINT's KeyboardInterrupt, say
                try:
                    call()
                except Exception:  # the next signal must still be heard
                    log.exception("stopping on a signal failed")

    thread = threading.Thread(target=relay, name="signals", daemon=True)
    thread.start()
    # The wakeup fd before the handlers and after them on leaving: a signal handled by the
    # no-op handler always has its number written. The handler is Python's own, so that
    # the C one writes the number (and not the default action); it does nothing else.
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous = {s: signal.signal(s, lambda *_: None) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_end)
        thread.join()
        os.close(read_end)
