"""Measuring child processes, and the statistics and tables the benchmarks print.

Every child runs in its own session; its wall time is taken around fork/exec and `wait4`,
its CPU time (user+sys) comes from the `rusage` that `wait4` returns for it, which covers the
child and every descendant it reaped (for `sh -c` recipes: sh, rclone and sha256sum).
Peak RSS is the largest single process of the tree (`ru_maxrss`), not a sum. It is taken by
GNU time (`/usr/bin/time`, Debian package `time`) wrapped around the child: a process forked
from this ~60 MiB harness starts with the harness's pages mapped, and Linux keeps that as the
child's `ru_maxrss` floor across exec, so `wait4`'s own figure would read at least ~60 MiB
for `sh -c 'test -f ok'`. GNU time is a 1.5 MiB process; its children start from that.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchlib import log


@dataclass
class Run:
    """One measured child process (tree)."""

    tool: str
    argv: list[str]
    started: float  # perf_counter at fork
    wall_s: float
    user_s: float
    sys_s: float
    maxrss_kib: int
    returncode: int
    round: int = 0  # the caller's round or repetition number
    started_at: float = 0.0  # wall clock (time.time()) at fork: for packet timestamps
    stdout_tail: str = ""
    stderr_tail: str = ""
    problem: str | None = None  # set by the caller's own check (missing files, ...)
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    @property
    def maxrss_mib(self) -> float:
        return self.maxrss_kib / 1024

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.problem is None

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(cpu_s=self.cpu_s, maxrss_mib=self.maxrss_mib, ok=self.ok)
        return d


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-limit:].decode(errors="replace")


def _gnu_time() -> str | None:
    path = os.environ.get("WC_BENCH_TIME", "/usr/bin/time")
    return path if os.access(path, os.X_OK) else None


class Child:
    """A started child process, reaped by `wait4` in a thread so its rusage is its own.

    Wrapped in GNU time, when there is one, for a peak RSS without the harness's floor.
    """

    def __init__(
        self,
        tool: str,
        argv: list[str],
        env: dict[str, str],
        logs: Path,
        cwd: Path | None = None,
        gnu_time: bool = True,
    ) -> None:
        self.tool = tool
        self.argv = argv
        logs.parent.mkdir(parents=True, exist_ok=True)
        self._out_path = logs.with_name(logs.name + ".out")
        self._err_path = logs.with_name(logs.name + ".err")
        self._time_path = logs.with_name(logs.name + ".rusage")
        self.finished: float | None = None
        self._status = 0
        self._rusage: object = None
        wrapper = _gnu_time() if gnu_time else None
        if wrapper:  # costs ~1 ms of wall (one more exec); hit_latency times without it
            argv = [wrapper, "-f", "%M", "-o", str(self._time_path), "--", *argv]
        with open(self._out_path, "wb") as out, open(self._err_path, "wb") as err:
            self.started_at = time.time()
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        _, status, rusage = os.wait4(self.proc.pid, 0)
        self.finished = time.perf_counter()
        self._status, self._rusage = status, rusage
        self.proc.returncode = os.waitstatus_to_exitcode(status)

    @property
    def done(self) -> bool:
        return self.finished is not None

    def result(self, timeout: float | None = None) -> Run:
        """Wait (killing the whole session after `timeout` seconds) and measure."""
        self._reaper.join(timeout)
        if self._reaper.is_alive():
            log(f"{self.tool}: timed out after {timeout}s, killing pid {self.proc.pid}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._reaper.join()
        ru = self._rusage
        assert self.finished is not None and ru is not None
        maxrss_kib = ru.ru_maxrss  # type: ignore[attr-defined]
        # GNU time's last line (a signal adds one before it); absent if it was killed.
        with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
            maxrss_kib = int(self._time_path.read_text().split()[-1])
        return Run(
            tool=self.tool,
            argv=self.argv,
            started=self.started,
            started_at=self.started_at,
            wall_s=self.finished - self.started,
            user_s=ru.ru_utime,  # type: ignore[attr-defined]
            sys_s=ru.ru_stime,  # type: ignore[attr-defined]
            maxrss_kib=maxrss_kib,
            returncode=os.waitstatus_to_exitcode(self._status),
            stdout_tail=_tail(self._out_path, 500),
            stderr_tail=_tail(self._err_path),
        )


def run_measured(
    tool: str,
    argv: list[str],
    env: dict[str, str],
    logs: Path,
    timeout: float | None = None,
    cwd: Path | None = None,
    gnu_time: bool = True,
) -> Run:
    """Run to completion and measure; without `gnu_time`, peak RSS has the harness floor."""
    return Child(tool, argv, env, logs, cwd=cwd, gnu_time=gnu_time).result(timeout)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace: float = 30) -> float:
    """SIGTERM every process, reap each (SIGKILL after `grace` seconds); return their CPU
    seconds (user+sys, from `wait4`), all together. Long-running children such as daemons."""
    for p in procs:
        if p.returncode is None:
            p.terminate()
    cpu = 0.0
    for p in procs:
        if p.returncode is not None:
            continue
        deadline = time.monotonic() + grace
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                cpu += ru.ru_utime + ru.ru_stime
                break
            if time.monotonic() > deadline:
                p.kill()
            time.sleep(0.05)
    return cpu


# --------------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: Sequence[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def fmt_num(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"  # x != x: NaN


def fmt_times(x: float, digits: int = 2) -> str:
    """A ratio as "1.23x"; "n/a" for NaN."""
    return "n/a" if x != x else f"{x:.{digits}f}x"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    numeric = [
        bool(cells) and all(re.fullmatch(r"[-+]?[\d.]+(x|%)?|n/a", r[i]) for r in cells)
        for i in range(len(headers))
    ]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + (":" if n else "-") for w, n in zip(widths, numeric, strict=True)]
    return "\n".join([line(headers), line(rule), *(line(r) for r in cells)])


def write_json(path: Path, payload: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    log(f"wrote {path}")
