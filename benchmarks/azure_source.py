"""Cold fetch from Azure Blob Storage (an az:// source): weightcache vs adlfs's own recursive
`get` of the same blobs, against Azurite on loopback, side by side in one run.

    python benchmarks/azure_source.py --size 1G [--rounds 3] [--workdir DIR]

Writes one model (4 random shards + SHA256SUMS), uploads it once to a throwaway Azurite
(tests/support/azurite.py: `.ci/run` installs it from npm), then runs the tools interleaved
(A B A B ...), each into a fresh directory removed afterwards. Both run on fsspec's one
event-loop thread (adlfs is async); the wrapper each tool runs under reports that thread's
CPU time at exit, and the harness samples Azurite's: the three CPU columns say whose CPU a
run was waiting for. weightcache hashes every byte against SHA256SUMS; adlfs `get`
verifies nothing.

A second table isolates the read path, in this process, with no disk and no hashing: the
same blobs read as 4 MiB ranges, 16 at a time, through the Azure SDK on fsspec's loop (what
weightcache's az:// source does) and through plain http.client threads with a SAS URL (no
SDK, no loop: what its S3 source does with presigned URLs). The loop thread's CPU seconds
per GiB bound what one process can read through adlfs: 1 GiB / that many seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import hashlib
import http.client
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import benchlib as bl
import measure as ms

from tests.support.azurite import ACCOUNT, KEY, Azurite, find_binary

CONTAINER, PREFIX, SHARDS = "models", "bench/m/r1", 4
CHUNK, INFLIGHT = 4 << 20, 16

#: Runs a tool's Python code, then writes the CPU seconds of fsspec's event-loop thread (the
#: thread every adlfs/Azure SDK call runs on) to $LOOP_CPU_FILE at exit.
WRAPPER = """
import atexit, os, sys, time
def _loop_cpu():
    import fsspec.asyn as a
    t = a.iothread[0]
    s = time.clock_gettime(time.pthread_getcpuclockid(t.ident)) if t and t.is_alive() else 0.0
    open(os.environ["LOOP_CPU_FILE"], "w").write(f"{s:.3f}")
atexit.register(_loop_cpu)
code, sys.argv = sys.argv[1], sys.argv[1:]
exec(code, {"__name__": "__main__"})
"""
WEIGHTCACHE = "import sys; from weightcache.cli import main; sys.exit(main())"
ADLFS_GET = (
    "import sys, adlfs; adlfs.AzureBlobFileSystem().get("
    f"'{CONTAINER}/{PREFIX}/', sys.argv[1], recursive=True)"
)


def write_and_upload(server: Azurite, root: Path, size: int) -> None:
    """SHARDS random shards of size/SHARDS bytes and their SHA256SUMS, uploaded."""
    container = server.service().create_container(CONTAINER)
    root.mkdir(parents=True)
    lines = []
    for i in range(SHARDS):
        name = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        data = os.urandom(size // SHARDS)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
        container.upload_blob(f"{PREFIX}/{name}", data, max_concurrency=4)
    container.upload_blob(f"{PREFIX}/SHA256SUMS", "".join(lines).encode())


def commands(dest: Path) -> dict[str, list[str]]:
    py = [sys.executable, "-c", WRAPPER]
    return {
        "weightcache": [*py, WEIGHTCACHE, "fetch", f"az://{CONTAINER}/{PREFIX}", "--no-daemon",
                        "--cache-dir", str(dest)],
        "adlfs get": [*py, ADLFS_GET, str(dest)],
    }  # fmt: skip


def server_cpu(pid: int) -> float:
    """CPU seconds (user+sys) the Azurite process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(tool: str, argv: list[str], env: dict[str, str], work: Path, pid: int) -> ms.Run:
    dest, cpu_file = work / "dest", work / "loop-cpu"
    before = server_cpu(pid)
    run = ms.run_measured(tool, argv, {**env, "LOOP_CPU_FILE": str(cpu_file)}, work / "logs")
    run.extra["server_cpu_s"] = server_cpu(pid) - before
    run.extra["loop_cpu_s"] = float(cpu_file.read_text()) if cpu_file.exists() else float("nan")
    got = sum(p.stat().st_size for p in dest.rglob("*.safetensors")) if dest.exists() else 0
    run.extra["bytes"] = got
    shutil.rmtree(dest, ignore_errors=True)
    cpu_file.unlink(missing_ok=True)
    return run


def summarize(runs: list[ms.Run], tools: list[str], size: int) -> str:
    rows = []
    for tool in tools:
        mine = [r for r in runs if r.tool == tool and r.ok and r.extra["bytes"] == size]
        walls = [r.wall_s for r in mine]
        rows.append([
            tool, f"{len(mine)}/{sum(r.tool == tool for r in runs)}",
            ms.fmt_num(ms.median(walls)), ms.fmt_num(ms.p90(walls)),
            ms.fmt_num(size / (1 << 20) / ms.median(walls), 0),
            ms.fmt_num(ms.median([r.cpu_s for r in mine])),
            ms.fmt_num(ms.median([r.maxrss_mib for r in mine]), 1),
            ms.fmt_num(ms.median([float(r.extra["loop_cpu_s"]) for r in mine])),  # type: ignore[arg-type]
            ms.fmt_num(ms.median([float(r.extra["server_cpu_s"]) for r in mine])),  # type: ignore[arg-type]
            "sha256 of every byte" if tool == "weightcache" else "nothing",
        ])  # fmt: skip
    return ms.md_table(
        ["tool", "ok", "wall s (median)", "wall s (p90)", "MiB/s", "CPU s", "peak RSS MiB",
         "loop thread CPU s", "Azurite CPU s", "verifies"], rows,
    )  # fmt: skip


# -- the read path alone -------------------------------------------------------------------


def shard_names() -> list[str]:
    return [f"{PREFIX}/model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]


def thread_cpu(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def read_sdk(fs: Any, jobs: list[tuple[str, int]]) -> int:
    """Every (blob, offset) range through the SDK on fsspec's loop, INFLIGHT at a time."""

    async def everything() -> int:
        gate = asyncio.Semaphore(INFLIGHT)

        async def one(name: str, offset: int) -> int:
            async with gate:
                client = fs.service_client.get_blob_client(CONTAINER, name)
                stream = await client.download_blob(
                    offset=offset, length=CHUNK, max_concurrency=1, retry_total=0
                )
                return len(await stream.readall())

        return sum(await asyncio.gather(*(one(n, o) for n, o in jobs)))

    return asyncio.run_coroutine_threadsafe(everything(), fs.loop).result()


def read_http(server: Azurite, jobs: list[tuple[str, int]]) -> int:
    """The same ranges with http.client from INFLIGHT threads, a SAS URL per blob."""
    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    expiry = datetime.now(UTC) + timedelta(hours=1)
    urls = {
        n: f"/{ACCOUNT}/{CONTAINER}/{n}?"
        + generate_blob_sas(ACCOUNT, CONTAINER, n, account_key=KEY, expiry=expiry,
                            permission=BlobSasPermissions(read=True))
        for n in {n for n, _ in jobs}
    }  # fmt: skip
    local = threading.local()

    def one(job: tuple[str, int]) -> int:
        name, offset = job
        if getattr(local, "conn", None) is None:
            local.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        rng = f"bytes={offset}-{offset + CHUNK - 1}"
        local.conn.request("GET", urls[name], headers={"Range": rng, "x-ms-version": "2021-08-06"})
        resp, buf, got = local.conn.getresponse(), bytearray(256 << 10), 0
        while n := resp.readinto(buf):
            got += n
        return got

    with cf.ThreadPoolExecutor(INFLIGHT) as pool:
        return sum(pool.map(one, jobs))


def probe(server: Azurite, size: int, rounds: int) -> str:
    import adlfs
    import fsspec.asyn

    fs = adlfs.AzureBlobFileSystem(connection_string=server.connection_string)
    jobs = [(n, o) for n in shard_names() for o in range(0, size // SHARDS, CHUNK)]
    ways: dict[str, Callable[[], int]] = {
        "Azure SDK on fsspec's loop": lambda: read_sdk(fs, jobs),
        "http.client threads, SAS URL": lambda: read_http(server, jobs),
    }
    results: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
    for _ in range(rounds):
        for way, fn in ways.items():
            loop0 = thread_cpu(fsspec.asyn.iothread[0])
            cpu0, t0 = time.process_time(), time.monotonic()
            assert fn() == size // SHARDS * SHARDS
            wall = time.monotonic() - t0
            loop = thread_cpu(fsspec.asyn.iothread[0]) - loop0
            results[way].append((wall, time.process_time() - cpu0, loop))
    gib = size / (1 << 30)
    rows = []
    for way, runs in results.items():
        wall = ms.median([r[0] for r in runs])
        loop = ms.median([r[2] for r in runs]) / gib
        cpu = ms.median([r[1] for r in runs]) / gib
        bound = ms.fmt_num(1024 / loop, 0) if loop > 0.01 else "n/a"
        rate = ms.fmt_num(size / (1 << 20) / wall, 0)
        rows.append([way, rate, ms.fmt_num(cpu), ms.fmt_num(loop), bound])
    return ms.md_table(
        ["read path (4 MiB ranges, 16 in flight, no disk)", "MiB/s", "client CPU s/GiB",
         "loop thread CPU s/GiB", "loop-bound MiB/s"], rows,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="1G", help="total shard bytes (binary units): 1G, 256M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    args = p.parse_args()
    size = bl.parse_size(args.size) // SHARDS * SHARDS
    binary = find_binary()
    if binary is None:
        sys.exit("azurite-blob not found: npm install --prefix /opt/azurite azurite@3.35.0")
    work = Path(tempfile.mkdtemp(prefix="wc-azure-bench-", dir=args.workdir)).resolve()
    server = Azurite(binary, work / "azurite")
    server.start()
    runs: list[ms.Run] = []
    reads = ""
    try:
        write_and_upload(server, work / "src", size)
        shutil.rmtree(work / "src")
        env = {**os.environ, "AZURE_STORAGE_CONNECTION_STRING": server.connection_string}
        env["PYTHONPATH"] = os.pathsep.join([str(bl.REPO), env.get("PYTHONPATH", "")])
        for r in range(args.rounds):
            for tool, argv in commands(work / "dest").items():
                assert server.proc is not None
                runs.append(run_once(tool, argv, env, work, server.proc.pid))
                bl.log(f"round {r + 1} {tool}: {runs[-1].wall_s:.2f} s "
                       f"(loop {runs[-1].extra['loop_cpu_s']} s, Azurite "
                       f"{runs[-1].extra['server_cpu_s']:.2f} s CPU)")  # fmt: skip
        reads = probe(server, size, args.rounds)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{bl.fmt_size(size)}, {SHARDS} files, {args.rounds} rounds, Azurite on loopback; "
          "medians\n")  # fmt: skip
    print(summarize(runs, list(commands(work).keys()), size))
    print(f"\n{reads}")


if __name__ == "__main__":
    main()
