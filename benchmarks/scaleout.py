"""Scale-out: R replicas start at once on K nodes (P prewarmed); what does the store see?

    python benchmarks/scaleout.py [--size 256M --nodes 4 --replicas 12 --prewarmed 1]
                                  [--strategies aws,rclone,weightcache,weightcache-daemon,
                                                weightcache-p2p]
                                  [--rounds 3]
                                  [--json out.json] [--plot out.png]

A node is a directory on this machine. Replica i runs on node i mod K. Every client talks to
the store through `countingproxy.CountingProxy`, which counts response body bytes (the bytes
leaving the store) and GETs in flight; a sampler records GETs in flight and replicas still
waiting every 50 ms. Strategies:

- `aws`: every replica runs `aws s3 sync` into its own directory (an emptyDir), so a
  prewarmed node does not help it: the status quo of design §9.
- `rclone`: every replica runs the seed recipe on its node's shared directory, guarded only
  by `test -f ok ||`: replicas on one cold node race, without a lock.
- `weightcache`: every replica runs `weightcache fetch` with its node's cache dir; replicas
  on one node single-flight through the per-revision lock.
- `weightcache-daemon`: one `weightcache daemon` per node (empty models file, metrics on a
  free loopback port), replicas run `weightcache fetch`, which goes through the node's daemon
  over its Unix socket. Skipped with a message where `weightcache daemon --help` fails; the
  daemon's start and stop live in `DaemonNodes`.
- `weightcache-p2p`: the same daemons, with peer-to-peer on (`--peer-addr` on a free loopback
  port, `--peers` listing every daemon, one shared `WEIGHTCACHE_PEER_TOKEN`): a daemon asks
  the other nodes' daemons for a blob before the store. Peer traffic does not pass the
  counting proxy; the bytes received from and served to peers are read from each daemon's
  /metrics before it stops.

Prewarming (P nodes) runs the strategy's own command once per node straight against the
store, before counting starts. Expected origin bytes: cold nodes x model size for weightcache
and weightcache-daemon; for weightcache-p2p about 0 with a prewarmed node (the cold nodes get
the model from it) and about 1 x model with none (one node goes to the store, the others
follow it).
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import benchlib as bl
import measure as ms
from countingproxy import Counters, CountingProxy, Sampler

from weightcache.ops.devstore import DevStore, free_port

STRATEGIES = ("aws", "rclone", "weightcache", "weightcache-daemon", "weightcache-p2p")
DAEMON_STRATEGIES = ("weightcache-daemon", "weightcache-p2p")
DEFAULT_STRATEGIES = ",".join(STRATEGIES)


@dataclass
class Strategy:
    """How one kind of init container makes the model ready on a node."""

    name: str
    tool: str
    exe: list[str]
    wc_args: tuple[str, ...] = ()

    @property
    def node_cache(self) -> bool:
        """False: each replica downloads into its own directory (emptyDir)."""
        return self.name != "aws"

    def dest(self, node: Path, replica: int) -> Path:
        if not self.node_cache:
            return node / "pods" / f"replica-{replica:03d}"
        return node / "cache" if self.tool == "weightcache" else node / "cache" / "rclone"

    def command(self, model: bl.Model, endpoint_url: str, dest: Path) -> list[str]:
        return bl.fetch_command(self.tool, self.exe, model, endpoint_url, dest, self.wc_args)

    def ready(self, model: bl.Model, dest: Path) -> Path:
        return bl.ready_dir(self.tool, model, dest)


class DaemonNodes:
    """Hook for `weightcache daemon`: one daemon per node, started before the replicas.

    The models file lists nothing, so a daemon does not prefetch by itself: the scale-out's
    replicas are what ask for the model, through `weightcache fetch`, which uses the node's
    daemon when one is reachable (design §5). Daemon traffic to the store goes through the
    counting proxy; with `weightcache-p2p` the daemons also talk to one another on loopback,
    outside the proxy, and `scrape` reads what they exchanged from their /metrics.
    """

    def __init__(self, strategy: Strategy, nodes: list[Path], endpoint_url: str,
                 env: dict[str, str], logs: Path) -> None:  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics_ports: list[int] = []
        if strategy.name not in DAEMON_STRATEGIES:
            return
        p2p = strategy.name == "weightcache-p2p"
        ports = [free_port() for _ in nodes]
        token = secrets.token_hex(16)
        peers = ",".join(f"127.0.0.1:{p}" for p in ports)  # each daemon skips its own
        daemon_env = {**env, "WEIGHTCACHE_PEER_TOKEN": token} if p2p else env
        for k, node in enumerate(nodes):
            cache = strategy.dest(node, 0)
            cache.mkdir(parents=True, exist_ok=True)
            (node / "kubelet-pods").mkdir(exist_ok=True)
            models = node / "models.yaml"
            models.write_text("models: []\n")
            metrics_port = free_port()
            self.metrics_ports.append(metrics_port)
            argv = [
                *strategy.exe, "daemon", "--cache-dir", str(cache), "--models", str(models),
                "--capacity", "90%", "--endpoint-url", endpoint_url,
                "--metrics-addr", f"127.0.0.1:{metrics_port}",
                "--kubelet-pods-dir", str(node / "kubelet-pods"), *strategy.wc_args,
            ]  # fmt: skip
            if p2p:
                argv += ["--peer-addr", f"127.0.0.1:{ports[k]}", "--peers", peers]
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / f"daemon-node{k}.log", "wb") as out:
                self.procs.append(subprocess.Popen(
                    argv, env=daemon_env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                    start_new_session=True,
                ))  # fmt: skip
        for node in nodes:  # the socket path is design §3's layout
            sock = strategy.dest(node, 0) / ".weightcache" / "daemon.sock"
            deadline = time.monotonic() + 30
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not sock.exists():
                bl.log(f"warning: no daemon socket at {sock} after 30 s")

    def scrape(self) -> dict[str, float]:
        """`benchlib.DAEMON_COUNTERS` summed over every daemon's /metrics (before `stop`)."""
        totals = dict.fromkeys(bl.DAEMON_COUNTERS, 0.0)
        for port in self.metrics_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    text = r.read().decode()
            except OSError as e:
                bl.log(f"warning: no /metrics from the daemon on port {port}: {e}")
                totals = {k: float("nan") for k in totals}
                continue
            for key, series in bl.DAEMON_COUNTERS.items():
                totals[key] += bl.metric_value(text, series)
        return totals

    def stop(self) -> float:
        """SIGTERM every daemon, reap it; return their CPU seconds (user+sys), all together."""
        return ms.stop_processes(self.procs)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="256M", help="model shard bytes (default 256M)")
    p.add_argument("--nodes", type=int, default=4, help="K simulated nodes (default 4)")
    p.add_argument("--replicas", type=int, default=12, help="R replicas (default 12)")
    p.add_argument("--prewarmed", type=int, default=1, help="P prewarmed nodes (default 1)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated from {', '.join(STRATEGIES)}")  # fmt: skip
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repeat the strategies interleaved; medians reported (default 3)",
    )
    p.add_argument("--interval", type=float, default=0.05, help="sampling period, seconds")
    p.add_argument("--wc-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for weightcache, repeatable")  # fmt: skip
    p.add_argument("--timeout", type=float, default=900, help="seconds per replica")
    bl.add_rev_option(p)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    p.add_argument("--json", type=Path, help="write the results and the time series here")
    p.add_argument("--plot", type=Path, help="write a PNG: GETs in flight and replicas waiting")
    args = p.parse_args()
    if not 0 <= args.prewarmed <= args.nodes or args.nodes < 1 or args.replicas < 1:
        p.error("need 1 <= nodes, 0 <= prewarmed <= nodes, 1 <= replicas")
    return args


def daemon_lacks_peers(exe: list[str]) -> str | None:
    """None if `weightcache daemon` has `--peer-addr` (a commit before peer-to-peer has not)."""
    cp = subprocess.run([*exe, "daemon", "--help"], capture_output=True, text=True, timeout=60)
    return None if "--peer-addr" in cp.stdout else "`weightcache daemon` has no --peer-addr"


def strategies_from(args: argparse.Namespace) -> list[Strategy]:
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(names) - set(STRATEGIES)
    if unknown:
        raise SystemExit(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    tool_of = {n: ("weightcache" if n.startswith("weightcache") else n) for n in names}
    tools, _ = bl.available_tools(sorted(set(tool_of.values())), required=False)
    out = []
    for n in names:
        if tool_of[n] not in tools:
            continue
        if n in DAEMON_STRATEGIES:
            why = bl.tool_works("weightcache", [*tools["weightcache"], "daemon"])
            if why is None and n == "weightcache-p2p":
                why = daemon_lacks_peers(tools["weightcache"])
            if why is not None:
                bl.log(f"skipping {n}: {why}")
                continue
        out.append(Strategy(n, tool_of[n], tools[tool_of[n]], tuple(args.wc_arg)))
    return out


@dataclass
class Measured:
    """The raw result of one scale-out."""

    runs: list[ms.Run]
    samples: list[tuple[float, ...]]  # (t since t0, GETs in flight, replicas waiting)
    counts: Counters
    t0: float  # perf_counter when the replicas started
    daemon_cpu_s: float
    daemon_counters: dict[str, float]  # bl.DAEMON_COUNTERS summed over the nodes ({} without)


@dataclass
class Outcome:
    """One strategy's scale-out, as the store and the replicas saw it."""

    strategy: str
    round: int
    replicas_ok: int
    replicas_failed: int
    failures: list[str]
    origin_bytes: int  # response body bytes that left the store
    origin_model_copies: float  # origin_bytes / model size
    cold_nodes: int  # nodes with replicas and no prewarm
    requests: dict[str, int]  # by method
    statuses: dict[int, int]
    proxy_errors: int
    peak_get_inflight: int  # exact, counted by the proxy
    download_window_s: tuple[float, float]  # first and last sample with a GET in flight
    ratio_mean: float  # mean of GETs in flight / replicas waiting over the window
    ratio_first_half: float
    ratio_second_half: float
    all_ready_s: float
    median_ready_s: float
    replica_cpu_s_total: float
    daemon_cpu_s_total: float  # node daemons, from their start to their stop
    # From the daemons' /metrics (NaN for strategies without daemons): bytes received from
    # peers, bytes served to peers, bytes the daemons got from the store (a cross-check of
    # origin_bytes, which also counts listings and manifests), sha256 mismatches.
    peer_bytes: float
    peer_upload_bytes: float
    daemon_origin_bytes: float
    daemon_verify_failures: float
    replica_maxrss_mib_max: float
    samples: list[tuple[float, ...]] = field(repr=False)  # (t, GETs in flight, waiting)
    runs: list[dict[str, object]] = field(repr=False)


def run_scaleout(
    strategy: Strategy,
    model: bl.Model,
    store: DevStore,
    proxy: CountingProxy,
    root: Path,
    args: argparse.Namespace,
) -> Measured:
    """Prewarm, start every replica at once, wait for all of them."""
    nodes = [root / f"node-{k}" for k in range(args.nodes)]
    logs = root / "logs"
    for node in nodes:
        node.mkdir(parents=True)
    prewarm(strategy, model, store, nodes[: args.prewarmed], logs, args.timeout)
    env = bl.peer_env(proxy.url, store.env)
    daemons = DaemonNodes(strategy, nodes, proxy.url, env, logs)
    os.sync()
    children: list[ms.Child] = []
    total = args.replicas

    def waiting() -> tuple[float, ...]:
        # Replicas not spawned yet count as waiting: they all "start at once" at t0.
        return (total - sum(1 for c in list(children) if c.done),)

    daemon_cpu = 0.0
    daemon_counters: dict[str, float] = {}
    try:
        proxy.reset()
        sampler = Sampler(proxy, extra=waiting, interval=args.interval).start()
        for i in range(total):
            argv = strategy.command(model, proxy.url, strategy.dest(nodes[i % args.nodes], i))
            children.append(ms.Child(strategy.name, argv, env, logs / f"replica-{i:03d}"))
        runs = [c.result(args.timeout) for c in children]
        time.sleep(3 * args.interval)  # the tail: a few samples after the last replica
        samples = sampler.stop()
        counts = proxy.snapshot()
        if daemons.procs:
            daemon_counters = daemons.scrape()
    finally:
        daemon_cpu = daemons.stop()
    for i, run in enumerate(runs):
        node = i % args.nodes
        run.extra.update(replica=i, node=node, ready_s=run.started + run.wall_s - sampler.t0)
        if run.returncode != 0:
            run.problem = f"exit {run.returncode}: {run.stderr_tail.strip()[-300:]}"
        else:
            run.problem = bl.check_tree(strategy.ready(model, strategy.dest(nodes[node], i)), model)
    return Measured(runs, samples, counts, sampler.t0, daemon_cpu, daemon_counters)


def prewarm(
    strategy: Strategy,
    model: bl.Model,
    store: DevStore,
    nodes: list[Path],
    logs: Path,
    timeout: float,
) -> None:
    """Run the strategy's own command once per node, straight to the store (not counted)."""
    if not strategy.node_cache:
        return  # an emptyDir per replica cannot be prewarmed
    env = bl.peer_env(store.endpoint_url, store.env)
    for k, node in enumerate(nodes):
        argv = strategy.command(model, store.endpoint_url, strategy.dest(node, 0))
        r = ms.run_measured(strategy.name, argv, env, logs / f"prewarm-node{k}", timeout)
        if r.returncode != 0:
            raise SystemExit(f"prewarm of node {k} failed: {r.stderr_tail}")


def outcome(
    strategy: Strategy,
    rnd: int,
    model: bl.Model,
    args: argparse.Namespace,
    measured: Measured,
) -> Outcome:
    runs, samples, counts, t0 = measured.runs, measured.samples, measured.counts, measured.t0
    ready_at = [r.started + r.wall_s - t0 for r in runs]
    ratios = [(t, g / w) for t, g, w in samples if w > 0]
    # The download window: from the first to the last sample with a GET in flight. The
    # early-warning ratio should fall from its first half to its second (design §1, §6).
    active = [t for t, g, _ in samples if g > 0]
    start, end = (active[0], active[-1]) if active else (0.0, 0.0)
    middle = (start + end) / 2

    def mean_ratio(lo: float, hi: float) -> float:
        vals = [x for t, x in ratios if lo <= t <= hi]
        return sum(vals) / len(vals) if vals else float("nan")

    return Outcome(
        strategy=strategy.name,
        round=rnd,
        replicas_ok=sum(1 for r in runs if r.ok),
        replicas_failed=sum(1 for r in runs if not r.ok),
        failures=[r.problem or "" for r in runs if not r.ok],
        origin_bytes=counts.body_bytes_out,
        origin_model_copies=counts.body_bytes_out / model.total_bytes,
        cold_nodes=max(0, min(args.nodes, args.replicas) - args.prewarmed),
        requests=dict(counts.requests),
        statuses=dict(counts.statuses),
        proxy_errors=counts.errors,
        peak_get_inflight=counts.get_inflight_peak,
        download_window_s=(start, end),
        ratio_mean=mean_ratio(start, end),
        ratio_first_half=mean_ratio(start, middle),
        ratio_second_half=mean_ratio(middle, end),
        all_ready_s=max(ready_at),
        median_ready_s=ms.median(ready_at),
        replica_cpu_s_total=sum(r.cpu_s for r in runs),
        daemon_cpu_s_total=measured.daemon_cpu_s,
        peer_bytes=measured.daemon_counters.get("peer_bytes", float("nan")),
        peer_upload_bytes=measured.daemon_counters.get("peer_upload_bytes", float("nan")),
        daemon_origin_bytes=measured.daemon_counters.get("origin_bytes", float("nan")),
        daemon_verify_failures=measured.daemon_counters.get("verify_failures", float("nan")),
        replica_maxrss_mib_max=max(r.maxrss_mib for r in runs),
        samples=samples,
        runs=[r.as_dict() for r in runs],
    )


def peer_mib(received: float, sent: float) -> str:
    """`received/sent` in MiB, from the daemons' metrics; `-` without daemons."""
    if received != received and sent != sent:  # both NaN: no daemons
        return "-"
    return f"{ms.fmt_num(received / (1 << 20), 0)}/{ms.fmt_num(sent / (1 << 20), 0)}"


def report(outcomes: list[Outcome]) -> str:
    rows = []
    for name in dict.fromkeys(o.strategy for o in outcomes):
        mine = [o for o in outcomes if o.strategy == name]

        def med(get: Callable[[Outcome], float], mine: list[Outcome] = mine) -> float:
            return ms.median([get(o) for o in mine])

        ok = sum(o.replicas_ok for o in mine)
        rows.append(
            [
                name,
                f"{ok}/{ok + sum(o.replicas_failed for o in mine)}",
                ms.fmt_num(med(lambda o: o.origin_bytes) / (1 << 20), 0),
                ms.fmt_num(med(lambda o: o.origin_model_copies)) + "x",
                peer_mib(med(lambda o: o.peer_bytes), med(lambda o: o.peer_upload_bytes)),
                str(mine[0].cold_nodes),
                ms.fmt_num(med(lambda o: o.requests.get("GET", 0)), 0),
                ms.fmt_num(med(lambda o: o.peak_get_inflight), 0),
                ms.fmt_num(med(lambda o: o.ratio_first_half)),
                ms.fmt_num(med(lambda o: o.ratio_second_half)),
                ms.fmt_num(med(lambda o: o.median_ready_s)),
                ms.fmt_num(med(lambda o: o.all_ready_s)),
                ms.fmt_num(med(lambda o: o.replica_cpu_s_total + o.daemon_cpu_s_total), 1),
            ]
        )
    headers = [
        "strategy", "ready", "origin MiB", "origin / model", "peer MiB recv/sent",
        "cold nodes", "GETs",
        "peak GETs in flight", "GETs/waiting 1st half", "GETs/waiting 2nd half",
        "median ready s", "all ready s", "CPU s",
    ]  # fmt: skip
    return ms.md_table(headers, rows)


def plot(outcomes: list[Outcome], path: Path, title: str) -> None:
    """One subplot per strategy (its first round): GETs in flight and replicas waiting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first: dict[str, Outcome] = {}
    for o in outcomes:
        first.setdefault(o.strategy, o)
    fig, axes = plt.subplots(len(first), 1, figsize=(10, 3.2 * len(first) + 0.6), squeeze=False)
    for ax, o in zip(axes[:, 0], first.values(), strict=True):
        t = [s[0] for s in o.samples]
        ax.step(t, [s[1] for s in o.samples], where="post", label="origin GETs in flight")
        ax.step(t, [s[2] for s in o.samples], where="post", label="replicas waiting")
        ax2 = ax.twinx()
        ratio = [s[1] / s[2] if s[2] else float("nan") for s in o.samples]
        ax2.plot(t, ratio, color="tab:gray", linestyle=":", label="GETs / waiting")
        ax2.set_ylabel("GETs / waiting")
        ax2.set_ylim(bottom=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("seconds since the replicas started")
        ax.set_title(
            f"{o.strategy}: {o.origin_bytes / (1 << 20):.0f} MiB from origin "
            f"({o.origin_model_copies:.2f} x model)"
            + (
                f", {o.peer_bytes / (1 << 20):.0f} MiB from peers"
                if o.peer_bytes == o.peer_bytes and o.peer_bytes
                else ""
            )
            + f", all {o.replicas_ok + o.replicas_failed} "
            f"replicas done in {o.all_ready_s:.1f} s ({o.replicas_failed} failed)"
        )
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    bl.log(f"wrote {path}")


def main() -> None:
    args = parse_args()
    bl.use_rev(args.weightcache_rev)
    size = bl.parse_size(args.size)
    strategies = strategies_from(args)
    if not strategies:
        raise SystemExit("no strategy can run")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wc-bench-scaleout-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = bl.machine_info(workdir)
    versions = {s.name: bl.tool_version(s.tool, s.exe) for s in strategies}
    outcomes: list[Outcome] = []
    try:
        model = bl.make_model(workdir / "model", size, name=f"scaleout-{args.size.lower()}")
        with DevStore(workdir / "store") as store, CountingProxy(store.endpoint_url) as proxy:
            bl.upload_model(model, store.endpoint_url, store.env)
            bl.log(
                f"model {model.prefix} ({bl.fmt_size(model.total_bytes)}) uploaded; "
                f"proxy {proxy.url} -> {store.endpoint_url}"
            )
            for rnd in range(1, args.rounds + 1):
                for strategy in strategies:
                    root = workdir / "runs" / f"{strategy.name}-r{rnd}"
                    measured = run_scaleout(strategy, model, store, proxy, root, args)
                    o = outcome(strategy, rnd, model, args, measured)
                    outcomes.append(o)
                    bl.log(
                        f"round {rnd} {o.strategy}: {o.replicas_ok}/{args.replicas} ready in "
                        f"{o.all_ready_s:.1f} s, {o.origin_model_copies:.2f} x model from "
                        f"origin, {ms.fmt_num(o.peer_bytes / (1 << 20), 0)} MiB from peers, "
                        f"peak {o.peak_get_inflight} GETs; failures {o.failures[:3]}"
                    )
                    if not args.keep:
                        bl.drop_dir(root)
    finally:
        if not args.keep:
            bl.drop_dir(workdir)
    header = (
        f"scale-out of {bl.fmt_size(model.total_bytes)}: {args.replicas} replicas on "
        f"{args.nodes} nodes, {args.prewarmed} prewarmed, {args.rounds} round(s), medians; "
        f"{bl.machine_line(info)}"
    )
    print(f"{header}\n\n{report(outcomes)}")
    failed = [f for o in outcomes for f in o.failures]
    if failed:
        print(f"\n{len(failed)} replica runs failed; first: {failed[0]}")
    if args.plot:
        plot(outcomes, args.plot, header)
    if args.json:
        payload: dict[str, object] = {
            "benchmark": "scaleout",
            "machine": info,
            "versions": versions,
            "params": {**vars(args), "size_bytes": size, "model_bytes": model.total_bytes},
            "results": [asdict(o) for o in outcomes],
        }
        ms.write_json(args.json, payload)


if __name__ == "__main__":
    main()
