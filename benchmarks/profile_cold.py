"""Where do a cold `weightcache fetch`'s wall time and CPU go? py-spy and perf, next to s5cmd.

    python benchmarks/profile_cold.py [--size 1G] [--rounds 3] [--rate 250]
                                      [--weightcache-rev REV] [--out DIR]
    python benchmarks/profile_cold.py --analyze DIR    # the tables again, from saved profiles

One model and one store as in cold_fetch.py. Each round, interleaved, every run into a fresh
empty directory (removed and `sync`ed afterwards):

1. `weightcache fetch`, unprofiled (wall, CPU), then the time a `sync` takes right after it;
2. `s5cmd cp`, the same: the `sync` after it is the writeback s5cmd leaves to the kernel,
   which weightcache does before it returns (it fsyncs every blob);
3. `py-spy record -r RATE -f raw --threads -- python -m weightcache fetch ...`: samples of
   threads running or runnable (on 2 cores, runnable is not running: perf says what ran);
4. the same with `--idle`: every thread sampled whether it runs or waits, so the main
   thread's samples are its wall time, phase by phase;
5. both tools under `perf record -e cpu-clock -g` (when perf works): CPU by where it ran, a
   user-space library or the kernel by system call;
6. one `python -X importtime -m weightcache fetch`: the import bill, unprofiled.

Each py-spy stack goes into one bucket by `RULES`, tried from the leaf frame up; C calls
(os.fsync, hashlib's update) have no frame of their own, so a rule may look at the source
line the Python frame is on. One sample is 1/RATE s. py-spy pauses the process to sample
it, so profiled runs are slower than unprofiled ones: read shares, not absolute times, from
them; the report prints both walls. Profiles and `runs.json` are kept in `--out`.
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl
import measure as ms

# --------------------------------------------------------------------------- py-spy stacks

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")
_BOTO = re.compile(r"/(boto3|botocore|s3transfer|jmespath|dateutil|urllib3|six)/")

#: (bucket, function regex, source-line regex), tried on each frame from the leaf up; the
#: first frame that matches decides. A C call (os.fsync, hashlib's update) is no frame of
#: its own: the Python frame's source line says which call the thread was in.
RULES: list[tuple[str, str | None, str | None]] = [
    ("fsync", None, r"os\.fsync\("),
    ("fsync", r"_fsync_dir$", None),
    ("sha256 update", None, r"hasher\.update\(|\.hexdigest\(\)"),
    ("sha256 re-read (preadv)", None, r"os\.preadv\("),
    ("pwrite", None, r"os\.pwrite\("),
    ("writeback hint (sync_file_range)", r"_start_writeback$", None),
    ("GET: waiting for the response", r"HTTPResponse\.begin$", None),
    ("GET: recv body (readinto)", r"HTTPResponse\.readinto$", None),
    ("GET: send request, connect", r"HTTPConnection\.(request|connect|endheaders)$", None),
    ("part-state files", r"PartState\.(save|load)$", None),
    (
        "waiting for a file's lock (held over its part-state save)",
        r"^PartialFile\.",
        r"with self\.lock",
    ),
    ("allocate 1 MiB buffers", r"RangedDownloader\._buffer$", None),
    ("open, preallocate partials", r"(PartialFile\.open|_preallocate)$", None),
    ("publish blobs (chmod, rename)", r"Cache\.publish_blob$", None),
    ("assembly (links, marker)", r"Cache\.assemble$", None),
    ("index (sqlite)", r"^Index\.", None),
    # the main thread from the first worker's start to the last digest: join, is_alive, _finish
    ("main: waiting for the workers", r"RangedDownloader\._download$", None),
    ("start worker threads", r"Thread\.start$", None),
    ("concurrency gate", r"AIMDGate\.", None),
    ("presign", r"(presign_get|OriginBlob\.open_range)$", None),
    (
        "listing + manifest (boto3 calls)",
        r"(Origin\.(list_sizes|get_bytes)|read_contents)$",
        None,
    ),
    ("boto3 client", r"Origin\.__init__$", None),
    ("locks", r"^FileLock\.", None),
]


def _source_line(path: str, line: int) -> str:
    return linecache.getline(path, line) if path.startswith("/") else ""


def bucket_of(frames: list[str], main: bool) -> str:
    """One bucket for one py-spy stack (root first, as py-spy writes it)."""
    parsed = [m for m in (_FRAME.match(f) for f in frames) if m]
    if not parsed:  # no Python frame: the interpreter starting or exiting, or a thread's
        # py-spy also loses a thread's stack now and then (seen on the main thread of 4 GiB
        # fetches, for seconds): these samples are not all start-up and exit.
        return "no Python frame (start, exit, or stack lost)" if main else "thread start/exit"
    if any("<frozen importlib" in m["file"] for m in parsed):
        boto = any(_BOTO.search(m["file"]) or m["func"] == "Origin.__init__" for m in parsed)
        return "imports: boto3, botocore" if boto else "imports: the rest (site, click, ...)"
    for m in reversed(parsed):
        src = _source_line(m["file"], int(m["line"]))
        for name, func, line in RULES:
            if (func is None or re.search(func, m["func"])) and (
                line is None or re.search(line, src)
            ):
                return name
    return "other"


def parse_raw(path: Path) -> dict[str, collections.Counter[str]]:
    """{thread: Counter(bucket -> samples)} from py-spy's raw (collapsed) output."""
    stacks: list[tuple[str, list[str], int]] = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith("thread ") else "thread ?"
        stacks.append((thread, frames[1:] if thread != "thread ?" else frames, int(count)))
    # The main thread is the one that imported; py-spy names it "MainThread" once it can.
    main = {t for t, _, _ in stacks if t.endswith("MainThread")}
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    main_ids = {m.split(":")[0] for m in main}
    for thread, frames, n in stacks:
        is_main = thread.split(":")[0] in main_ids
        out["main" if is_main else "workers"][bucket_of(frames, is_main)] += n
    return out


def top_other(path: Path, n: int = 8) -> list[tuple[int, str]]:
    """The commonest leaf frames left in `other`: what a new rule should catch."""
    c: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        if bucket_of(frames[1:], frames[0].endswith("MainThread")) == "other":
            leaves = [re.sub(r"\(/\S*/", "(", f) for f in frames[-3:]]  # basenames only
            c[" < ".join(reversed(leaves))] += int(count)
    return [(v, k) for k, v in c.most_common(n)]


# --------------------------------------------------------------------------- perf samples

PERF_HZ = 999

#: A system call's kernel entry frame; preadv and pwritev enter through do_preadv (their
#: samples were counted as "no syscall" without it).
_SYSCALL = re.compile(r"^(?:__x64_sys_|__se_sys_|__do_sys_|ksys_|do_(?=p(?:read|write)v))(\w+)")


def perf_buckets(script_text: str) -> collections.Counter[str]:
    """Samples by where the CPU was: the kernel by syscall, user space by library."""
    out: collections.Counter[str] = collections.Counter()
    for block in script_text.split("\n\n"):
        lines = [x.strip() for x in block.strip().splitlines()]
        if len(lines) < 2:
            continue
        frames = []
        for x in lines[1:]:
            parts = x.split(None, 1)
            if len(parts) == 2:
                sym, _, dso = parts[1].rpartition(" (")
                frames.append((sym.split("+")[0], dso.rstrip(")")))
        if not frames:
            continue
        leaf_dso = frames[0][1]
        if "kernel" in leaf_dso:
            call = next((m[1] for s, _ in frames if (m := _SYSCALL.match(s))), None)
            if call is None:
                fault = any(s == "asm_exc_page_fault" for s, _ in frames)
                call = "page faults" if fault else "no syscall (irq, softirq)"
            out[f"kernel: {call}"] += 1
        else:
            name = Path(leaf_dso).name
            if name.startswith("libcrypto"):
                name = "libcrypto (sha256)"
            elif name.startswith(("python", "libpython")):
                gc = re.match(r"(gc_|visit_|subtract_refs|move_unreachable|\w+_traverse)",
                              frames[0][0])  # fmt: skip
                name = "python interpreter: GC" if gc else "python interpreter"
            elif name.startswith("libc.so") or name.startswith("ld-linux"):
                name = "libc"
            out[f"user: {name}"] += 1
    return out


# --------------------------------------------------------------------------- report


def importtime_ms(stderr: str) -> float:
    """Sum of the cumulative times of top-level imports in `-X importtime` output."""
    total = 0
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m:
            total += int(m[1])
    return total / 1000


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float]) -> str:
    """`median (min-max)`, or just the median when all are equal."""
    if not xs or min(xs) == max(xs):
        return ms.fmt_num(_med(xs))
    return f"{_med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def analyze(outdir: Path, rate: float) -> str:
    summary = json.loads((outdir / "runs.json").read_text())
    lines: list[str] = []
    walls = summary["walls"]
    rows = []
    for kind in dict.fromkeys(str(r["kind"]) for r in walls):
        mine = [r for r in walls if r["kind"] == kind]
        rows.append([
            kind, str(len(mine)), ms.fmt_num(_med([r["wall_s"] for r in mine])),
            ms.fmt_num(_med([r["cpu_s"] for r in mine])),
            ms.fmt_num(_med([r["sync_after_s"] for r in mine])),
        ])  # fmt: skip
    lines.append(ms.md_table(["run", "n", "wall s", "CPU s", "sync after s"], rows))
    imp = summary.get("importtime_ms", [])
    if imp:
        lines.append(
            f"\n`-X importtime`, every module a cold fetch imports (top-level cumulative "
            f"times summed): median {_med(imp):.0f} ms ({', '.join(f'{x:.0f}' for x in imp)})"
        )
    for pattern, title in (
        ("idle-*.raw", "py-spy --idle: every thread, running or waiting (main thread = wall)"),
        ("cpu-*.raw", "py-spy: threads running or runnable"),
    ):
        files = sorted(outdir.glob(pattern))
        if not files:
            continue
        per: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        totals: dict[str, list[float]] = collections.defaultdict(list)
        parsed = [parse_raw(f) for f in files]
        keys = {(who, b) for p in parsed for who, c in p.items() for b in c}
        for p in parsed:
            for who, b in keys:
                per[(who, b)].append(p.get(who, collections.Counter())[b] / rate)
            for who in ("main", "workers"):
                totals[who].append(sum(p.get(who, collections.Counter()).values()) / rate)
        buckets = sorted({b for _, b in keys}, key=lambda b: -sum(_med(per[(w, b)])
                         for w in ("main", "workers") if (w, b) in per))  # fmt: skip
        rows = []
        for b in buckets:
            m, w = per.get(("main", b), [0.0]), per.get(("workers", b), [0.0])
            if max(_med(m), _med(w), max(m), max(w)) >= 0.005:
                rows.append([b, _spread(m), _spread(w)])
        rows.append(["total", _spread(totals["main"]), _spread(totals["workers"])])
        lines.append(f"\n{title}; {len(files)} runs, median seconds per bucket "
                     f"(one sample = 1/{rate:g} s)\n")  # fmt: skip
        lines.append(ms.md_table(["bucket", "main thread s (min-max)",
                                  "worker threads s (min-max)"], rows))  # fmt: skip
        other = top_other(files[0])
        if other:
            lines.append("\n`other`, commonest leaves in the first run: " + "; ".join(
                f"{n} x {leaf}" for n, leaf in other[:4]))  # fmt: skip
    for tool in ("weightcache", "s5cmd"):
        files = sorted(outdir.glob(f"perf-{tool}-*.txt"))
        if not files:
            continue
        counts = [perf_buckets(f.read_text()) for f in files]
        hz = float(summary.get("perf_hz", 999))
        keys2 = sorted({k for c in counts for k in c}, key=lambda k: -_med([c[k] for c in counts]))
        rows = [[k, _spread([c[k] / hz for c in counts])] for k in keys2
                if _med([c[k] / hz for c in counts]) >= 0.005]  # fmt: skip
        rows.append(["total", _spread([sum(c.values()) / hz for c in counts])])
        lines.append(f"\nperf, {tool}, CPU by where it ran ({len(files)} runs, median CPU s "
                     f"at 1/{hz:g} s per sample)\n")  # fmt: skip
        lines.append(ms.md_table(["where", "CPU s (min-max)"], rows))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="1G", help="total shard bytes (default 1G)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--rate", type=float, default=250, help="py-spy samples per second")
    p.add_argument("--out", type=Path, default=bl.REPO / "benchmarks" / "out" / "profile",
                   help="where the profiles and runs.json go")  # fmt: skip
    p.add_argument("--analyze", type=Path, metavar="DIR", help="only re-read DIR's profiles")
    bl.add_rev_option(p)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    args.out = args.out.resolve()  # py-spy and perf run in the workdir
    if args.analyze:
        rate = json.loads((args.analyze / "runs.json").read_text())["rate"]
        print(analyze(args.analyze, rate))
        return
    bl.use_rev(args.weightcache_rev)
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    tools, _ = bl.available_tools(["weightcache", "s5cmd"], required=True)
    perf = shutil.which("perf")
    if (
        perf is not None
        and subprocess.run(
            [perf, "stat", "-e", "cpu-clock", "--", "true"], capture_output=True
        ).returncode
    ):
        bl.log("perf does not work here; no perf profiles")
        perf = None
    wc = tools["weightcache"]
    # `python -m weightcache` with the same package the launcher runs: the snapshot's
    # directory first on the path, from a cwd that is not the repository.
    launcher = Path(wc[0])
    pkg_root = launcher.parent.parent if args.weightcache_rev else bl.REPO
    size = bl.parse_size(args.size)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wc-bench-profile-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = bl.machine_info(workdir)
    walls: list[dict[str, object]] = []
    imports: list[float] = []
    from weightcache.ops.devstore import DevStore

    try:
        model = bl.make_model(workdir / "model", size, name=f"profile-{args.size.lower()}")
        with DevStore(workdir / "store") as store:
            bl.upload_model(model, store.endpoint_url, store.env)
            os.sync()  # the upload's writeback is not the first run's
            env = bl.peer_env(store.endpoint_url, store.env)
            py_env = {**env, "PYTHONPATH": str(pkg_root)}

            def fetch_argv(dest: Path) -> list[str]:
                return bl.fetch_command("weightcache", ["x"], model, store.endpoint_url, dest)[1:]

            def one(kind: str, rnd: int, argv: list[str], run_env: dict[str, str],
                    tool: str, dest: Path) -> None:  # fmt: skip
                dest.mkdir(parents=True, exist_ok=True)
                r = ms.run_measured(kind, argv, run_env, workdir / "logs" / f"{kind}-{rnd}",
                                    timeout=900, cwd=workdir)  # fmt: skip
                t = time.perf_counter()
                os.sync()
                sync_s = time.perf_counter() - t
                problem = bl.check_tree(bl.ready_dir(tool, model, dest), model)
                if r.returncode != 0 or problem:
                    raise SystemExit(f"{kind} failed: {problem or r.stderr_tail[-500:]}")
                walls.append({"kind": kind, "round": rnd, "wall_s": r.wall_s,
                              "cpu_s": r.cpu_s, "sync_after_s": sync_s})  # fmt: skip
                bl.log(f"round {rnd} {kind:12s} {r.wall_s:6.2f} s wall {r.cpu_s:6.2f} s CPU, "
                       f"sync after {sync_s:.2f} s")  # fmt: skip
                bl.drop_dir(dest)

            for rnd in range(1, args.rounds + 1):
                d = workdir / "dest" / f"wc-{rnd}"
                one("weightcache", rnd, bl.fetch_command("weightcache", wc, model,
                    store.endpoint_url, d), env, "weightcache", d)  # fmt: skip
                d = workdir / "dest" / f"s5-{rnd}"
                one("s5cmd", rnd, bl.fetch_command("s5cmd", tools["s5cmd"], model,
                    store.endpoint_url, d), env, "s5cmd", d)  # fmt: skip
                for kind, extra in (("cpu", []), ("idle", ["--idle"])):
                    d = workdir / "dest" / f"{kind}-{rnd}"
                    raw = args.out / f"{kind}-{rnd}.raw"
                    argv = [pyspy, "record", "-r", f"{args.rate:g}", "-f", "raw", "-o", str(raw),
                            "--threads", "--full-filenames", *extra, "--", sys.executable, "-m",
                            "weightcache", *fetch_argv(d)]  # fmt: skip
                    one(f"py-spy {kind}", rnd, argv, py_env, "weightcache", d)
                for tool, cmd in (("weightcache", wc), ("s5cmd", tools["s5cmd"])):
                    if perf is None:
                        break
                    d = workdir / "dest" / f"perf-{tool}-{rnd}"
                    data = workdir / f"perf-{tool}-{rnd}.data"
                    argv = [perf, "record", "-q", "-F", str(PERF_HZ), "-e", "cpu-clock", "-g",
                            "-o", str(data), "--",
                            *bl.fetch_command(tool, cmd, model, store.endpoint_url, d)]  # fmt: skip
                    one(f"perf {tool}", rnd, argv, env, tool, d)
                    with open(args.out / f"perf-{tool}-{rnd}.txt", "w") as fh:
                        subprocess.run([perf, "script", "-i", str(data), "-F",
                                        "comm,tid,ip,sym,dso"], stdout=fh,
                                       stderr=subprocess.DEVNULL, check=True)  # fmt: skip
                    data.unlink()
                d = workdir / "dest" / f"imp-{rnd}"
                d.mkdir(parents=True)
                cp = subprocess.run(
                    [sys.executable, "-X", "importtime", "-m", "weightcache", *fetch_argv(d)],
                    env=py_env, cwd=workdir, capture_output=True, text=True, timeout=900,
                )  # fmt: skip
                imports.append(importtime_ms(cp.stderr))
                bl.drop_dir(d)
    finally:
        bl.drop_dir(workdir)
    (args.out / "runs.json").write_text(json.dumps({
        "machine": info, "rate": args.rate, "size": size, "model_bytes": model.total_bytes,
        "walls": walls, "importtime_ms": imports, "perf_hz": PERF_HZ,
    }, indent=2))  # fmt: skip
    print(f"profile of a cold fetch of {bl.fmt_size(model.total_bytes)}; "
          f"{bl.machine_line(info)}\n")  # fmt: skip
    print(analyze(args.out, args.rate))


if __name__ == "__main__":
    main()
