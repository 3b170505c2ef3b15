"""The daemon's supervised loops (design §5, Roles): a failing step never ends its loop, is
retried with a backoff and, failing again and again, is reported; a loop that dies is
reported too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from weightcache.daemon.worker import Worker, backoff


def wait_until(what: str, predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff(n, 10.0, 300.0) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]
    assert backoff(10_000, 1.0, 60.0) == 60.0


class Steps:
    """A step that raises what it is told to, and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.raise_: BaseException | None = None

    def __call__(self) -> None:
        self.calls += 1
        if self.raise_ is not None:
            raise self.raise_


def test_a_failing_step_is_retried_reported_and_recovers() -> None:
    stopping = threading.Event()
    step = Steps()
    step.raise_ = OSError(30, "Read-only file system")
    worker = Worker("housekeeping", step, interval=0.01, stopping=stopping, max_delay=0.05)
    worker.start()
    try:
        wait_until("3 failures", lambda: worker.failures >= 3)
        problem = worker.problem()
        assert problem is not None and "housekeeping" in problem, problem
        assert "OSError" in problem and "Read-only file system" in problem, problem
        step.raise_ = None
        wait_until("a success", lambda: worker.failures == 0)
        assert worker.problem() is None
        calls = step.calls
        wait_until("the loop to go on", lambda: step.calls > calls + 2)
    finally:
        stopping.set()
        worker.join(10)


def test_one_failure_is_not_yet_a_health_problem() -> None:
    worker = Worker("converge", Steps(), interval=1.0, stopping=threading.Event())
    worker.step.raise_ = KeyError("x")  # type: ignore[attr-defined]
    worker.run_once()
    assert worker.failures == 1
    assert worker.problem() is None


def test_a_worker_that_dies_is_reported() -> None:
    stopping = threading.Event()
    step = Steps()
    step.raise_ = SystemExit("a library called sys.exit()")
    worker = Worker("converge", step, interval=0.01, stopping=stopping)
    assert worker.problem() is None  # not started: nothing to report
    worker.start()
    worker.join(10)
    problem = worker.problem()
    assert problem is not None and "converge worker died" in problem, problem
    assert "SystemExit" in problem, problem
    stopping.set()  # a loop that ended because the daemon stops is no problem
    assert worker.problem() is None


def test_a_stopped_worker_is_not_a_problem() -> None:
    stopping = threading.Event()
    worker = Worker("converge", Steps(), interval=0.01, stopping=stopping)
    worker.start()
    stopping.set()
    worker.join(10)
    assert worker.problem() is None


def test_a_step_running_past_stuck_after_is_a_health_problem_until_it_returns() -> None:
    """A read blocked on a sick disk raises nothing: without this /healthz stayed ok while
    the lease-and-capacity step hung on a FIFO planted as a marker."""
    stopping, release = threading.Event(), threading.Event()
    worker = Worker("housekeeping", lambda: release.wait(10), interval=0.01,
                    stopping=stopping, stuck_after=0.2)  # fmt: skip
    worker.start()
    try:
        assert worker.problem() is None
        wait_until("the step to be stuck", lambda: worker.problem() is not None)
        problem = worker.problem() or ""
        assert "housekeeping" in problem and "stuck" in problem, problem
        release.set()
        wait_until("the step to return", lambda: worker.problem() is None)
    finally:
        stopping.set()
        release.set()
        worker.join(10)


def test_an_index_that_keeps_refusing_leases_is_a_health_problem() -> None:
    from types import SimpleNamespace

    from weightcache.daemon.daemon import UNRECORDED_UNHEALTHY, Daemon

    index = SimpleNamespace(unrecorded=UNRECORDED_UNHEALTHY - 1, path="state.db",
                            unrecorded_error="database is locked")  # fmt: skip
    daemon = SimpleNamespace(_workers=[], index=index)
    assert Daemon.health_problem(daemon) is None  # type: ignore[arg-type]
    index.unrecorded += 1
    problem = Daemon.health_problem(daemon) or ""  # type: ignore[arg-type]
    assert "state.db" in problem and "database is locked" in problem, problem
