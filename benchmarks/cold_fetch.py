"""Cold fetch: weightcache vs s5cmd vs `aws s3 sync` vs the rclone recipe, one node, empty disk.

    python benchmarks/cold_fetch.py --size 1G [--rounds 5] [--json out.json]
    python benchmarks/cold_fetch.py --link 800mbit --tools weightcache,s5cmd --also-rev REV
    python benchmarks/cold_fetch.py --link 800mbit --tools weightcache,s5cmd --installed

Generates one model (4 random shards + config.json + tokenizer.json + SHA256SUMS), uploads it
once to a throwaway SeaweedFS on loopback, then runs the tools interleaved, A B C D A B C D ...,
each run into a fresh empty directory on the same disk, removed (and `sync`ed) afterwards.
Reports medians per tool and, per pair, the median of the per-round ratios.

Time to first byte, per run, is measured on the wire (wire.Capture, tcpdump): from the fork
to the first GET of a model file (not the listing, not SHA256SUMS) and to the first response
on that connection. `--installed` adds weightcache installed as the image installs it (a
venv of its own from requirements.lock, the commit's package): no editable install's import
hook and none of this machine's site-packages hooks run at its start. With `--link RATE`
the store runs in a network namespace of its own, its egress shaped by tc tbf
(wire.ShapedStore): a link-bound download, where what a tool does before its first GET is
what separates it from another.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

import benchlib as bl
import measure as ms
import wire

from weightcache.ops.devstore import DevStore


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="1G", help="total shard bytes (binary units): 1G, 4G, 256M")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument(
        "--tools",
        default=",".join(bl.TOOLS),
        help="comma-separated, in run order (default: all). Unavailable tools are skipped "
        "with a warning unless --require",
    )
    p.add_argument("--require", action="store_true", help="fail if a listed tool is unavailable")
    p.add_argument(
        "--baseline", default="weightcache", help="ratios are baseline/other (default weightcache)"
    )
    p.add_argument(
        "--wc-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `weightcache fetch`, repeatable: --wc-arg=--max-concurrency=8",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before kill")
    p.add_argument(
        "--link",
        metavar="RATE",
        help="run the store in a network namespace behind a veth shaped to RATE (tc units: "
        "800mbit) instead of on loopback; needs root, ip, tc",
    )
    p.add_argument(
        "--also-rev",
        metavar="REV",
        help="also run weightcache as of this commit (tool weightcache@REV), right after "
        "weightcache in each round: before and after a change in one run",
    )
    p.add_argument(
        "--installed",
        action="store_true",
        help="also run weightcache installed as the image installs it (tool "
        "weightcache@installed: a venv under benchmarks/out/installed/ from requirements.lock "
        "and a wheel of --weightcache-rev or HEAD), with its own `python -c pass` floor",
    )
    bl.add_rev_option(p)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (model, store, logs)")
    p.add_argument("--json", type=Path, help="write every run and the summary here")
    return p.parse_args()


def run_rounds(
    args: argparse.Namespace,
    tools: dict[str, list[str]],
    model: bl.Model,
    store: DevStore,
    workdir: Path,
    capture: wire.Capture,
) -> list[ms.Run]:
    env = bl.peer_env(store.endpoint_url, store.env)
    host = str(urllib.parse.urlsplit(store.endpoint_url).hostname)
    env["NO_PROXY"] = env["no_proxy"] = f"{env['NO_PROXY']},{host}"
    runs: list[ms.Run] = []
    files = [f"{model.prefix}/{rel}" for rel in model.listed]
    for rnd in range(1, args.rounds + 1):
        for tool, exe in tools.items():
            dest = workdir / "dest" / f"{tool}-r{rnd}"
            dest.mkdir(parents=True)
            argv = bl.fetch_command(tool, exe, model, store.endpoint_url, dest, args.wc_arg)
            run = ms.run_measured(tool, argv, env, workdir / "logs" / f"{tool}-r{rnd}",
                                  timeout=args.timeout)  # fmt: skip
            if run.returncode != 0:
                run.problem = f"exit {run.returncode}: {run.stderr_tail.strip()[-300:]}"
            else:
                run.problem = bl.check_tree(bl.ready_dir(tool, model, dest), model)
            run.round = rnd
            first = capture.first_data(run.started_at, run.started_at + run.wall_s, files)
            run.extra["first_get_s"], run.extra["first_byte_s"] = first
            last = capture.last_data(run.started_at, run.started_at + run.wall_s)
            run.extra["tail_s"] = run.wall_s - last if last is not None else None
            runs.append(run)
            status = "ok" if run.ok else f"FAILED ({run.problem})"
            bl.log(
                f"round {rnd} {tool:20s} {run.wall_s:7.2f} s wall {run.cpu_s:7.2f} s cpu "
                f"{run.maxrss_mib:7.1f} MiB rss, first GET {_secs(first[0])} s, first byte "
                f"{_secs(first[1])} s, after the last byte {_secs(run.extra['tail_s'])} s  "
                f"{status}"
            )
            bl.drop_dir(dest)
        runs.append(_floor(FLOOR, sys.executable, env, workdir, rnd))
        if INSTALLED in tools:
            python = str(Path(tools[INSTALLED][0]).parent / "python")
            runs.append(_floor(INSTALLED_FLOOR, python, env, workdir, rnd))
    return runs


FLOOR = "python -c pass"
INSTALLED = "weightcache@installed"
INSTALLED_FLOOR = "python -c pass (venv)"


def _floor(label: str, python: str, env: dict[str, str], workdir: Path, rnd: int) -> ms.Run:
    """The interpreter's start alone, once a round: what every Python tool pays before its
    first line, and how loaded the machine was (read the first-GET times against it)."""
    slug = "floor-venv" if label == INSTALLED_FLOOR else "floor"
    run = ms.run_measured(label, [python, "-c", "pass"], env,
                          workdir / "logs" / f"{slug}-r{rnd}", gnu_time=False)  # fmt: skip
    run.round = rnd
    bl.log(f"round {rnd} {label:20s} {run.wall_s:7.3f} s wall {run.cpu_s:7.3f} s cpu")
    return run


def installed(rev: str) -> Path:
    """weightcache as of `rev`, installed as the Dockerfile installs it: a venv of its own
    (no system site-packages, so none of their .pth hooks), the pinned requirements.lock
    with hashes, then the commit's own package without dependencies, compiled by pip.
    Built once per commit under benchmarks/out/installed/; returns its console script."""
    sha = bl.commit_of(rev)
    root = bl.REPO / "benchmarks" / "out" / "installed" / sha[:12]
    script = root / "bin" / "weightcache"
    if script.exists():
        return script
    src = root.with_name(f"{root.name}-src")
    bl.drop_dir(src)
    src.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, "weightcache", "pyproject.toml", "README.md",
         "requirements.lock"],
        cwd=bl.REPO, capture_output=True, check=True,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install",
           "-q", "--disable-pip-version-check"]  # fmt: skip
    subprocess.run([*pip, "--require-hashes", "--only-binary=:all:", "-r",
                    str(src / "requirements.lock")], check=True)  # fmt: skip
    subprocess.run([*pip, "--no-deps", str(src)], check=True)
    bl.drop_dir(src)
    return script


def _secs(x: object) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "n/a"


def _first(runs: list[ms.Run], key: str) -> float:
    values = [r.extra[key] for r in runs if isinstance(r.extra.get(key), float)]
    return ms.median(values)  # type: ignore[arg-type]


def summarize(
    runs: list[ms.Run], tools: list[str], baseline: str, size: int
) -> tuple[str, dict[str, object]]:
    ok = [r for r in runs if r.ok]
    per_tool: dict[str, dict[str, float]] = {}
    rows = []
    for tool in tools:
        mine = [r for r in ok if r.tool == tool]
        walls = [r.wall_s for r in mine]
        stats = {
            "runs_ok": len(mine),
            "runs_failed": sum(1 for r in runs if r.tool == tool and not r.ok),
            "wall_s": ms.median(walls),
            "wall_p90_s": ms.p90(walls),
            "cpu_s": ms.median([r.cpu_s for r in mine]),
            "maxrss_mib": ms.median([r.maxrss_mib for r in mine]),
            "throughput_mib_s": size / (1 << 20) / ms.median(walls) if walls else float("nan"),
            "first_get_s": _first(mine, "first_get_s"),
            "first_byte_s": _first(mine, "first_byte_s"),
            "tail_s": _first(mine, "tail_s"),
        }
        per_tool[tool] = stats
        rows.append([
            tool, f"{stats['runs_ok']}/{stats['runs_ok'] + stats['runs_failed']}",
            ms.fmt_num(stats["wall_s"]), ms.fmt_num(stats["wall_p90_s"]),
            ms.fmt_num(stats["throughput_mib_s"], 0), ms.fmt_num(stats["cpu_s"]),
            ms.fmt_num(stats["maxrss_mib"], 1), ms.fmt_num(stats["first_get_s"], 3),
            ms.fmt_num(stats["first_byte_s"], 3), ms.fmt_num(stats["tail_s"], 3),
        ])  # fmt: skip
    text = ms.md_table(
        ["tool", "ok", "wall s (median)", "wall s (p90)", "MiB/s", "CPU s", "peak RSS MiB",
         "first GET s", "first byte s", "after last byte s"], rows,
    )  # fmt: skip
    ratios: dict[str, dict[str, float]] = {}
    if baseline in tools:
        ratio_rows = []
        for other in (t for t in tools if t != baseline):
            pair = {}
            for metric in ("wall_s", "cpu_s", "maxrss_mib"):
                per_round = []
                for rnd in sorted({r.round for r in ok}):
                    a = [r for r in ok if r.tool == baseline and r.round == rnd]
                    b = [r for r in ok if r.tool == other and r.round == rnd]
                    if a and b and getattr(b[0], metric) > 0:
                        per_round.append(getattr(a[0], metric) / getattr(b[0], metric))
                pair[metric] = ms.median(per_round)
            ratios[f"{baseline}/{other}"] = pair
            ratio_rows.append([
                f"{baseline}/{other}", ms.fmt_num(pair["wall_s"]) + "x",
                ms.fmt_num(pair["cpu_s"]) + "x", ms.fmt_num(pair["maxrss_mib"]) + "x",
            ])  # fmt: skip
        text += "\n\nMedian of per-round ratios (below 1 means the baseline is faster/cheaper):\n\n"
        text += ms.md_table(["pair", "wall", "CPU", "peak RSS"], ratio_rows)
    else:
        text += f"\n\n(no ratios: baseline {baseline!r} did not run)"
    return text, {"per_tool": per_tool, "ratios": ratios}


def with_rev(tools: dict[str, list[str]], rev: str) -> dict[str, list[str]]:
    """`tools` with weightcache@REV right after weightcache (or first)."""
    extra = {f"weightcache@{rev}": [str(bl.weightcache_snapshot(rev))]}
    if "weightcache" not in tools:
        return {**extra, **tools}
    out: dict[str, list[str]] = {}
    for tool, exe in tools.items():
        out[tool] = exe
        if tool == "weightcache":
            out.update(extra)
    return out


def make_store(args: argparse.Namespace, workdir: Path) -> DevStore:
    if args.link:
        return wire.ShapedStore(workdir / "store", rate=args.link)
    return DevStore(workdir / "store")


def main() -> None:
    args = parse_args()
    bl.use_rev(args.weightcache_rev)
    size = bl.parse_size(args.size)
    wanted = [t.strip() for t in args.tools.split(",") if t.strip()]
    tools, missing = bl.available_tools(wanted, required=args.require)
    if args.also_rev:
        tools = with_rev(tools, args.also_rev)
    if args.installed:
        tools[INSTALLED] = [str(installed(args.weightcache_rev or "HEAD"))]
    if not tools:
        raise SystemExit("no tool to run")
    for tool, exe in tools.items():
        if tool.startswith("weightcache") and tool != INSTALLED:  # pip compiled that one
            bl.precompile(exe)
    versions = {t: bl.tool_version(t, exe) for t, exe in tools.items()}
    if INSTALLED in versions:
        versions[INSTALLED] = f"weightcache (installed as in the image: {tools[INSTALLED][0]})"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wc-bench-cold-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = bl.machine_info(workdir)
    bl.log(f"workdir {workdir}; tools {versions}")
    try:
        model = bl.make_model(workdir / "model", size, name=f"cold-{args.size.lower()}")
        bl.log(
            f"model {model.prefix}: {bl.fmt_size(model.total_bytes)} in {len(model.files)} files"
        )
        with make_store(args, workdir) as store:
            secs = bl.upload_model(model, store.endpoint_url, store.env)
            bl.log(f"uploaded to {store.endpoint_url} in {secs:.1f} s")
            device = store.host_dev if isinstance(store, wire.ShapedStore) else "lo"
            capture = wire.Capture(device, store.ports["s3.port"], workdir / "capture.txt")
            try:
                runs = run_rounds(args, tools, model, store, workdir, capture)
            finally:
                capture.stop()
    finally:
        if not args.keep:
            bl.drop_dir(workdir)
    text, summary = summarize(runs, list(tools), args.baseline, model.total_bytes)
    header = (
        f"cold fetch of {bl.fmt_size(model.total_bytes)} ({len(model.files)} files), "
        f"{args.rounds} interleaved rounds, "
        + (f"store behind a veth shaped to {args.link} (tc tbf)" if args.link else "loopback")
        + f"; {bl.machine_line(info)}"
    )
    for label in (FLOOR, INSTALLED_FLOOR):
        floor = [r.wall_s for r in runs if r.tool == label]
        if floor:
            text += (
                f"\n\n`{label}` with the same environment, once a round: median "
                f"{ms.fmt_num(ms.median(floor), 3)} s wall, max {ms.fmt_num(max(floor), 3)} s"
            )
    print(f"{header}\n\n{text}")
    if missing:
        print("\nnot run: " + "; ".join(f"{t} ({why})" for t, why in missing.items()))
    if args.json:
        ms.write_json(args.json, {
            "benchmark": "cold_fetch", "machine": info, "versions": versions,
            "params": {**vars(args), "size_bytes": size, "model_bytes": model.total_bytes},
            "missing": missing, "summary": summary, "runs": [r.as_dict() for r in runs],
        })  # fmt: skip


if __name__ == "__main__":
    main()
