"""SIGTERM/SIGINT handling of the CLI: the call a signal asks for never runs inside the
handler, where it could wait for a lock the interrupted main thread holds."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from weightcache.cli.signals import calling_on


@pytest.mark.timeout(20)
def test_a_signal_while_the_main_thread_holds_the_lock_of_its_call_does_not_deadlock() -> None:
    """The daemon's hang: SIGTERM's handler ran `Event.set()` inside the `Event.set()` of
    SIGINT's handler, both in the main thread, and waited for ever on the lock the first
    one held. Here the main thread holds the lock the call needs while the signal comes."""
    lock = threading.Lock()
    called = threading.Event()

    def stop() -> None:
        with lock:
            called.set()

    with calling_on((signal.SIGUSR1,), stop):
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)  # the handler runs here, in this thread, the lock held
            assert not called.is_set()
        assert called.wait(5)


@pytest.mark.timeout(20)
def test_a_signal_given_to_another_thread_calls_while_the_main_thread_waits() -> None:
    """The kernel gives a process's signal to any thread; Python runs its handler in the
    main thread only when that one next runs bytecode, which a main thread waiting on a
    lock (the daemon's `stopping.wait()`) does not."""
    stopped = threading.Event()

    def elsewhere() -> None:
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    with calling_on((signal.SIGUSR1,), stopped.set):
        threading.Thread(target=elsewhere).start()
        assert stopped.wait(5)


def test_each_signal_calls_and_the_old_handlers_come_back() -> None:
    calls: list[float] = []
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    with calling_on((signal.SIGUSR1, signal.SIGUSR2), lambda: calls.append(time.monotonic())):
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR2)
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(calls) == 2
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before
    assert not [t for t in threading.enumerate() if t.name == "signals"]


def test_off_the_main_thread_it_installs_nothing() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    seen: list[object] = []

    def other() -> None:
        with calling_on((signal.SIGUSR1,), lambda: None):
            seen.append(signal.getsignal(signal.SIGUSR1))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [before]


def test_another_signal_with_a_handler_of_its_own_does_not_call() -> None:
    """Every handled signal reaches the wakeup fd (SIGINT's KeyboardInterrupt in `fetch`,
    which hands SIGTERM alone to the fetcher)."""
    calls: list[int] = []
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, _: seen.append(signum))
    try:
        with calling_on((signal.SIGUSR1,), lambda: calls.append(1)):
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.3)
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert seen == [signal.SIGUSR2]
    assert calls == []


def test_a_signal_right_after_its_handler_is_installed_still_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No window where the handler does nothing and no number is written."""
    install = signal.signal
    called = threading.Event()

    def install_then_signal(signum: int, handler: Any) -> Any:
        old = install(signum, handler)
        if signum == signal.SIGUSR1 and callable(handler) and old is not handler:
            os.kill(os.getpid(), signal.SIGUSR1)
        return old

    monkeypatch.setattr(signal, "signal", install_then_signal)
    with calling_on((signal.SIGUSR1,), called.set):
        assert called.wait(5)


def test_a_call_that_fails_does_not_deafen_the_next_signal() -> None:
    """A stop that raised once (logged) must not leave SIGTERM doing nothing for good."""
    calls: list[int] = []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("the first try fails")

    with calling_on((signal.SIGUSR1,), flaky):
        for expected in (1, 2):
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while len(calls) < expected and time.monotonic() < deadline:
                time.sleep(0.01)
    assert len(calls) == 2
