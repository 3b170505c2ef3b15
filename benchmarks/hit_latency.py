"""Hit latency: `weightcache fetch` on a warm cache vs the recipe's `test -f <dir>/ok`.

    python benchmarks/hit_latency.py [--runs 30] [--size 64M] [--store-down] [--json out.json]

One cold `weightcache fetch` fills a cache; one run of the rclone recipe fills a directory
and touches its `ok` (just `ok` is touched if rclone is missing). Then, interleaved, N runs
each of:
- `weightcache fetch SOURCE --cache-dir DIR --endpoint-url URL` (the warm hit, whole process:
  Python start, imports, marker check, access record), and
- `sh -c 'test -f DIR/ok || (rclone copy ...)'`: the recipe, which stops at `test -f`,
plus a floor, `python -c pass` (the same interpreter, `-I` isolated), to show how much of
weightcache's hit is interpreter start. The target is a hit under 150 ms.
`--store-down` stops the store before the hits: a hit must need no network (design §3 invariant 3).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import benchlib as bl
import measure as ms

from weightcache.ops.devstore import DevStore

TARGET_MS = 150.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="hits per command (default 30, >= 20)")
    p.add_argument("--size", default="64M", help="model size; a hit does not read it (64M)")
    p.add_argument("--store-down", action="store_true", help="stop the store before the hits")
    p.add_argument("--no-floor", action="store_true", help="skip the `python -c pass` floor")
    p.add_argument("--wc-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `weightcache fetch`, repeatable")  # fmt: skip
    bl.add_rev_option(p)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    p.add_argument("--json", type=Path, help="write every run and the summary here")
    return p.parse_args()


def prepare(
    model: bl.Model,
    store: DevStore,
    workdir: Path,
    tools: dict[str, list[str]],
    wc_args: list[str],
) -> tuple[dict[str, list[str]], ms.Run]:
    """Fill the cache and the recipe directory; return the hit commands and the cold run."""
    env = bl.peer_env(store.endpoint_url, store.env)
    cache, recipe_dir = workdir / "cache", workdir / "recipe"
    cold_argv = bl.fetch_command("weightcache", tools["weightcache"], model, store.endpoint_url,
                                 cache, wc_args)  # fmt: skip
    cold = ms.run_measured("weightcache", cold_argv, env, workdir / "logs" / "cold", timeout=600)
    if cold.returncode != 0:
        raise SystemExit(f"the cold fetch failed: {cold.stderr_tail}")
    if "rclone" in tools:
        argv = bl.fetch_command("rclone", tools["rclone"], model, store.endpoint_url, recipe_dir)
        r = ms.run_measured("rclone", argv, env, workdir / "logs" / "recipe", timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"the rclone recipe failed: {r.stderr_tail}")
        recipe = argv
    else:
        recipe_dir.mkdir(parents=True)
        (recipe_dir / "ok").touch()
        recipe = ["sh", "-c", f"test -f {recipe_dir}/ok"]
    commands = {"weightcache fetch (hit)": cold_argv, "sh -c 'test -f ok || ...'": recipe}
    return commands, cold


def measure(
    commands: dict[str, list[str]],
    env: dict[str, str],
    expect_stdout: str,
    runs: int,
    logs: Path,
) -> list[ms.Run]:
    """Timed runs go without the GNU time wrapper (its exec would add ~1 ms to `test -f`);
    three more wrapped runs per command, after them, give the peak RSS."""
    out: list[ms.Run] = []
    for i in range(1, runs + 4):
        timed = i <= runs
        for label, argv in commands.items():
            run = ms.run_measured(label, argv, env, logs / f"hit-{i}-{len(out)}", timeout=120,
                                  gnu_time=not timed)  # fmt: skip
            run.round = i
            if run.returncode != 0:
                run.problem = f"exit {run.returncode}: {run.stderr_tail.strip()[-300:]}"
            elif label.startswith("weightcache") and run.stdout_tail.strip() != expect_stdout:
                run.problem = f"stdout {run.stdout_tail.strip()!r}, expected {expect_stdout!r}"
            out.append(run)
    return out


def summarize(
    runs: list[ms.Run], labels: list[str], runs_per: int
) -> tuple[str, dict[str, object]]:
    """Wall and CPU from the timed runs (round <= runs_per), peak RSS from the others."""
    rows: list[list[str]] = []
    summary: dict[str, dict[str, float]] = {}
    for label in labels:
        rss_runs = [r for r in runs if r.tool == label and r.ok and r.round > runs_per]
        runs_of = [r for r in runs if r.tool == label and r.round <= runs_per]
        mine = [r for r in runs_of if r.ok]
        walls = [r.wall_s * 1000 for r in mine]
        stats = {
            "runs_ok": len(mine),
            "runs_failed": sum(1 for r in runs_of if not r.ok),
            "median_ms": ms.median(walls),
            "p90_ms": ms.p90(walls),
            "min_ms": min(walls, default=float("nan")),
            "max_ms": max(walls, default=float("nan")),
            "cpu_ms": ms.median([r.cpu_s * 1000 for r in mine]),
            "maxrss_mib": ms.median([r.maxrss_mib for r in rss_runs]),
            "under_target": (
                sum(1 for x in walls if x < TARGET_MS) / len(walls) if walls else float("nan")
            ),
        }
        summary[label] = stats
        rows.append([
            label, f"{stats['runs_ok']}/{stats['runs_ok'] + stats['runs_failed']}",
            ms.fmt_num(stats["median_ms"], 1), ms.fmt_num(stats["p90_ms"], 1),
            ms.fmt_num(stats["min_ms"], 1), ms.fmt_num(stats["max_ms"], 1),
            ms.fmt_num(stats["cpu_ms"], 1), ms.fmt_num(stats["maxrss_mib"], 1),
            ms.fmt_num(100 * stats["under_target"], 0) + "%",
        ])  # fmt: skip
    text = ms.md_table(
        ["command", "ok", "median ms", "p90 ms", "min ms", "max ms", "CPU ms", "peak RSS MiB",
         f"< {TARGET_MS:.0f} ms"],
        rows,
    )  # fmt: skip
    wc, sh = summary[labels[0]], summary[labels[1]]
    out: dict[str, object] = dict(summary)
    if wc["runs_ok"] and sh["runs_ok"]:
        ratio = wc["median_ms"] / sh["median_ms"]
        text += f"\n\nmedian ratio {labels[0]} / {labels[1]}: {ratio:.1f}x"
        out["ratio_median"] = ratio
    return text, out


def main() -> None:
    args = parse_args()
    bl.use_rev(args.weightcache_rev)
    if args.runs < 20:
        raise SystemExit("--runs must be at least 20")
    tools, missing = bl.available_tools(["weightcache"], required=True)
    extra, missing = bl.available_tools(["rclone"], required=False)
    tools.update(extra)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wc-bench-hit-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = bl.machine_info(workdir)
    try:
        model = bl.make_model(workdir / "model", bl.parse_size(args.size), name="hit")
        with DevStore(workdir / "store") as store:
            bl.upload_model(model, store.endpoint_url, store.env)
            commands, cold = prepare(model, store, workdir, tools, args.wc_arg)
            bl.log(f"cold fetch {cold.wall_s:.2f} s; now {args.runs} hits per command")
            if not args.no_floor:
                commands["python -I -c pass (floor)"] = [sys.executable, "-I", "-c", "pass"]
            env = bl.peer_env(store.endpoint_url, store.env)
            if args.store_down:
                store.stop()
                bl.log("store stopped: the hits run without an object store")
            expect = str(bl.ready_dir("weightcache", model, workdir / "cache").resolve())
            runs = measure(commands, env, expect, args.runs, workdir / "logs")
    finally:
        if not args.keep:
            bl.drop_dir(workdir)
    text, summary = summarize(runs, list(commands), args.runs)
    header = (
        f"warm-cache hit, {args.runs} interleaved runs per command"
        f"{', store stopped' if args.store_down else ''}; {bl.machine_line(info)}"
    )
    print(f"{header}\n\n{text}")
    if missing:
        print("\nnot run: " + "; ".join(f"{t} ({why})" for t, why in missing.items()))
    failures = [r.problem for r in runs if not r.ok]
    if failures:
        print(f"\n{len(failures)} failed runs, first: {failures[0]}")
    if args.json:
        ms.write_json(args.json, {
            "benchmark": "hit_latency", "machine": info, "params": vars(args),
            "cold_run": cold.as_dict(), "summary": summary, "runs": [r.as_dict() for r in runs],
        })  # fmt: skip


if __name__ == "__main__":
    main()
