"""The swarm benchmark's plot and its check against the simulator.

    python benchmarks/swarm.py --from-json n8.json n16.json --plot benchmarks/swarm.png

Ready time against N, one panel per regime: peers on and peers off as measured by
benchmarks/swarm.py (last node solid, p50 dashed), the line rate, and what
benchmarks/swarmsim.py predicts for the same setting (dotted). The prediction takes the
setting from the saved results: the model's blobs (`model_blobs`: its shards and small
files, swarmed one after another as the daemons do), link, store egress = regime x link, N,
and the daemons' start-up as measured in that run (the first and last node's *up* time
become the simulator's `startup` and `jitter`); the piece size is the caller's (0: the
daemons' own, per blob), and so is the host's CPU model (swarmnet.Cpu, e.g. as
benchmarks/swarmcal.py measured it: then the start-up is its CPU-s, spread as measured).
Several saved results (say one per N) are merged first.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import benchlib as bl
import measure as ms
import swarmsim as sim
from swarmnet import Cpu, cpu_from_args


class RunLike(Protocol):
    """What the plot reads of a `swarm.Run`."""

    regime: int
    n: int
    mode: str
    ready_s: list[float | None]
    up_s: list[float | None]
    daemon_cpu_s: float


def merge(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """One output of several saved `--json` files of the same model and link: their runs
    together, N and regimes the union. Raises ValueError for different models or links."""
    first = outputs[0]
    for other in outputs[1:]:
        for key in ("model_bytes", "line_rate_s"):
            if other[key] != first[key]:
                raise ValueError(f"cannot merge results of different {key}: "
                                 f"{first[key]} and {other[key]}")  # fmt: skip
    params = dict(first["params"])
    params["n_values"] = sorted({n for o in outputs for n in o["params"]["n_values"]})
    params["regime_values"] = sorted({g for o in outputs for g in o["params"]["regime_values"]})
    params["nodes"] = ",".join(str(n) for n in params["n_values"])
    overheads: dict[str, float] = {}
    for o in outputs:
        overheads |= o["wire_overhead"]
    runs = [r for o in outputs for r in o["runs"]]
    return {**first, "params": params, "wire_overhead": overheads, "runs": runs}


def sim_cpu(args: argparse.Namespace) -> Cpu:
    """The simulator's CPU model for benchmarks/swarm.py: a calibration file's (the host's
    cores unless --sim-cores says), else the --sim-* flags (by default none: links only)."""
    if args.sim_calibration is None:
        return cpu_from_args(args, "sim-")
    cpu = Cpu(**json.loads(args.sim_calibration.read_text())["cpu"])
    return replace(cpu, cores=args.sim_cores if args.sim_cores != Cpu().cores else cpu.cores)


def sim_params(output: dict[str, Any], runs: list[RunLike], regime: int, n: int,
               piece: int, cpu: Cpu | None = None) -> sim.Params:  # fmt: skip
    """The simulator's setting for one measured (regime, N): start-up from the peers-on runs,
    unless `cpu` models it (its `startup` CPU-s, shared by the daemons booting together);
    either way the daemons start spread as they came up in those runs (the harness spawns
    them one after another): booting in lockstep, the same node would be the first at every
    blob (the owner of config.json's one piece) and pull each shard from the store alone."""
    cpu = cpu or Cpu()
    link = float(output["params"]["link_bits"])
    ups = [u for r in runs if (r.regime, r.n, r.mode) == (regime, n, "p2p")
           for u in r.up_s if u is not None]  # fmt: skip
    first, jitter = min(ups, default=0.0), max(ups, default=0.0) - min(ups, default=0.0)
    total, shards = int(output["model_bytes"]), output["params"].get("size_bytes")
    return sim.Params(n, total, piece, link, regime * link,
                      startup=0.0 if cpu.startup > 0 else first, jitter=jitter, cpu=cpu,
                      blobs=model_blobs(int(shards), total) if shards else ())  # fmt: skip


def model_blobs(shards_bytes: int, total: int, shards: int = 4) -> tuple[int, ...]:
    """The blobs of `benchlib.make_model`'s model of `total` bytes (`shards_bytes` in the
    shards) in the order a daemon fetches them (its manifest's, by path): config.json, the
    shards, tokenizer.json (the rest but SHA256SUMS, which is the manifest, not a blob)."""
    config = len(json.dumps({"architectures": ["BenchForCausalLM"], "hidden_size": 4096,
                             "bench_bytes": shards_bytes}, indent=2))  # fmt: skip
    sizes = [shards_bytes // shards + (1 if i < shards_bytes % shards else 0)
             for i in range(shards)]  # fmt: skip
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    sums = sum(64 + 2 + len(name) + 1 for name in ["config.json", "tokenizer.json", *names])
    return (config, *sizes, total - shards_bytes - config - sums)


#: Simulated swarms per setting (seeds 1..SEEDS), the median one shown: one run's last node
#: moves by 10-30% with the order in which nodes reach each blob, as a measured run's does.
SEEDS = 5


def predict(output: dict[str, Any], runs: list[RunLike], piece: int, cpu: Cpu | None = None
            ) -> dict[tuple[int, int], dict[str, sim.Outcome]]:  # fmt: skip
    """The simulated swarm (the median of SEEDS runs by last node) and peers-off, by
    (regime, N), for every measured setting."""
    out = {}
    for regime in output["params"]["regime_values"]:
        for n in output["params"]["n_values"]:
            p = sim_params(output, runs, regime, n, piece, cpu)
            swarms = sorted((sim.Swarm(replace(p, seed=s)).run() for s in range(1, SEEDS + 1)),
                            key=lambda o: o.last)  # fmt: skip
            out[regime, n] = {"p2p": swarms[len(swarms) // 2], "off": sim.peers_off(p)}
    return out


def _measured(runs: list[RunLike], where: tuple[int, int, str], stat: str) -> float:
    """The median over rounds of the last (or p50) node's ready time; NaN if none."""
    values = []
    for r in runs:
        if (r.regime, r.n, r.mode) != where:
            continue
        done = sorted(t for t in r.ready_s if t is not None)
        if stat == "last":
            values.append(done[-1] if done and len(done) == len(r.ready_s) else float("nan"))
        else:
            values.append(ms.median(done) if len(done) * 2 >= len(r.ready_s) else float("nan"))
    values = [v for v in values if v == v]
    return ms.median(values) if values else float("nan")


def agreement(output: dict[str, Any], runs: list[RunLike],
              predicted: dict[tuple[int, int], dict[str, sim.Outcome]]) -> str:  # fmt: skip
    """A table: measured against simulated last-node ready time, per regime, N and mode;
    and the daemons' CPU-s against the simulated nodes' (0 without a CPU model)."""
    rows = []
    for (regime, n), sims in sorted(predicted.items()):
        for mode, outcome in sims.items():
            got = _measured(runs, (regime, n, mode), "last")
            ratio = ms.fmt_times(got / outcome.last)
            cpu = [r.daemon_cpu_s for r in runs if (r.regime, r.n, r.mode) == (regime, n, mode)]
            rows.append([f"{regime}x", n, "peers on" if mode == "p2p" else "peers off",
                         ms.fmt_num(got, 1), ms.fmt_num(outcome.last, 1), ratio,
                         ms.fmt_num(ms.median(cpu) if cpu else float("nan"), 0),
                         ms.fmt_num(outcome.cpu_s, 0)])  # fmt: skip
    headers = ["store egress", "N", "mode", "measured last s", "simulated last s",
               "measured / sim", "daemons' CPU-s", "simulated CPU-s"]  # fmt: skip
    return ms.md_table(headers, rows)


def plot(output: dict[str, Any], runs: list[RunLike], path: Path, title: str,
         predicted: dict[tuple[int, int], dict[str, sim.Outcome]]) -> None:  # fmt: skip
    """Ready time against N, one panel per regime; writes a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes, n_values = output["params"]["regime_values"], output["params"]["n_values"]
    fig, axes = plt.subplots(1, len(regimes), figsize=(5.5 * len(regimes), 4.2), squeeze=False)
    for ax, regime in zip(axes[0], regimes, strict=True):
        for mode, color in (("p2p", "tab:blue"), ("off", "tab:orange")):
            label = f"peers {'on' if mode == 'p2p' else 'off'}"
            for stat, style, marker in (("last", "-", "o"), ("p50", "--", "s")):
                ys = [_measured(runs, (regime, n, mode), stat) for n in n_values]
                ax.plot(n_values, ys, style, marker=marker, color=color, label=f"{label}, {stat}",
                        fillstyle="full" if stat == "last" else "none")  # fmt: skip
            ys = [predicted[regime, n][mode].last for n in n_values]
            ax.plot(n_values, ys, ":", marker="x", color=color, label=f"{label}, last, simulated")
        ax.axhline(output["line_rate_s"], color="tab:gray", linestyle=":", label="line rate")
        ax.set_xlabel("nodes started together (N)")
        ax.set_ylabel("ready s, from the start")
        ax.set_xticks(n_values)
        ax.set_ylim(bottom=0)
        ax.set_title(f"store egress = {regime} x a node's link")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 66 * len(regimes)), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    bl.log(f"wrote {path}")
