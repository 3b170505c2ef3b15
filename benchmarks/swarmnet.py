"""The swarm simulator's fluid model: links with fair share per link, and the CPU of a host
shared by its nodes (benchmarks/swarmsim.py drives the policy on it).

Links: every node has an uplink and a downlink, the store an egress. A flow's rate is
min(its sender's uplink / flows on it, its receiver's downlink / flows on it), recomputed for
the flows of both links whenever a flow starts or ends (capacity a sender-limited flow leaves
unused on its receiver's link is not redistributed: slightly pessimistic).

Cut-through: a flow g from node j for a piece that j is itself still receiving from the
store (flow f, g's `upstream`: `start(g, f)`) cannot deliver more than f has delivered to j.
While g is behind f it runs at its links' share; once level with f (it started before f's
first byte, or caught up: a CAUGHT event) it runs at min(its share, f's rate), and falls
behind again if its share drops below f's rate. Level, it cannot end before f, so it gets
no END event while f runs: when f stops it is released (a normal flow for what it has left,
nothing if it was level: it ends at once, after f). Every change of f's rate re-rates g
(`_apply`, from `_reshare` and `_reshare_all`). An upstream stopped before completing is
one whose piece landed at j from another source (`swarmsim._arrived` stops every flow of a
piece once one delivers it; nothing fails in the simulator): j holds the whole piece then,
and g goes on from it. A stop for any other reason would let g complete on bytes j never
got; none exists here. The store's flows have no upstream: a streamed piece has one hop.
Not modelled: the daemons' peer server passes a streamed piece on in chunks of at least
64 KiB, looking every 20 ms (`server.STREAM_CHUNK`, `STREAM_POLL`), so a level copy
lags its upstream by up to that much there.

CPU (`Cpu`, off by default: a real cluster has a node's cores per node): the host has
`cores` cores shared by every node that has work, processor sharing with each node's share
capped at `node_cores` and at what it asks (`share`). A node asks for CPU in proportion to
its flows at their link rates: `recv + hash` CPU-s per MiB it receives (from the store or a
peer), `sent` per MiB it serves to peers; plus, while it downloads, `busy` cores (what a
daemon spends per second whatever its rate: timers, its loops; why a MiB costs more when
bytes trickle in), `poll` cores (the benchmark asking its /readyz every 0.1 s: about 1.5 ms
of the daemon's CPU each; not the daemon's own, so kept apart; 0 for runs that watched
the cache for the marker instead, `swarm.Poller`) and `probe` CPU-s per HEAD of
its view rounds (the simulator sets this `background`: slowed with the flows when the node
is short, as polls and timers of a descheduled process fire less often); a booting node
(`startup` CPU-s of work from its spawn until it serves) asks for a whole `node_cores`. A
node granted less than it asks slows each of its flows by the same factor, and a flow runs
at its link rate times the smaller factor of its two ends (the store has no CPU limit).
With CPU on, every flow's rate is recomputed at every start and end of a flow or a boot.

Also here: the simulation's setting (`Params`: nodes, blobs, links, the policy's limits),
its result (`Outcome`), the closed forms of the same fluid model it is compared with
(`peers_off`, `today`, `line`, `bound`) and rates in bits (`parse_bits`, `fmt_bits`).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from weightcache.swarm.choice import RequestLimits
from weightcache.swarm.pieces import piece_size_for
from weightcache.swarm.views import VIEW_EVERY

MiB = 1 << 20
#: Event kinds of the simulation's one queue; END, BOOTED and CAUGHT are the network's own.
START, BEGIN, END, REFRESH, POLL, BOOTED, JOIN, CAUGHT = range(8)


@dataclass(frozen=True)
class Cpu:
    """The host's CPU and what a daemon spends it on; costs in CPU-seconds."""

    cores: float = math.inf  # shared by all the nodes (inf: a node's own cores per node)
    node_cores: float = 1.0  # one daemon's at most (one Python process, its GIL)
    recv: float = 0.0  # per MiB received from the store or a peer: reads, writes, requests
    sent: float = 0.0  # per MiB served to peers
    hash: float = 0.0  # per MiB hashed; every received byte is hashed once
    startup: float = 0.0  # from a daemon's spawn until it serves
    busy: float = 0.0  # cores a downloading daemon uses whatever its rate (timers, loops)
    probe: float = 0.0  # per HEAD of a view round (both ends), one per peer per refresh
    poll: float = 0.0  # cores the benchmark's /readyz polls cost a daemon until it is ready

    @property
    def on(self) -> bool:
        """False when no cost is set: the CPU never binds, links alone decide."""
        costs = (self.recv, self.sent, self.hash, self.startup, self.busy, self.probe, self.poll)
        return sum(costs) > 0

    @property
    def waiting(self) -> float:
        """Cores a downloading daemon uses whatever its rate: its own (`busy`) and the
        benchmark's polls of its /readyz (`poll`)."""
        return self.busy + self.poll

    def share(self, nodes: int) -> float:
        """Cores each of `nodes` equally busy nodes gets."""
        return min(self.node_cores, self.cores / nodes)

    def recv_rate(self, nodes: int, link: float) -> float:
        """Bytes/s a node receives by a link of `link` bytes/s when `nodes` nodes do the same
        (its flows slowed by its share over its demand, as `Network` does)."""
        demand = self.waiting + link * (self.recv + self.hash) / MiB
        return link * min(1.0, self.share(nodes) / demand) if demand else link

    def boot_time(self, nodes: int) -> float:
        """Seconds until `nodes` daemons spawned together all serve."""
        return self.startup / self.share(nodes) if self.startup else 0.0

    def describe(self) -> str:
        return (f"{self.cores:g} cores ({self.node_cores:g} per node at most), CPU-s per MiB "
                f"received {self.recv:g}, sent {self.sent:g}, hashed {self.hash:g}; start-up "
                f"{self.startup:g} CPU-s; busy {self.busy:g} cores while downloading, "
                f"{self.poll:g} for the /readyz polls; {self.probe:g} CPU-s per view "
                "HEAD")  # fmt: skip


def share(demands: Sequence[float], cores: float, cap: float) -> list[float]:
    """Processor sharing: `cores` split equally among the nodes, each taking at most `cap`
    and what it asks; what one leaves goes to the others (max-min fair)."""
    want = [min(d, cap) for d in demands]
    alloc = [0.0] * len(want)
    left = cores
    order = sorted(range(len(want)), key=want.__getitem__)
    for k, i in enumerate(order):
        alloc[i] = min(want[i], left / (len(order) - k))
        left -= alloc[i]
    return alloc


def add_cpu_options(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The `Cpu` fields as options (`--cores`, `--cpu-per-mib-recv`, ...; `prefix` before
    each, e.g. `sim-`); `cpu_from_args` reads them back."""
    d = Cpu()
    ap.add_argument(f"--{prefix}cores", type=float, default=d.cores,
                    help="host cores shared by all nodes (default: inf, no CPU model)")  # fmt: skip
    for name, help_ in (("recv", "received (store or peer)"), ("sent", "served to peers"),
                        ("hash", "hashed (every received byte)")):  # fmt: skip
        ap.add_argument(f"--{prefix}cpu-per-mib-{name}", type=float, default=0.0,
                        help=f"CPU-s per MiB {help_}")  # fmt: skip
    ap.add_argument(f"--{prefix}cpu-startup", type=float, default=0.0,
                    help="CPU-s from a daemon's spawn until it serves")  # fmt: skip
    ap.add_argument(f"--{prefix}cpu-node-cores", type=float, default=d.node_cores,
                    help="cores one daemon can use at most")  # fmt: skip
    ap.add_argument(f"--{prefix}cpu-busy", type=float, default=0.0,
                    help="cores a downloading daemon uses whatever its rate")  # fmt: skip
    ap.add_argument(f"--{prefix}cpu-per-probe", type=float, default=0.0,
                    help="CPU-s per HEAD of a view round (one per peer per refresh)")  # fmt: skip
    ap.add_argument(f"--{prefix}cpu-poll", type=float, default=0.0,
                    help="cores the /readyz polls cost a daemon until it is ready")  # fmt: skip


def cpu_from_args(a: argparse.Namespace, prefix: str = "") -> Cpu:
    p = prefix.replace("-", "_")
    names = {"cores": "cores", "node_cores": "cpu_node_cores", "recv": "cpu_per_mib_recv",
             "sent": "cpu_per_mib_sent", "hash": "cpu_per_mib_hash", "startup": "cpu_startup",
             "busy": "cpu_busy", "probe": "cpu_per_probe", "poll": "cpu_poll"}  # fmt: skip
    return Cpu(**{k: float(getattr(a, p + v)) for k, v in names.items()})


def cpu_flags(cpu: Cpu, prefix: str = "") -> str:
    """The options that give `cpu` back (the calibration prints them)."""
    return (f"--{prefix}cores {cpu.cores:g} --{prefix}cpu-per-mib-recv {cpu.recv:.5f} "
            f"--{prefix}cpu-per-mib-sent {cpu.sent:.5f} --{prefix}cpu-per-mib-hash "
            f"{cpu.hash:.5f} --{prefix}cpu-startup {cpu.startup:.3f} --{prefix}cpu-busy "
            f"{cpu.busy:.4f} --{prefix}cpu-per-probe {cpu.probe:.5f} --{prefix}cpu-poll "
            f"{cpu.poll:.4f}")  # fmt: skip


@dataclass(frozen=True)
class Params:
    nodes: int
    size: int  # bytes, all blobs together
    piece: int  # bytes; 0: the daemons' own piece size for each blob (`piece_size_for`)
    link: float  # bits/s, each node's uplink and downlink
    store_rate: float  # bits/s, the store's egress
    rtt: float = 0.001  # seconds from a request to its first byte
    refresh: float = VIEW_EVERY  # seconds between a node's HEAD rounds to its peers
    jitter: float = 0.0  # nodes start uniformly within this many seconds after `startup`
    startup: float = 0.0  # seconds from t = 0 until a daemon starts (spawn to serving)
    view: int = 32  # peers a node watches at most
    efficiency: float = 0.95  # payload share of a link's rate
    seed: int = 1
    limits: RequestLimits = field(default_factory=RequestLimits)
    cpu: Cpu = field(default_factory=Cpu)  # the host's CPU (swarmnet.py); off by default
    blobs: tuple[int, ...] = ()  # the blobs' sizes in the daemons' order; () = one of `size`
    # blobs a node brings at once at most (1 or 2): the next starts when every piece of the last
    # one started is held or asked for, here or by a peer in view, as fetch/blobs.py does
    pipeline: int = 2
    dead: int = 0  # nodes (a random few) listed as members that never start
    # peers advertise the pieces they receive from the store and pass them on as they arrive
    # (`PeerView.streaming`; the flows coupled, `Network.start`); False: only held pieces
    cut_through: bool = True

    def layout(self) -> list[tuple[int, int]]:
        """(size, piece size) of each blob, in the order every node fetches them."""
        return [(b, self.piece or piece_size_for(b)) for b in self.blobs or (self.size,)]


@dataclass
class Outcome:
    last: float  # seconds from t = 0 to the last node ready
    p50: float
    store_copies: float  # bytes the store sent / blob size
    ready: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU-s all the nodes used, with a CPU model


def peers_off(p: Params) -> Outcome:
    """Every node streams from the store: equal shares of its egress, capped by the link
    and by the node's equal share of the CPU (after all boot together, sharing it too)."""
    link = min(p.store_rate / p.nodes, p.link) * p.efficiency / 8
    rate, boot = p.cpu.recv_rate(p.nodes, link), p.cpu.boot_time(p.nodes)
    t = p.startup + boot + p.rtt + p.size / rate
    cores = min(p.cpu.share(p.nodes), p.cpu.waiting + link * (p.cpu.recv + p.cpu.hash) / MiB)
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


class Flow:
    """One request's bytes on the way from `src` (a node, or nodes = the store) to `dst`;
    `upstream`: the store's flow of the same piece to `src` that this one passes on
    (cut-through, see the module's docstring), `followers` the flows passing this one on."""

    __slots__ = ("active", "dst", "followers", "left", "level", "made", "pace", "piece",
                 "rate", "share", "size", "src", "stamp", "upstream", "ver")  # fmt: skip

    def __init__(self, src: int, dst: int, piece: int, size: int, made: float = 0.0) -> None:
        self.src, self.dst, self.piece, self.size, self.made = src, dst, piece, size, made
        self.left, self.rate, self.stamp, self.ver, self.active = float(size), 0.0, 0.0, 0, False
        self.share = 0.0  # the rate its links (and CPU) allow, before its upstream's cap
        self.pace = math.inf  # its upstream's rate when it was last rated (inf: none)
        self.upstream: Flow | None = None
        self.followers: list[Flow] = []
        self.level = False  # has delivered as much as its upstream (then capped by its rate)


class Usage:
    """How full the links were over time, in bins of `step` seconds (`swarmsim.py --trace`):
    the nodes' downlinks together and the store's egress, each as a share of its capacity.
    `until(t)` adds the rates in force since the last call, up to the next event at `t`."""

    def __init__(self, net: Network, step: float) -> None:
        self.net, self.step, self.stamp = net, step, 0.0
        self.down: list[float] = []  # bytes received by all nodes, per bin
        self.store: list[float] = []  # bytes the store sent, per bin

    def until(self, t: float) -> None:
        rates = sum(self.net.down_rate), self.net.up_rate[-1]
        while self.stamp < t:
            k = int(self.stamp / self.step)
            if (k + 1) * self.step <= self.stamp:  # rounding put the stamp on the bin's edge
                k += 1
            end = min(t, (k + 1) * self.step)
            while len(self.down) <= k:
                self.down.append(0.0)
                self.store.append(0.0)
            self.down[k] += rates[0] * (end - self.stamp)
            self.store[k] += rates[1] * (end - self.stamp)
            self.stamp = end

    def rows(self) -> list[list[str]]:
        """One row per bin: its start, the downlinks' and the store's use."""
        down, store = sum(self.net.down) * self.step, self.net.up[-1] * self.step
        return [[f"{k * self.step:.0f}", f"{max(0.0, d) / down:.2f}", f"{max(0.0, s) / store:.2f}"]
                for k, (d, s) in enumerate(zip(self.down, self.store, strict=True))]  # fmt: skip


class Boot:
    """A daemon's start-up: CPU-s left, at the rate (cores) it is granted since `stamp`."""

    __slots__ = ("left", "rate", "stamp", "ver")

    def __init__(self, cpu_s: float, now: float) -> None:
        self.left, self.rate, self.stamp, self.ver = cpu_s, 0.0, now, 0


class Network:
    """Links (and, if `cpu` is on, the host's CPU), and the event queue their flows' ends
    go into. Nodes are 0 .. len(down) - 1; up[-1] is the store's egress."""

    def __init__(self, up: list[float], down: list[float], cpu: Cpu | None = None) -> None:
        self.up, self.down = up, down  # bytes/s
        self.cpu = cpu if cpu is not None and cpu.on else None
        # dicts, not sets: flows in the order they started, so that a run is the same every
        # time (a set's order is its objects' addresses: ties among events moved with it)
        self.up_flows: list[dict[Flow, None]] = [{} for _ in up]
        self.down_flows: list[dict[Flow, None]] = [{} for _ in down]
        self.up_rate, self.down_rate = [0.0] * len(up), [0.0] * len(down)  # sums of flow rates
        self.sent = [0.0] * len(up)  # bytes sent by each uplink up to `stamp`
        self.stamp = [0.0] * len(up)
        self.booting: dict[int, Boot] = {}
        self.background = [0.0] * len(down)  # cores a node uses besides its flows
        self.cpu_used, self._cores_used, self._cpu_stamp = 0.0, 0.0, 0.0  # CPU-s until stamp
        self.now = 0.0
        self.events: list[tuple[float, int, int, object, int]] = []
        self._seq = itertools.count()

    def at(self, when: float, kind: int, obj: object, ver: int = 0) -> None:
        heapq.heappush(self.events, (when, next(self._seq), kind, obj, ver))

    def rate(self, f: Flow) -> float:
        """`f`'s rate by its links alone."""
        return min(
            self.up[f.src] / len(self.up_flows[f.src]),
            self.down[f.dst] / len(self.down_flows[f.dst]),
        )

    def start(self, f: Flow, upstream: Flow | None = None) -> None:
        """Put `f` on its links; with `upstream`, the store's flow of the same piece to
        `f.src`, whose bytes `f` passes on as they arrive (cut-through)."""
        f.active, f.stamp = True, self.now
        if upstream is not None:
            f.upstream, f.level = upstream, self._left(upstream) >= f.left
            upstream.followers.append(f)
        self.up_flows[f.src][f] = None
        self.down_flows[f.dst][f] = None
        self._reshare(f.src, f.dst)

    def stop(self, f: Flow) -> float:
        """Take `f` off its links (one not started yet: its request is dropped); returns the
        bytes it had delivered. Flows passing it on are released: its receiver holds the
        piece now (see the module's docstring)."""
        if f.upstream is not None:
            f.upstream.followers.remove(f)
            f.upstream = None
        released, f.followers = f.followers, []
        for g in released:
            g.upstream = None
            self._apply(g, g.share, force=True)
        if not f.active:
            f.ver += 1
            return 0.0
        self._settle(f)
        self._set_rate(f, 0.0)
        f.active = False
        f.ver += 1
        self.up_flows[f.src].pop(f, None)
        self.down_flows[f.dst].pop(f, None)
        self._reshare(f.src, f.dst)
        return f.size - max(f.left, 0.0)

    def boot(self, node: int, cpu_s: float) -> None:
        """Start `node`'s start-up work; a BOOTED event for it comes when it is done."""
        self.booting[node] = Boot(cpu_s, self.now)
        self._reshare_all()

    def booted(self, node: int, ver: int) -> bool:
        """True (and the node's CPU freed) if a BOOTED event is the current one."""
        b = self.booting.get(node)
        if b is None or b.ver != ver:
            return False
        del self.booting[node]
        self._reshare_all()
        return True

    def set_background(self, node: int, cores: float) -> None:
        """The CPU `node` asks for besides its flows' (slowed with them when short)."""
        if self.cpu is not None and cores != self.background[node]:
            self.background[node] = cores
            self._reshare_all()

    def inflow(self, node: int) -> float:
        return self.down_rate[node]

    def sent_by(self, src: int) -> float:
        """Bytes uplink `src` has sent until now (all its flows)."""
        return self.sent[src] + self.up_rate[src] * (self.now - self.stamp[src])

    def _set_rate(self, f: Flow, rate: float) -> None:
        self.sent[f.src] = self.sent_by(f.src)
        self.stamp[f.src] = self.now
        self.up_rate[f.src] += rate - f.rate
        self.down_rate[f.dst] += rate - f.rate
        f.rate = rate

    def _settle(self, f: Flow) -> None:
        f.left -= f.rate * (self.now - f.stamp)
        f.stamp = self.now

    def _left(self, f: Flow) -> float:
        """Bytes `f` has still to deliver, now."""
        return f.left - f.rate * (self.now - f.stamp)

    def caught(self, f: Flow, ver: int) -> None:
        """A CAUGHT event: `f` has delivered as much as its upstream, if still current."""
        if f.ver == ver and f.active and f.upstream is not None:
            f.level = True
            self._apply(f, f.share, force=True)

    def _apply(self, f: Flow, share: float, force: bool = False) -> None:
        """`f`'s rate from `share`, what its links (and CPU) allow; capped by its upstream's
        rate once level with it, with a CAUGHT event for when it will be (module docstring);
        then its followers' rates if its own changed. Nothing changes (its events stand)
        unless `share` or its upstream's rate did, or with `force`."""
        up = f.upstream
        pace = math.inf if up is None else up.rate
        if share == f.share and pace == f.pace and not force:
            return
        f.share, f.pace = share, pace
        f.level = up is not None and f.level and share >= pace
        rate = min(share, pace) if f.level else share
        changed = rate != f.rate
        self._settle(f)
        self._set_rate(f, rate)
        f.ver += 1
        if up is None:
            self.at(self.now + max(f.left, 0.0) / rate, END, f, f.ver)
        elif not f.level and share > pace:
            behind = max(f.left - self._left(up), 0.0)
            self.at(self.now + behind / (share - pace), CAUGHT, f, f.ver)
        if changed:
            for g in f.followers:
                self._apply(g, g.share)

    def _reshare(self, src: int, dst: int) -> None:
        if self.cpu is not None:
            self._reshare_all()
            return
        for flows in (self.up_flows[src], self.down_flows[dst]):
            for f in flows:
                self._apply(f, self.rate(f))

    def _reshare_all(self) -> None:
        """Every flow's rate and every boot's CPU, with the host's CPU shared (see above)."""
        assert self.cpu is not None
        cpu, nodes = self.cpu, len(self.down)
        self.cpu_used += self._cores_used * (self.now - self._cpu_stamp)
        self._cpu_stamp = self.now
        recv, sent = (cpu.recv + cpu.hash) / MiB, cpu.sent / MiB
        link = {f: self.rate(f) for flows in self.down_flows for f in flows}
        demand = list(self.background)
        for f, r in link.items():
            up = f.upstream  # a flow level with its upstream goes no faster than it
            want = min(r, link.get(up, 0.0)) if up is not None and f.level else r
            demand[f.dst] += want * recv
            if f.src < nodes:
                demand[f.src] += want * sent
        for i in self.booting:
            demand[i] += cpu.node_cores
        alloc = share(demand, cpu.cores, cpu.node_cores)
        self._cores_used = sum(alloc)
        # short of CPU, a node slows all its work alike, its polls and timers as its reads
        slow = [min(1.0, a / d) if d > 0 else 1.0 for a, d in zip(alloc, demand, strict=True)]
        slow.append(1.0)  # the store
        for f, r in link.items():  # a follower before its upstream is re-rated with it
            self._apply(f, r * min(slow[f.src], slow[f.dst]))
        for i, b in self.booting.items():
            b.left -= b.rate * (self.now - b.stamp)
            b.rate, b.stamp, b.ver = alloc[i], self.now, b.ver + 1
            if b.rate > 0:
                self.at(self.now + max(b.left, 0.0) / b.rate, BOOTED, i, b.ver)
