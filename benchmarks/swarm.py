"""Swarm: N cold nodes start together, each behind its own shaped link; how soon is the last
one ready, and how much did the store send? Peers on against peers off and the line rate.

    sudo python benchmarks/swarm.py [--nodes 8,16] [--size 256M] [--link 400mbit]
                                    [--regimes 1,4] [--rounds 1] [--modes p2p,off]
                                    [--json out.json] [--plot out.png] [--sim-piece 0]
                                    [--sim-calibration cal.json | --sim-cores 2 ...]
    sudo python benchmarks/swarm.py --cleanup     # remove leftovers of a crashed run
    python benchmarks/swarm.py --from-json n8.json n16.json --plot benchmarks/swarm.png

Needs root (network namespaces, tc). `netlab.Lab` builds a bridge with one namespace per
host: the store (`weed mini`, 198.18.0.1) and N nodes (198.18.1.k). tc tbf shapes each node's
upload and download to `--link`, and the store's egress to a multiple of it (`--regimes`:
1 = the store is as fast as one node, the store-bound regime; 4 = four times as fast).
A quick GET of one shard, store -> node1 and node1 -> node2, prints the achieved rates next
to the configured ones, and calibrates the wire overhead (Ethernet/IP/TCP/HTTP headers).

Per regime, N and round, each mode in turn (`p2p`: `--peer-addr` and `--peers` listing every
node, one shared `WEIGHTCACHE_PEER_TOKEN`; `off`: no peer flags): every node gets an empty
cache dir and a models file pinning the model, and all N `weightcache daemon`s are spawned
back to back in their namespaces. Measured from outside the daemons:

- a node's *ready* time: from the first spawn until the revision's completion marker
  appears in its cache (looked for every `--poll` s, 0.1, from the host) and its /readyz
  then says every pinned revision is ready (body `ready`; while one is missing: `ready;
  pinned revisions not cached yet: NAME/REV`). /readyz's status means "serving" (design §5), so the
  body is what counts. *up* is when /readyz first answered (polled every `--poll` s until
  then: the daemon's start-up, Python and imports, included in *ready*); after that the
  daemon is not asked until its marker is there (`Poller`);
- *store sent*: the bytes tc's tbf on the store's uplink sent during the run (wire bytes),
  divided by the overhead measured in the sanity check, in model sizes. Not self-reported;
- *received*: what each daemon counted as received from the store and from peers, over the
  model (the median node): above 1, pieces received twice and thrown away;
- the daemons' own counters (origin, peer bytes) and CPU, and the host's CPU busy share, in
  the JSON, to tell a CPU-bound run from a link-bound one;
- every link's rate over time (`netlab.LinkTrace`, every 0.5 s, beside the host's CPU busy
  share: the store's pace in CPU-saturated intervals against the others is printed), and
  how congested the links were: the packets each tbf dropped and the TCP retransmission
  timeouts in each namespace (`congestion`).

The line rate is the model's bytes over one node's link: no node can be ready sooner.
Next to the measurements, benchmarks/swarmsim.py's prediction for the same setting (the
daemons' measured start-up included, the model's blobs one after another in the daemons'
pieces, or in pieces of `--sim-piece`), in a table and in the plot
(benchmarks/swarmplot.py). With `--sim-calibrate` (benchmarks/swarmcal.py runs first), or
`--sim-calibration cal.json` (from `swarmcal.py --json cal.json` on the same host), or
`--sim-cores 2 --sim-cpu-per-mib-recv ...`, the simulator shares the host's cores among
the daemons as well (benchmarks/swarmnet.py), and the table shows its CPU-s next to the
daemons'; also with `--from-json`, to compare saved runs again.
Everything the run created (namespaces, veths, bridge, processes, workdir) is removed in a
finally block, on SIGTERM too.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import benchlib as bl
import measure as ms
import netlab as nl
import swarmplot
from swarmnet import Cpu, add_cpu_options

MODES = ("p2p", "off")
PEER_PORT, METRICS_PORT = 9401, 9402
#: No HTTP proxy of the host's environment for the lab's addresses.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --------------------------------------------------------------------------- pure helpers


def pinned_ready(readyz_text: str) -> bool:
    """True when /readyz answered "ready" with no pinned revision still missing (its body
    names them: "ready; pinned revisions not cached yet: NAME/REV ...")."""
    return readyz_text.strip() == "ready"


def line_rate_s(model_bytes: int, link_bits: int) -> float:
    """The fastest any node can have the model: its bytes over its own link."""
    return model_bytes * 8 / link_bits


@dataclass(frozen=True)
class Summary:
    """One run as the tables print it; ready times in seconds, NaN when not ready."""

    nodes_ready: int
    last_s: float
    p50_s: float
    last_x_line: float
    p50_x_line: float
    store_x_model: float  # payload: wire bytes over the measured overhead
    wire_x_model: float  # tc's bytes as they are, headers included


def summarize(ready_s: list[float | None], line_s: float, store_payload: float,
              model_bytes: int, store_wire: float = float("nan")) -> Summary:  # fmt: skip
    """A node that never got ready makes *last* NaN (the run did not finish)."""
    done = sorted(t for t in ready_s if t is not None)
    last = done[-1] if done and len(done) == len(ready_s) else float("nan")
    p50 = ms.median(done) if len(done) * 2 >= len(ready_s) else float("nan")
    return Summary(len(done), last, p50, last / line_s, p50 / line_s,
                   store_payload / model_bytes, store_wire / model_bytes)  # fmt: skip


def received_x_model(run: Run, model_bytes: int) -> float:
    """The bytes a node received (its daemon's `weightcache_bytes_total` from the store and
    from peers) over the model, the median over the nodes: above 1, copies of pieces that
    lost a race and were thrown away. NaN without counters."""
    got = [c["origin_bytes"] + c["peer_bytes"] for c in run.daemon_counters]
    return ms.median([g for g in got if g == g]) / model_bytes  # NaN if none


# --------------------------------------------------------------------------- the sanity check


def sanity_check(lab: nl.Lab, model: bl.Model, store_bits: int, link_bits: int) -> float:
    """Print achieved against configured rates; return the wire overhead factor of the
    store's link (tc bytes / HTTP body bytes) for a plain GET."""
    shard = max(model.listed, key=lambda rel: model.listed[rel])
    before = lab.store.sent_bytes()
    size, rate = nl.http_get(lab.store, lab.node(1), model.local_dir, shard)
    overhead = (lab.store.sent_bytes() - before) / size
    expect = min(store_bits, link_bits)
    print(f"sanity: store -> node1, {bl.fmt_size(size)} at {rate / 1e6:.0f} Mbit/s "
          f"(configured {expect / 1e6:.0f}: store {nl.fmt_rate(store_bits)}, node download "
          f"{nl.fmt_rate(link_bits)}); wire bytes / body bytes {overhead:.3f}")  # fmt: skip
    if lab.nodes >= 2:
        size, rate = nl.http_get(lab.node(1), lab.node(2), model.local_dir, shard)
        print(f"sanity: node1 -> node2, {bl.fmt_size(size)} at {rate / 1e6:.0f} Mbit/s "
              f"(configured {link_bits / 1e6:.0f})")  # fmt: skip
    return overhead


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One swarm start: `n` nodes in one mode."""

    regime: int
    n: int
    mode: str
    round: int
    ready_s: list[float | None]  # per node, since the first spawn
    up_s: list[float | None]  # when its /metrics first answered
    store_wire_bytes: int
    store_payload_bytes: float  # wire bytes / the sanity check's overhead
    daemon_cpu_s: float
    host_cpu_busy: float  # share of all cores busy during the run, from /proc/stat
    harness_cpu_s: float = float("nan")  # this process (the pollers), during the run
    daemon_counters: list[dict[str, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    link_use: dict[str, Any] = field(default_factory=dict)  # `link_use`
    congestion: dict[str, Any] = field(default_factory=dict)  # `congestion`


class Poller(threading.Thread):
    """Times one node: `up` when its /readyz first answers, `ready` when its cache holds a
    revision's completion marker (`cache`/NAME/REV/.weightcache) and its /readyz then says
    every pinned revision is ready (or `stop`). Once the daemon is up, the marker is
    looked for from here (a directory listing per period) and /readyz asked only when it
    appears: a /readyz costs a daemon ~1.8 ms of CPU (benchmarks/swarmcal.py), so ten a
    second are about a tenth of a swarming daemon's CPU at 100 mbit, on the host all the
    daemons share; a kubelet asks every 10 s."""

    def __init__(self, url: str, cache: Path, t0: float, period: float,
                 stop: threading.Event) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.url, self.cache, self.t0, self.period, self.halt = url, cache, t0, period, stop
        self.up: float | None = None
        self.ready: float | None = None

    def run(self) -> None:
        url = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(url.netloc, timeout=5)  # kept: one per node
        while self.ready is None and not self.halt.is_set():
            seen = self._marker_seen() if self.up is not None else None
            if self.up is None or seen is not None:
                text = self._readyz(conn)
                now = time.perf_counter() - self.t0
                if text is not None:
                    self.up = now if self.up is None else self.up
                    if seen is not None and pinned_ready(text):
                        self.ready = seen
                        break
            self.halt.wait(self.period)
        conn.close()

    def _marker_seen(self) -> float | None:
        """When a completion marker was first seen in the cache (None: none yet)."""
        markers = self.cache.glob("*/*/.weightcache")  # not the cache's own .weightcache/
        if not any(not m.parent.parent.name.startswith(".") for m in markers):
            return None
        return time.perf_counter() - self.t0

    def _readyz(self, conn: http.client.HTTPConnection) -> str | None:
        """/readyz's body ("" for a 503: up, not serving), None if it did not answer."""
        try:
            conn.request("GET", urllib.parse.urlsplit(self.url).path)
            resp = conn.getresponse()
            body = resp.read().decode()
        except (OSError, http.client.HTTPException):
            conn.close()  # reconnects at the next request
            return None
        return body if resp.status == 200 else ""


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all cores, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def daemon_argv(exe: list[str], node: nl.Host, root: Path, store_url: str,
                peers: str | None, wc_args: list[str]) -> list[str]:  # fmt: skip
    argv = [
        *node.exec_prefix(), *exe, "daemon", "--cache-dir", str(root / "cache"),
        "--models", str(root / "models.yaml"), "--capacity", "90%",
        "--endpoint-url", store_url, "--metrics-addr", f"{node.addr}:{METRICS_PORT}",
        "--kubelet-pods-dir", str(root / "kubelet-pods"), *wc_args,
    ]  # fmt: skip
    if peers is not None:
        argv += ["--peer-addr", f"{node.addr}:{PEER_PORT}", "--peers", peers]
    return argv


def scrape(node: nl.Host) -> dict[str, float]:
    try:
        with _DIRECT.open(f"http://{node.addr}:{METRICS_PORT}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {k: bl.metric_value(text, series) for k, series in bl.DAEMON_COUNTERS.items()}


def swarm_run(lab: nl.Lab, where: tuple[int, int, str, int], model: bl.Model,
              store: nl.NetnsStore, args: argparse.Namespace, root: Path,
              overhead: float) -> Run:  # fmt: skip
    """Start n daemons at once on empty caches, wait until all are ready (or the timeout);
    `where` is (regime, n, mode, round)."""
    n, mode = where[1], where[2]
    nodes = [lab.node(k) for k in range(1, n + 1)]
    peers = ",".join(f"{h.addr}:{PEER_PORT}" for h in nodes) if mode == "p2p" else None
    env = {**bl.peer_env(store.endpoint_url, store.env), "WEIGHTCACHE_PEER_TOKEN": args.token}
    argvs = []
    for node in nodes:
        home = root / node.name
        (home / "kubelet-pods").mkdir(parents=True)
        (home / "models.yaml").write_text(f"models:\n  - source: {model.source}\n    pin: true\n")
        argvs.append(daemon_argv(args.exe, node, home, store.endpoint_url, peers, args.wc_arg))
    os.sync()
    sent0, cpu0, self0 = lab.store.sent_bytes(), cpu_times(), time.process_time()
    losses0 = losses([lab.store, *nodes])
    halt = threading.Event()
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.perf_counter()
    trace = nl.LinkTrace(lab, t0).start()
    try:
        for node, argv in zip(nodes, argvs, strict=True):
            with open(root / f"{node.name}.log", "wb") as out:
                procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                             stdout=out, stderr=out, start_new_session=True))  # fmt: skip
        pollers = [Poller(f"http://{h.addr}:{METRICS_PORT}/readyz", root / h.name / "cache", t0,
                          args.poll, halt) for h in nodes]  # fmt: skip
        for p in pollers:
            p.start()
        deadline = time.monotonic() + args.timeout
        for p in pollers:
            p.join(max(0.0, deadline - time.monotonic()))
        halt.set()
        sent, cpu1 = lab.store.sent_bytes() - sent0, cpu_times()
        harness_cpu = time.process_time() - self0
        counters = [scrape(h) for h in nodes]
        lost = [tuple(b - a for a, b in zip(x, y, strict=True))
                for x, y in zip(losses0, losses([lab.store, *nodes]), strict=True)]  # fmt: skip
    finally:
        halt.set()
        trace.stop()
        daemon_cpu = ms.stop_processes(procs)
    failures = [f"{h.name}: {_tail(root / f'{h.name}.log')}"
                for h, p in zip(nodes, pollers, strict=True) if p.ready is None]  # fmt: skip
    busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    use = link_use(trace, where[0] * args.link_bits, args.link_bits, pollers)
    return Run(*where, [p.ready for p in pollers],
               [p.up for p in pollers], sent, sent / overhead, daemon_cpu, busy,
               harness_cpu, counters, failures, use, congestion(lost))  # fmt: skip


def losses(hosts: list[nl.Host]) -> list[tuple[int, int, int]]:
    """Per host, (packets tbf dropped on its uplink, on its downlink, TCP retransmission
    timeouts in its namespace): how congested the links were, from outside the daemons."""
    return [(*h.drops(), h.tcp_timeouts()) for h in hosts]


def congestion(lost: list[tuple[int, ...]]) -> dict[str, Any]:
    """`losses` during a run (the store first): the store's uplink drops, and per node its
    downlink drops and its TCP retransmission timeouts (a flow silent 200 ms or more)."""
    return {"store_up_drops": lost[0][0], "store_tcp_timeouts": lost[0][2],
            "node_down_drops": [x[1] for x in lost[1:]],
            "node_tcp_timeouts": [x[2] for x in lost[1:]]}  # fmt: skip


def link_use(trace: nl.LinkTrace, store_bits: float, link_bits: float,
             pollers: list[Poller]) -> dict[str, Any]:  # fmt: skip
    """How busy the links were: the store's uplink from its first byte to its last, and
    each node's downlink from its /readyz's first answer to its ready time (share of
    intervals at 90% of the link or more, and the mean rate over the link)."""
    rates = [trace.rates(k) for k in range(len(pollers) + 1)]  # 0: the store
    store = [(t, up) for t, up, _ in rates[0] if up > 0.01 * store_bits]
    use: dict[str, Any] = {
        "store_busy": nl.busy_share([up for _, up in store], store_bits),
        "store_from": store[0][0] if store else None,
        "store_to": store[-1][0] if store else None,
        "node_busy": [], "node_mean": [],
        "store_mbit": [(round(t, 2), round(up / 1e6, 1)) for t, up, _ in rates[0]],
        "node_down_mbit": [[round(d / 1e6, 1) for _, _, d in r] for r in rates[1:]],
        "node_up_mbit": [[round(u / 1e6, 1) for _, u, _ in r] for r in rates[1:]],
        "host_cpu": [(round(t, 2), round(busy, 3)) for t, busy in trace.cpu_busy()],
    }  # fmt: skip
    for p, node in zip(pollers, rates[1:], strict=True):
        down = [d for t, _, d in node if (p.up or 0) < t <= (p.ready or float("inf"))]
        use["node_busy"].append(nl.busy_share(down, link_bits))
        use["node_mean"].append(sum(down) / len(down) / link_bits if down else float("nan"))
    return use


def store_rate_by_cpu(use: dict[str, Any], saturated: float = 0.95) -> str:
    """The store's mean uplink rate, from its first byte to its last, in the intervals the
    host's CPU was busy `saturated` or more against the others: whether the store's pace
    follows this machine's CPU (all daemons share it) rather than the swarm's choices."""
    groups: dict[bool, list[float]] = {True: [], False: []}
    for (t, mbit), (_, busy) in zip(use["store_mbit"], use["host_cpu"], strict=False):
        if use["store_from"] <= t <= use["store_to"] and busy == busy:
            groups[busy >= saturated].append(mbit)
    parts = [
        f"{len(v)} intervals {'at' if hot else 'below'} {saturated:.0%} host CPU: the "
        f"store's uplink {sum(v) / len(v):.1f} Mbit/s mean"
        for hot, v in groups.items()
        if v
    ]
    return "; ".join(parts) or "no interval with the store sending"


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1][-300:] if lines else "(no output)"


# --------------------------------------------------------------------------- report


def report(runs: list[Run], regime: int, n_values: list[int], line_s: float,
           model_bytes: int) -> str:  # fmt: skip
    """One regime's table: per N, each mode (medians over rounds) and the line rate."""
    rows: list[list[str]] = []
    for n in n_values:
        for mode in dict.fromkeys(r.mode for r in runs):
            mine = [r for r in runs if r.regime == regime and r.n == n and r.mode == mode]
            if not mine:
                continue
            sums = [summarize(r.ready_s, line_s, r.store_payload_bytes, model_bytes,
                              r.store_wire_bytes) for r in mine]  # fmt: skip

            def med(values: list[float]) -> float:
                return ms.median([v for v in values if v == v])  # NaN if none

            last_up = med([max((u for u in r.up_s if u is not None), default=float("nan"))
                           for r in mine])  # fmt: skip
            rows.append([
                str(n), "peers on" if mode == "p2p" else "peers off",
                f"{sum(s.nodes_ready for s in sums)}/{n * len(mine)}",
                ms.fmt_num(med([s.last_s for s in sums]), 1),
                ms.fmt_times(med([s.last_x_line for s in sums])),
                ms.fmt_num(med([s.p50_s for s in sums]), 1),
                ms.fmt_times(med([s.p50_x_line for s in sums])),
                ms.fmt_times(med([s.store_x_model for s in sums])),
                ms.fmt_times(med([s.wire_x_model for s in sums])),
                ms.fmt_times(med([received_x_model(r, model_bytes) for r in mine])),
                ms.fmt_num(last_up, 1),
                ms.fmt_num(med([r.daemon_cpu_s for r in mine]), 0),
                ms.fmt_num(100 * med([r.host_cpu_busy for r in mine]), 0) + "%",
            ])  # fmt: skip
        rows.append([str(n), "line rate", "-", ms.fmt_num(line_s, 1), "1.00x",
                     ms.fmt_num(line_s, 1), "1.00x", *["n/a"] * 6])  # fmt: skip
    headers = ["N", "mode", "ready", "last ready s", "last / line", "p50 ready s",
               "p50 / line", "store sent / model", "wire / model", "received / model",
               "last up s", "daemon CPU s", "host CPU busy"]  # fmt: skip
    return ms.md_table(headers, rows)


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="8", help="comma-separated N values (default 8)")
    p.add_argument("--size", default="256M", help="model shard bytes (default 256M)")
    p.add_argument("--link", default="400mbit", help="each node's upload and download rate")
    p.add_argument("--regimes", default="1,4", help="store egress as multiples of --link")
    p.add_argument("--modes", default="p2p,off", help=f"comma-separated from {MODES}")
    p.add_argument("--rounds", type=int, default=1, help="repeat each run; medians reported")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between /readyz polls")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--wc-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every daemon, repeatable")  # fmt: skip
    bl.add_rev_option(p)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (logs, caches)")
    p.add_argument("--json", type=Path, help="write every run here")
    p.add_argument("--plot", type=Path, help="write a PNG: ready time against N")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="print the tables (and --plot) of saved --json files again (merged), run nothing",
    )
    p.add_argument("--sim-piece", default="0",
                   help="the simulator's piece size (0: the daemons', per blob)")  # fmt: skip
    p.add_argument("--sim-calibration", type=Path, metavar="FILE",
                   help="the simulator's CPU model from `swarmcal.py --json FILE` (with this "
                   "host's cores); the --sim-cpu-* flags set it by hand")  # fmt: skip
    p.add_argument("--sim-calibrate", action="store_true",
                   help="run benchmarks/swarmcal.py first (a minute or two) for the simulator's "
                   "CPU model")  # fmt: skip
    add_cpu_options(p, "sim-")
    p.add_argument("--cleanup", action="store_true",
                   help=f"remove every namespace and link named {nl.PREFIX}* and exit")  # fmt: skip
    args = p.parse_args()
    try:
        args.n_values = sorted({int(x) for x in args.nodes.split(",")})
        args.regime_values = [int(x) for x in args.regimes.split(",")]
        args.link_bits = nl.parse_rate(args.link)
        args.size_bytes = bl.parse_size(args.size)
        args.sim_piece_bytes = bl.parse_size(args.sim_piece)
        args.sim_cpu = swarmplot.sim_cpu(args)
    except (ValueError, OSError, KeyError, TypeError) as e:
        p.error(str(e))
    args.mode_values = [m for m in args.modes.split(",") if m]
    if set(args.mode_values) - set(MODES) or not 1 <= min(args.n_values) <= 250:
        p.error(f"modes from {MODES}; 1 <= N <= 250")
    return args


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


def main() -> None:
    args = parse_args()
    if args.cleanup:
        print("\n".join(nl.cleanup()) or "nothing to remove")
        return
    if args.from_json:
        saved = swarmplot.merge([json.loads(f.read_text()) for f in args.from_json])
        print_results(saved, [Run(**r) for r in saved["runs"]], args.plot, args.sim_piece_bytes,
                      args.sim_cpu)  # fmt: skip
        return
    if os.geteuid() != 0:
        raise SystemExit("swarm.py needs root: network namespaces and tc")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    bl.use_rev(args.weightcache_rev)
    tools, _ = bl.available_tools(["weightcache"], required=True)
    args.exe, args.token = tools["weightcache"], secrets.token_hex(16)
    bl.precompile(args.exe)  # as installed in the image: not compiled again by every daemon
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wc-bench-swarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = bl.machine_info(workdir)
    args.ready_by = "marker"  # `Poller`: the simulator charges no /readyz polls (print_results)
    if args.sim_calibrate:
        args.sim_calibration = workdir / "swarmcal.json"
        subprocess.run([sys.executable, str(Path(__file__).with_name("swarmcal.py")), "--link",
                        args.link, "--size", args.size, "--json", str(args.sim_calibration)],
                       check=True)  # fmt: skip
        args.sim_cpu = swarmplot.sim_cpu(args)
    runs: list[Run] = []
    try:
        with nl.Lab(max(max(args.n_values), 2)) as lab:
            bl.log(f"lab {lab.tag}: bridge {lab.bridge}, store + {lab.nodes} nodes")
            model, overheads, line_s = run_all(lab, args, workdir, runs)
    except KeyboardInterrupt:
        raise SystemExit(
            "interrupted; the lab (namespaces, links, processes) and the workdir are removed"
        ) from None
    finally:
        if not args.keep:
            bl.drop_dir(workdir)
    model_files = len(model.listed)
    output = {"benchmark": "swarm", "machine": info,
              "params": {k: v for k, v in vars(args).items()
                         if k not in ("token", "sim_cpu", "sim_calibration")},
              "model_bytes": model.total_bytes, "model_files": model_files,
              "line_rate_s": line_s, "wire_overhead": overheads,
              "runs": [asdict(r) for r in runs], "sim_cpu": asdict(args.sim_cpu)}  # fmt: skip
    if args.json:
        ms.write_json(args.json, output)
    print_results(output, runs, args.plot, args.sim_piece_bytes, args.sim_cpu)


def print_results(output: dict[str, Any], runs: list[Run], plot_path: Path | None,
                  sim_piece: int, cpu: Cpu | None = None) -> None:  # fmt: skip
    """The tables, the simulator's prediction (and the plot), from what `--json` saves."""
    p, line_s, overheads = output["params"], output["line_rate_s"], output["wire_overhead"]
    header = (
        f"swarm of {bl.fmt_size(output['model_bytes'])} ({output.get('model_files', 6)} files): "
        f"N = {p['nodes']} nodes started together, links {p['link']} up and down, line rate "
        f"{line_s:.1f} s, {p['rounds']} round(s), medians; {bl.machine_line(output['machine'])}"
    )
    print(f"\n{header}")
    for regime in p["regime_values"]:
        print(f"\nstore egress = {regime} x {p['link']} "
              f"({nl.fmt_rate(regime * p['link_bits'])}); wire overhead "
              f"{overheads[str(regime)]:.3f}\n")  # fmt: skip
        print(report(runs, regime, p["n_values"], line_s, output["model_bytes"]))
    for r in runs:
        if r.link_use and r.link_use["store_from"] is not None:
            u = r.link_use
            print(f"regime {r.regime} N={r.n} {r.mode} round {r.round}: the store's uplink at "
                  f"90% or more {u['store_busy']:.0%} of {u['store_from']:.1f}-"
                  f"{u['store_to']:.1f} s; node downlinks, up to ready: at 90% or more "
                  f"{ms.median(u['node_busy']):.0%}, mean {ms.median(u['node_mean']):.0%} of "
                  f"the link (median node)")  # fmt: skip
    for r in runs:
        if r.link_use.get("host_cpu") and r.link_use["store_from"] is not None:
            print(f"regime {r.regime} N={r.n} {r.mode} round {r.round}: "
                  f"{store_rate_by_cpu(r.link_use)}")  # fmt: skip
    for r in runs:
        if c := r.congestion:
            print(f"regime {r.regime} N={r.n} {r.mode} round {r.round}: packets dropped by the "
                  f"store's uplink {c['store_up_drops']}, by node downlinks "
                  f"{sum(c['node_down_drops'])} (median node {ms.median(c['node_down_drops'])})"
                  f"; TCP retransmission timeouts in the store {c['store_tcp_timeouts']}, in "
                  f"the nodes {sum(c['node_tcp_timeouts'])}")  # fmt: skip
    for r in runs:
        if r.failures:
            print(f"\nregime {r.regime} N={r.n} {r.mode}: {len(r.failures)} not ready; "
                  f"first: {r.failures[0]}")  # fmt: skip
    cpu = cpu or Cpu()
    if p.get("ready_by") == "marker":  # the daemons were not polled while they downloaded
        cpu = replace(cpu, poll=0.0)
    predicted = swarmplot.predict(output, runs, sim_piece, cpu)
    host = f"CPU: {cpu.describe()}" if cpu.on else "links only, the daemons' measured start-up"
    pieces = f"pieces of {bl.fmt_size(sim_piece)}" if sim_piece else "the daemons' pieces"
    print(f"\nsimulated (benchmarks/swarmsim.py, the median of {swarmplot.SEEDS} seeds; the "
          f"model's blobs in turn, {pieces}, "
          f"{host}):\n")  # fmt: skip
    print(swarmplot.agreement(output, runs, predicted))
    if plot_path:
        swarmplot.plot(output, runs, plot_path, header, predicted)


def run_all(lab: nl.Lab, args: argparse.Namespace, workdir: Path,
            runs: list[Run]) -> tuple[bl.Model, dict[str, float], float]:  # fmt: skip
    """The store, the model, then every regime x N x round x mode; appends to `runs`."""
    model = bl.make_model(workdir / "model", args.size_bytes, name=f"swarm-{args.size.lower()}")
    line_s = line_rate_s(model.total_bytes, args.link_bits)
    overheads: dict[str, float] = {}  # by regime, as a JSON key
    for k in range(1, lab.nodes + 1):
        lab.node(k).shape(args.link_bits, args.link_bits)
    with nl.NetnsStore(workdir / "store", host=lab.store) as store:
        bl.upload_model(model, store.endpoint_url, store.env)
        for regime in args.regime_values:
            lab.store.shape(regime * args.link_bits, None)
            overhead = sanity_check(lab, model, regime * args.link_bits, args.link_bits)
            overheads[str(regime)] = overhead
            for n in args.n_values:
                for rnd in range(1, args.rounds + 1):
                    for mode in args.mode_values:
                        root = workdir / "runs" / f"x{regime}-n{n}-{mode}-r{rnd}"
                        where = (regime, n, mode, rnd)
                        r = swarm_run(lab, where, model, store, args, root, overhead)
                        runs.append(r)
                        ready = sorted(round(t, 1) for t in r.ready_s if t is not None)
                        bl.log(f"x{regime} N={n} {mode} round {rnd}: ready s {ready}, "
                               f"store sent {r.store_payload_bytes / model.total_bytes:.2f} x "
                               f"model, daemon CPU {r.daemon_cpu_s:.0f} s, host busy "
                               f"{100 * r.host_cpu_busy:.0f}%")  # fmt: skip
                        if not args.keep:
                            bl.drop_dir(root)
    return model, overheads, line_s


if __name__ == "__main__":
    main()
