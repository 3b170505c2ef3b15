"""A control-plane call caught in the pause between two attempts: what the tests of its
interruption share."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

from weightcache.transfer.pacing import Backoff


class _Top(random.Random):
    """Full jitter at its top: every pause is the backoff's whole cap."""

    def uniform(self, a: float, b: float) -> float:
        return b


def long_backoff() -> Backoff:
    """A backoff whose every pause is 300 s: a test sees whether anything cuts it short."""
    return Backoff(base=300.0, cap=300.0, rng=_Top())


def interrupted_in_pause(
    call: Callable[[], object], failed: threading.Event, interrupt: Callable[[], None]
) -> list[BaseException]:
    """Run `call` on a thread; once `failed` is set (an attempt failed, its pause begun),
    `interrupt()`. Returns what `call` raised; asserts that it ended within 10 s."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert failed.wait(10.0)
    interrupt()
    thread.join(10.0)  # not the 300 s of the pause
    assert not thread.is_alive(), "the pause outlasted interrupt()"
    return raised
