"""Cold fetch from Google Cloud Storage (a gs:// source): weightcache vs gcsfs `get`, against
fake-gcs-server on loopback, interleaved in one run.

    python benchmarks/gcs_source.py --size 1G [--rounds 3] [--json out.json]

Uploads one model (4 random shards + config.json + tokenizer.json + SHA256SUMS) once to
fake-gcs-server (in-memory backend), then runs, each round, each into a fresh directory on
the same disk:

- weightcache: `weightcache fetch gs://... --no-daemon` (ranged GETs on gcsfs's session
  from one event loop thread, every byte hashed against SHA256SUMS);
- gcsfs get: `GCSFileSystem.get(prefix, dest, recursive=True)`, what fsspec users call;
- gcsfs cat ranges: the same ranges weightcache asks for (16 MiB parts, 16 at once) read
  with gcsfs's `_cat_file` on one event loop and thrown away: no disk, no hashing, the
  ceiling of fsspec on one loop, which says where fsspec is the bottleneck.

Both gcsfs rows use `gcsfs.core.GCSFileSystem` (the default `fsspec.filesystem("gs")` first
probes each bucket's type over gRPC, which an emulator answers only after a 60 s timeout).
A last, in-process weightcache fetch measures the CPU seconds of the gcs-io event-loop
thread (every byte passes through aiohttp there) against the whole process's: the share of
one core that fsspec takes, and so the rate at which that one thread saturates.
The wire columns of cold_fetch.py (first GET, first byte) are left out: no capture here.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib as bl
import measure as ms

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.gcsemu import FakeGcs

BUCKET = "bench"
GET = """import sys, gcsfs.core
gcsfs.core.GCSFileSystem(token="anon").get(sys.argv[1] + "/", sys.argv[2] + "/", recursive=True)
"""
CAT = """import asyncio, sys, gcsfs.core
PART, AT_ONCE = 16 << 20, 16
async def main(prefix):
    fs = gcsfs.core.GCSFileSystem(token="anon", asynchronous=True)
    files = await fs._find(prefix, detail=True)
    ranges = [(p, s, min(s + PART, int(i["size"]))) for p, i in files.items()
              for s in range(0, int(i["size"]), PART)]
    gate = asyncio.Semaphore(AT_ONCE)
    async def one(p, s, e):
        async with gate:
            return len(await fs._cat_file(p, s, e))
    print(sum(await asyncio.gather(*(one(*r) for r in ranges))))
    await fs.session.close()
asyncio.run(main(sys.argv[1]))
"""
TOOLS = ("weightcache", "gcsfs get", "gcsfs cat ranges")


def commands(prefix: str, dest: Path) -> dict[str, list[str]]:
    return {
        "weightcache": [sys.executable, "-m", "weightcache", "fetch", f"gs://{prefix}",
                        "--no-daemon", "--cache-dir", str(dest)],
        "gcsfs get": [sys.executable, "-c", GET, prefix, str(dest)],
        "gcsfs cat ranges": [sys.executable, "-c", CAT, prefix],
    }  # fmt: skip


def ready_dir(tool: str, model: bl.Model, dest: Path) -> Path | None:
    if tool == "weightcache":
        return dest / model.name / model.revision
    return dest if tool == "gcsfs get" else None


def run_rounds(args: argparse.Namespace, model: bl.Model, server: FakeGcs,
               work: Path) -> list[ms.Run]:  # fmt: skip
    env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url}
    prefix = f"{BUCKET}/{model.prefix}"
    runs = []
    for rnd in range(1, args.rounds + 1):
        for tool, argv in commands(prefix, work / "dest").items():
            (work / "dest").mkdir()
            logs = work / "logs" / f"{tool}-r{rnd}".replace(" ", "-")
            run = ms.run_measured(tool, argv, env, logs, timeout=args.timeout)
            where = ready_dir(tool, model, work / "dest")
            if run.returncode != 0:
                run.problem = f"exit {run.returncode}: {run.stderr_tail.strip()[-300:]}"
            elif where is not None:
                run.problem = bl.check_tree(where, model)
            run.round = rnd
            runs.append(run)
            bl.log(f"round {rnd} {tool:18s} {run.wall_s:7.2f} s wall {run.cpu_s:7.2f} s cpu "
                   f"{run.maxrss_mib:7.1f} MiB rss  {'ok' if run.ok else run.problem}")  # fmt: skip
            bl.drop_dir(work / "dest")
    return runs


def summarize(runs: list[ms.Run], size: int) -> str:
    rows = []
    for tool in TOOLS:
        mine = [r for r in runs if r.tool == tool and r.ok]
        walls = [r.wall_s for r in mine]
        rows.append([
            tool, f"{len(mine)}/{sum(1 for r in runs if r.tool == tool)}",
            ms.fmt_num(ms.median(walls)), ms.fmt_num(ms.p90(walls)),
            ms.fmt_num(size / (1 << 20) / ms.median(walls) if walls else float("nan"), 0),
            ms.fmt_num(ms.median([r.cpu_s for r in mine])),
            ms.fmt_num(ms.median([r.maxrss_mib for r in mine]), 1),
        ])  # fmt: skip
    return ms.md_table(["tool", "ok", "wall s (median)", "wall s (p90)", "MiB/s", "CPU s",
                        "peak RSS MiB"], rows)  # fmt: skip


def _thread_cpu(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_share(model: bl.Model, server: FakeGcs, work: Path) -> str:
    """One fetch in this process: its CPU seconds, and those of the gcs-io loop thread."""
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    from weightcache.cache.layout import Layout
    from weightcache.config import OriginSettings
    from weightcache.fetch import Fetcher
    from weightcache.sourceurl import Source
    from weightcache.transfer.backends.gcs import GcsClient

    GcsClient.shared()
    loop = next(t.native_id for t in threading.enumerate() if t.name == "gcs-io")
    assert loop is not None
    before, loop_before, t0 = (
        resource.getrusage(resource.RUSAGE_SELF),
        _thread_cpu(loop),
        time.monotonic(),
    )
    fetcher = Fetcher(Layout.open(work / "inproc"), OriginSettings())
    fetcher.fetch(Source.parse(f"gs://{BUCKET}/{model.prefix}"))
    after, loop_after, t1 = (
        resource.getrusage(resource.RUSAGE_SELF),
        _thread_cpu(loop),
        time.monotonic(),
    )
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    share = loop_after - loop_before
    return (
        f"in-process weightcache fetch: {t1 - t0:.2f} s wall, {cpu:.2f} s CPU, of which the "
        f"gcs-io event loop thread {share:.2f} s ({share / cpu:.0%}); one loop thread "
        f"saturates at ~{model.total_bytes / (1 << 20) / share:.0f} MiB/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="1G", help="total shard bytes (binary units): 1G, 256M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before kill")
    p.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    args = p.parse_args()
    size = bl.parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="wc-gcs-bench-", dir=args.workdir)).resolve()
    model = bl.make_model(work / "src", size, "llama")
    with FakeGcs(work / "gcs") as server:
        fs = server.fs()
        fs.mkdir(BUCKET)
        fs.put(f"{model.local_dir}/", f"{BUCKET}/{model.prefix}/", recursive=True)
        bl.log(f"uploaded {bl.fmt_size(model.total_bytes)} to {server.url}")
        runs = run_rounds(args, model, server, work)
        share = loop_share(model, server, work)
    bl.drop_dir(work)
    print(f"\n{bl.machine_line(bl.machine_info())}")
    print(f"{bl.fmt_size(size)} of shards in 4 files + 3 small, {args.rounds} rounds, "
          "fake-gcs-server (memory backend) on loopback; medians\n")  # fmt: skip
    print(summarize(runs, size))
    print(f"\n{share}")


if __name__ == "__main__":
    main()
