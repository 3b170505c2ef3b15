"""Swarm simulator: N nodes fetch one blob through `weightcache.node.swarm.choose`.

    python benchmarks/swarmsim.py [--nodes 8,16] [--size 256M] [--piece 4M] [--link 400M]
                                  [--store-rate 1x,4x] [--rtt 0.001] [--refresh 0.5]
                                  [--startup 0] [--jitter 0] [--view 32] [--seed 1]
                                  [--json out.json] [--cores 2 --cpu-per-mib-recv 0.005 ...]

A discrete-event simulation of the piece and source choice past what this machine can run.
Every node calls the exact pure function the daemons use, with the view it would have: its
own state live; its peers' bitmaps (held, in flight) and upload counts as of its last
refresh (every `--refresh` seconds, each node at its own phase, the first one a refresh
after its start: at the start a node knows nothing of the others); a node with nothing in
flight looks at its peers again (one RTT) before it decides, at most ten times a refresh.
Whether the store has room is measured at the same moments, idealized: the store sent less
than 80% of its egress since the node's previous measurement (a daemon has to infer this
from its own requests' rates and the store's 503s); the node's store window follows with
`next_window`. Its link is spare if it receives less than 90% of the link's rate. A node
watches at most `--view` peers (a random sample, fixed per node): polling a thousand peers'
bitmaps every second is not something a daemon would do, and rarity is then local, as in
BitTorrent; its rank (its stripe, see `choose`) is among all N nodes.

The network (benchmarks/swarmnet.py): every node has an uplink and a downlink (`--link`,
the same both ways; times `--efficiency`, the payload share of a shaped link: 0.95 for
TCP/IPv4 at MTU 1500), the store an egress (`--store-rate`, bits/s, or `Nx` for N times a
node's link); fair share per link. A request's bytes start one `--rtt` after it is made.
Nothing fails. Every node's daemon starts `--startup` seconds after t = 0 plus a uniform
share of `--jitter`; ready times count from t = 0, as the benchmark's do.

The CPU (swarmnet.py, off by default: a real cluster has a node's cores per node): with
`--cores` and the costs (`--cpu-per-mib-recv`, `-sent`, `-hash`, `--cpu-busy`,
`--cpu-per-probe`, `--cpu-startup`, as benchmarks/swarmcal.py measures them), all nodes
share the host's cores, and a node's progress is the smaller of its links' and its CPU
share's; its start-up is CPU work too, so N daemons spawned together on few cores serve only
after N x start-up / cores seconds.
Without the CPU model, the measured daemons' start-up goes in `--startup 2 --jitter 2`.

Compared with, per N (closed forms of the same fluid model, all nodes starting at once,
`--startup` after t = 0):
- *peers off*: every node streams the blob from the store; the store's egress is shared
  equally, each node capped by its link and its equal share of the CPU;
- *today*: one node streams from the store, the others each stream a contiguous prefix from
  it (design §8 before the swarm), sharing its uplink and never passing its progress;
- *line*: one link's time for the blob (wire rate); *bound*: the larger of that and the
  store's time for one copy, below which no schedule can go.

Pieces may be coarse (e.g. 256 MiB for 140 GB on 1,000 nodes: ~560 pieces), which keeps a
run to minutes; the daemons use pieces of a few MiB. The cost grows with nodes x pieces x
requests in flight per node.
"""

from __future__ import annotations

import argparse
import heapq
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import measure as ms
from benchlib import parse_size
from swarmnet import (
    BEGIN,
    BOOTED,
    END,
    POLL,
    REFRESH,
    START,
    Cpu,
    Flow,
    MiB,
    Network,
    add_cpu_options,
    cpu_from_args,
)

from weightcache.node.swarm import (
    ORIGIN,
    Bitmap,
    Limits,
    Local,
    PeerView,
    StoreView,
    choose,
    next_window,
    piece_count,
)

SPARE = 0.9  # a node receiving less than this share of its link has room for more
STORE_ROOM = 0.8  # the store has room if it sent less than this share of its egress


@dataclass(frozen=True)
class Params:
    nodes: int
    size: int  # bytes
    piece: int  # bytes
    link: float  # bits/s, each node's uplink and downlink
    store_rate: float  # bits/s, the store's egress
    rtt: float = 0.001  # seconds from a request to its first byte
    refresh: float = 0.5  # seconds between a node's looks at its peers' advertisements
    jitter: float = 0.0  # nodes start uniformly within this many seconds after `startup`
    startup: float = 0.0  # seconds from t = 0 until a daemon starts (spawn to serving)
    view: int = 32  # peers a node watches at most
    efficiency: float = 0.95  # payload share of a link's rate
    seed: int = 1
    limits: Limits = field(default_factory=Limits)
    cpu: Cpu = field(default_factory=Cpu)  # the host's CPU (swarmnet.py); off by default


@dataclass
class Outcome:
    last: float  # seconds from t = 0 to the last node ready
    p50: float
    store_copies: float  # bytes the store sent / blob size
    ready: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU-s all the nodes used, with a CPU model


@dataclass
class Node:
    have: int = 0
    fetching: int = 0  # pieces in flight, as advertised
    inflight: dict[int, list[Flow]] = field(default_factory=dict)
    started: bool = False
    ready: float | None = None
    room: bool = False
    window: int = 1  # claims to keep in flight (next_window)
    polled: float = -1.0  # when it last looked again because it was idle
    measured: tuple[float, float] = (0.0, 0.0)  # the store's bytes sent, at this time
    view: list[PeerView] = field(default_factory=list)
    watches: list[int] = field(default_factory=list)


class Swarm:
    """One run of `choose` on every node of `p`."""

    def __init__(self, p: Params) -> None:
        self.p = p
        self.count = piece_count(p.size, p.piece)
        self.full = (1 << self.count) - 1
        self.rng = random.Random(p.seed)
        link = p.link * p.efficiency / 8
        self.store = p.nodes
        store = p.store_rate * p.efficiency / 8
        self.net = Network([link] * p.nodes + [store], [link] * p.nodes, p.cpu)
        self.nodes = [Node() for _ in range(p.nodes)]
        self.store_bytes = 0.0
        for i, node in enumerate(self.nodes):
            others = [j for j in range(p.nodes) if j != i]
            node.watches = others if len(others) <= p.view else self.rng.sample(others, p.view)
            self.net.at(p.startup + self.rng.uniform(0, p.jitter), START, i)

    def run(self) -> Outcome:
        net = self.net
        horizon = 4 * peers_off(self.p).last + self.p.jitter + 10 * self.p.refresh
        while net.events and net.now <= horizon:  # a stalled node is reported as never ready
            net.now, _, kind, obj, ver = heapq.heappop(net.events)
            if kind == END and isinstance(obj, Flow) and obj.ver == ver and obj.active:
                self._arrived(obj)
            elif kind == BEGIN and isinstance(obj, Flow) and obj.ver == ver:
                net.start(obj)
            elif kind in (START, BOOTED) and isinstance(obj, int):
                self._start(obj, kind, ver)
            elif kind == REFRESH and isinstance(obj, int) and self.nodes[obj].ready is None:
                self._refresh(obj)
                self._decide(obj)
                net.at(net.now + self.p.refresh, REFRESH, obj)
            elif kind == POLL and isinstance(obj, int) and self.nodes[obj].ready is None:
                self._refresh(obj)
                self._decide(obj)
        ready = [n.ready if n.ready is not None else float("inf") for n in self.nodes]
        return Outcome(max(ready), statistics.median(ready), self.store_bytes / self.p.size, ready,
                       net.cpu_used)  # fmt: skip

    def _start(self, i: int, kind: int, ver: int) -> None:
        """Node `i`'s daemon spawned (START) or finished its start-up CPU (BOOTED)."""
        if kind == START and self.p.cpu.startup > 0:
            self.net.boot(i, self.p.cpu.startup)  # a BOOTED event when done
            return
        if kind == BOOTED and not self.net.booted(i, ver):
            return  # a stale event: the boot's rate changed since
        self.nodes[i].started = True
        self._background(i)
        self._decide(i)
        self.net.at(self.net.now + self.p.refresh, REFRESH, i)

    def _background(self, i: int) -> None:
        """Node `i`'s CPU besides its flows while it downloads: busy, and a view round's
        HEADs to the peers it watches that did not answer it a piece request lately."""
        node, cpu = self.nodes[i], self.p.cpu
        if node.ready is not None:
            self.net.set_background(i, 0.0)
            return
        answering = {f.src for fs in node.inflight.values() for f in fs}
        heads = sum(1 for j in node.watches if j not in answering)
        self.net.set_background(i, cpu.busy + cpu.probe * heads / self.p.refresh)

    def _refresh(self, i: int) -> None:
        node, net = self.nodes[i], self.net
        node.view = [
            PeerView(
                str(j),
                Bitmap(self.count, self.nodes[j].have),
                Bitmap(self.count, self.nodes[j].fetching),
                len(net.up_flows[j]),
            )
            for j in node.watches
        ]
        sent, since = net.sent_by(self.store), net.now - node.measured[1]
        if since > 0:
            node.room = sent - node.measured[0] < STORE_ROOM * net.up[self.store] * since
            node.window = next_window(node.window, node.room, self.p.limits)
        node.measured = (sent, net.now)
        self._background(i)

    def _decide(self, i: int) -> None:
        node = self.nodes[i]
        if node.ready is not None:
            return
        if not node.inflight and node.view and self.net.now >= node.polled + self.p.refresh / 10:
            # with nothing in flight, look at the peers again before deciding (one RTT)
            node.polled = self.net.now
            self.net.at(self.net.now + self.p.rtt, POLL, i)
            return
        local = Local(
            Bitmap(self.count, node.have),
            {k: frozenset(self._source(f) for f in fs) for k, fs in node.inflight.items()},
            rank=i,
            nodes=self.p.nodes,
            spare=self.net.inflow(i) < SPARE * self.net.down[i],
        )
        requests = choose(
            local, node.view, StoreView(node.room, node.window), self.p.limits, self.rng
        )
        for r in requests:
            src = self.store if r.source == ORIGIN else int(r.source)
            start, end = r.piece * self.p.piece, min((r.piece + 1) * self.p.piece, self.p.size)
            f = Flow(src, i, r.piece, end - start)
            node.inflight.setdefault(r.piece, []).append(f)
            node.fetching |= 1 << r.piece
            self.net.at(self.net.now + self.p.rtt, BEGIN, f, f.ver)

    def _source(self, f: Flow) -> str:
        return ORIGIN if f.src == self.store else str(f.src)

    def _arrived(self, f: Flow) -> None:
        node = self.nodes[f.dst]
        for g in node.inflight.pop(f.piece):
            sent = self.net.stop(g) if g.active else 0.0
            g.ver += 1  # a request still on its way is dropped
            if g.src == self.store:
                self.store_bytes += sent
        node.have |= 1 << f.piece
        node.fetching &= ~(1 << f.piece)
        if node.have == self.full:
            node.ready = self.net.now
            self._background(f.dst)
        self._decide(f.dst)


def peers_off(p: Params) -> Outcome:
    """Every node streams from the store: equal shares of its egress, capped by the link
    and by the node's equal share of the CPU (after all boot together, sharing it too)."""
    link = min(p.store_rate / p.nodes, p.link) * p.efficiency / 8
    rate, boot = p.cpu.recv_rate(p.nodes, link), p.cpu.boot_time(p.nodes)
    t = p.startup + boot + p.rtt + p.size / rate
    cores = min(p.cpu.share(p.nodes), p.cpu.busy + link * (p.cpu.recv + p.cpu.hash) / MiB)
    cpu_s = p.nodes * (p.cpu.startup + cores * p.size / rate) if p.cpu.on else 0.0
    return Outcome(t, t, float(p.nodes), cpu_s=cpu_s)


def today(p: Params) -> Outcome:
    """One node from the store; the others stream its growing prefix through its uplink."""
    leader = p.startup + p.rtt + p.size / (min(p.store_rate, p.link) * p.efficiency / 8)
    if p.nodes == 1:
        return Outcome(leader, leader, 1.0)
    follower = p.startup + p.rtt + p.size / (min(p.link / (p.nodes - 1), p.link) * p.efficiency / 8)
    t = max(leader, follower)
    return Outcome(t, statistics.median([leader] + [t] * (p.nodes - 1)), 1.0)


def line(p: Params) -> float:
    return p.size * 8 / p.link


def bound(p: Params) -> float:
    return p.size * 8 / min(p.link, p.store_rate)


def run(p: Params) -> dict[str, object]:
    """The swarm and its comparisons for one setting, as a table row's worth of numbers."""
    began = time.perf_counter()
    swarm = Swarm(p).run()
    cpu = time.perf_counter() - began
    off, now = peers_off(p), today(p)
    return {
        "params": {**asdict(p), "limits": asdict(p.limits)},
        "swarm": asdict(swarm) | {"ready": sorted(swarm.ready)},
        "peers_off": asdict(off),
        "today": asdict(now),
        "line": line(p),
        "bound": bound(p),
        "sim_seconds": cpu,
    }


# -- command line ---------------------------------------------------------------------------

HEADERS = (
    "nodes", "store egress", "pieces", "swarm last s", "swarm p50 s", "store x model",
    "last / line", "peers off last s", "peers off store x", "today last s", "today p50 s",
    "line s", "bound s", "sim s",
)  # fmt: skip


def row(r: dict[str, object]) -> list[object]:
    p, s, off, now = (r[k] for k in ("params", "swarm", "peers_off", "today"))
    assert isinstance(p, dict) and isinstance(s, dict)
    assert isinstance(off, dict) and isinstance(now, dict)
    ln, bd = float(str(r["line"])), float(str(r["bound"]))
    return [
        p["nodes"], fmt_bits(p["store_rate"]), piece_count(p["size"], p["piece"]),
        f"{s['last']:.1f}", f"{s['p50']:.1f}", f"{s['store_copies']:.2f}",
        f"{s['last'] / ln:.2f}", f"{off['last']:.1f}", f"{off['store_copies']:.0f}",
        f"{now['last']:.1f}", f"{now['p50']:.1f}", f"{ln:.1f}", f"{bd:.1f}",
        f"{float(str(r['sim_seconds'])):.1f}",
    ]  # fmt: skip


_BITS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)


def parse_bits(text: str) -> float:
    """`400M`, `25G`, `100Gbit` -> bits per second (decimal units, as links are sold)."""
    m = _BITS.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (use e.g. 400M, 25G)")
    return float(m[1]) * 1000 ** ("kmgt".index(m[2].lower()) + 1 if m[2] else 0)


def fmt_bits(bits: float) -> str:
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit"


def store_rates(text: str, link: float) -> list[float]:
    """`1x,4x,25G`: multiples of a node's link, or rates."""
    return [
        float(t[:-1]) * link if t.lower().endswith("x") else parse_bits(t) for t in text.split(",")
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,16", help="comma-separated node counts")
    ap.add_argument("--size", default="256M", help="blob size: 256M, 1G binary; 140GB decimal")
    ap.add_argument("--piece", default="4M", help="piece size")
    ap.add_argument("--link", default="400M", type=parse_bits, help="node link, bits/s")
    ap.add_argument("--store-rate", default="1x,4x", help="store egress: 4x (of --link) or 25G")
    ap.add_argument("--rtt", default=0.001, type=float, help="seconds")
    ap.add_argument("--refresh", default=0.5, type=float, help="advertisement age, seconds")
    ap.add_argument("--startup", default=0.0, type=float, help="daemon start, seconds")
    ap.add_argument("--jitter", default=0.0, type=float, help="start spread, seconds")
    ap.add_argument("--view", default=32, type=int, help="peers a node watches at most")
    ap.add_argument("--efficiency", default=0.95, type=float, help="payload share of a link")
    ap.add_argument("--per-peer", default=Limits.per_peer, type=int)
    ap.add_argument("--per-origin", default=Limits.per_origin, type=int)
    ap.add_argument("--claims", default=Limits.claims, type=int)
    ap.add_argument("--total", default=Limits.total, type=int)
    ap.add_argument("--seed", default=1, type=int)
    ap.add_argument("--json", type=Path, help="write every run's numbers here")
    add_cpu_options(ap)
    a = ap.parse_args(argv)
    limits = Limits(per_peer=a.per_peer, per_origin=a.per_origin, claims=a.claims, total=a.total)
    cpu = cpu_from_args(a)
    results = []
    for n in (int(x) for x in a.nodes.split(",")):
        for store in store_rates(a.store_rate, a.link):
            p = Params(
                n, parse_size(a.size), parse_size(a.piece), a.link, store, a.rtt, a.refresh,
                a.jitter, a.startup, a.view, a.efficiency, a.seed, limits, cpu,
            )  # fmt: skip
            results.append(run(p))
            print(f"N={n} store {fmt_bits(store)}: done", file=sys.stderr, flush=True)
    print(f"size {a.size}, piece {a.piece}, link {fmt_bits(a.link)}, rtt {a.rtt} s, refresh "
          f"{a.refresh} s, startup {a.startup} s, jitter {a.jitter} s, view {a.view}, "
          f"efficiency {a.efficiency}, {limits}, seed {a.seed}; CPU: "
          f"{cpu.describe() if cpu.on else 'not modelled'}\n")  # fmt: skip
    print(ms.md_table(HEADERS, [row(r) for r in results]))
    if a.json:
        ms.write_json(a.json, {"argv": sys.argv, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
