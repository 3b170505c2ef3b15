"""Swarm simulator: N nodes fetch a model's blobs through `weightcache.swarm.choice.choose`.

    python benchmarks/swarmsim.py [--nodes 8,16] [--size 256M] [--piece 4M] [--link 400M]
                                  [--store-rate 1x,4x] [--rtt 0.001] [--refresh 0.5]
                                  [--startup 0] [--jitter 0] [--view 16] [--dead 0] [--seed 1]
                                  [--json out.json] [--cores 2 --cpu-per-mib-recv 0.005 ...]
                                  [--calibration cal.json] [--pipeline 1,2] [--seeds 5]
                                  [--model-bytes 269161025] [--cut-through on,off]

A discrete-event simulation of the piece and source choice past what this machine can run.
Every node calls the exact pure function the daemons use, with what a daemon's download of
a blob (weightcache/swarm/download.py, `SwarmDownload`) would know and when:
- *Blobs one after another* (`Params.blobs`, as `fetch/blobs.py` brings them; the command
  line simulates one blob of `--size`), each in pieces of `--piece` or, with 0, of the
  daemons' own size (`piece_size_for`: 1 MiB for a 64 MiB shard, 256 KiB for a small file).
  A node's download of a blob starts with a HEAD round to its peers (one RTT) before its
  first choice. Its swarm is the peers that advertise the blob: those on it (bitmaps of the
  pieces held, in flight, and in flight from the store: those it passes on as they arrive,
  cut-through) or past it (all held), and those it saw swarming the revision's earlier
  blobs (`fetch.blobs.SwarmMembers`: they come to this one too, so the first node at a
  blob takes only its stripe from the store, not the whole blob); a joining node's HEAD
  makes it a member at once (`PeerViews.joined`).
  *Two blobs at once* (`--pipeline 2`, the default, as fetch/blobs.py does): a node starts
  its next blob as soon as every piece of its current one is held or asked for, here or
  by a peer in view (all claimed), so that neither the store nor its link idles while the
  last pieces come; it starts a third only when the first is complete. `--pipeline 1`:
  one at a time.
  `--model-bytes` simulates benchmarks/swarm.py's model (its blobs in the daemons' order).
- *Views* are refreshed by HEAD rounds every `--refresh` seconds from the blob's start (0.5:
  the daemons' VIEW_EVERY), skipping peers that answered a piece request within a round,
  and by every answer to a piece request (its headers advertise too). An idle node waits
  for the next round or answer, as the daemon's loop does; after IDLE_GRACE idle it asks
  the store regardless of its room (not for pieces someone in view holds or fetches; with a
  partial view only for those of `views.idle_scope`: its stripe, orphaned stripes,
  late pieces).
- *The store's room and window* as the daemon measures them, after each piece from the
  store, fresh for each blob: room if that request ran ROOM_FACTOR times as fast as the
  peers' requests (EWMA; streamed pieces included), or, no peer piece yet, if alone for
  ALONE_GRACE; the window follows with `next_window`. The link is spare with nothing in
  flight or while receiving less than SPARE of the best rate seen for the blob.
A node watches at most `--view` peers (the daemons' `--peer-view`): a random sample, whose
members that do not advertise the blob for MEMBER_TTL are replaced (found gone: their
stripes orphaned) and one of which, not serving it pieces, is rotated each round, as
`views.watch` does for the daemons; rarity is then local, as in BitTorrent, and its
stripe is among all N nodes. `--dead` members (a random few) never start.
A peer's claim expires as the daemons' do (`views.Claims`, `pace.claim_wait`):
its piece is the store's again.
Not modelled: the daemon's 0.1 s loop tick (a node chooses at each event), a HEAD's
RTT (the round's answers are its peers' state at the round), failures (but `--dead`),
a request to a peer given up (too slow, or its claim expired).

The network (benchmarks/swarmnet.py): every node has an uplink and a downlink (`--link`,
the same both ways; times `--efficiency`, the payload share of a shaped link: 0.95 for
TCP/IPv4 at MTU 1500), the store an egress (`--store-rate`, bits/s, or `Nx` for N times a
node's link); fair share per link. A request's bytes start one `--rtt` after it is made.
A peer's piece that it still receives from the store (asked of it because it advertised
it streaming, `--cut-through on`, the default) comes no faster than the store's bytes reach
that peer (swarmnet.py: the two flows are coupled); `--cut-through off`: peers advertise
and serve held pieces only, as before (both: side by side).
Nothing fails (`--dead` members never start). Every node's daemon starts `--startup`
seconds after t = 0 plus a uniform share of `--jitter`; ready times count from t = 0, as
the benchmark's do.

The CPU (swarmnet.py, off by default: a real cluster has a node's cores per node): with
`--cores` and the costs (`--cpu-per-mib-recv`, `-sent`, `-hash`, `--cpu-busy`, `--cpu-poll`,
`--cpu-per-probe`, `--cpu-startup`, as benchmarks/swarmcal.py measures them), all nodes
share the host's cores, and a node's progress is the smaller of its links' and its CPU
share's; its start-up is CPU work too. Without it, the measured daemons' start-up goes in
`--startup 2 --jitter 2`.

Compared with, per N (closed forms of the same fluid model, all nodes starting at once,
`--startup` after t = 0):
- *peers off*: every node streams the blob from the store; the store's egress is shared
  equally, each node capped by its link and its equal share of the CPU;
- *today*: one node streams from the store, the others each stream a contiguous prefix from
  it (design §8 before the swarm), sharing its uplink and never passing its progress;
- *line*: one link's time for the blob (wire rate); *bound*: the larger of that and the
  store's time for one copy, below which no schedule can go.

Pieces may be coarse (e.g. 1 GiB for 140 GB on 1,000 nodes), which keeps a run to minutes;
the cost grows with nodes x pieces x requests in flight per node.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import measure as ms
from benchlib import parse_size
from swarmnet import (  # the setting and closed forms live with the model; used from here
    BEGIN,
    BOOTED,
    CAUGHT,
    END,
    JOIN,
    POLL,
    REFRESH,
    START,
    Cpu,
    Flow,
    MiB,
    Network,
    Outcome,
    Params,
    Usage,
    add_cpu_options,
    bound,
    cpu_from_args,
    fmt_bits,
    line,
    parse_bits,
    peers_off,
    store_rates,
    today,
)

from weightcache.config import DEFAULT_PEER_VIEW
from weightcache.swarm.choice import (
    ORIGIN,
    Local,
    PeerView,
    RequestLimits,
    StoreView,
    choose,
    next_window,
)
from weightcache.swarm.chooser import IDLE_GRACE
from weightcache.swarm.pace import claim_wait
from weightcache.swarm.pieces import Bitmap, piece_count
from weightcache.swarm.storegate import ALONE_GRACE, ROOM_FACTOR
from weightcache.swarm.views import (
    GONE_SECONDS,
    MEMBER_TTL,
    ROTATE,
    Claims,
    Late,
    idle_requests,
    idle_scope,
    in_view,
    orphaned,
    unclaim,
    watch,
)

__all__ = ["Cpu", "Flow", "MiB", "Network", "Outcome", "Params", "Swarm", "bound", "fmt_bits",
           "line", "parse_bits", "peers_off", "run", "store_rates", "today"]  # fmt: skip

#: The daemon's rules (weightcache/swarm/chooser.py, `Chooser.choose`): its link is
#: spare while it receives less than this share of the best rate it has seen for the blob.
SPARE = 0.6


@dataclass
class Node:
    """One daemon: which blob it swarms (`blob`; all done when ready), and the state its
    `SwarmDownload` for that blob keeps (reset at each blob)."""

    blob: int = 0
    joined: bool = False  # the blob's first HEAD round has answered
    have: int = 0
    fetching: int = 0  # pieces in flight, as advertised
    inflight: dict[int, list[Flow]] = field(default_factory=dict)
    started: bool = False
    ready: float | None = None
    view: dict[int, PeerView] = field(default_factory=dict)  # members only (they advertise)
    answered: dict[int, float] = field(default_factory=dict)  # last piece answer, by peer
    fresh: dict[int, float] = field(default_factory=dict)  # ... not a streamed piece's
    store: StoreView = field(default_factory=StoreView)
    per_request: dict[str, float] = field(default_factory=dict)  # bytes/s by kind (EWMA)
    best: float = 0.0  # the best rate received, this blob
    began: float = 0.0  # when this blob's download began
    idle_since: float = 0.0
    watches: list[int] = field(default_factory=list)
    watched_at: dict[int, float] = field(default_factory=dict)  # since when, by peer
    advertised: dict[int, float] = field(default_factory=dict)  # last advertisement, by peer
    gone: dict[int, float] = field(default_factory=dict)  # watched peer found gone -> until
    late: Late = field(default_factory=lambda: Late(0.0, 0))
    claims: Claims = field(default_factory=Claims)  # the peers' claims, for their expiry
    expired: dict[str, int] = field(default_factory=dict)  # ... those expired, by peer
    seen: set[int] = field(default_factory=set)  # peers seen swarming the revision


class Swarm:
    """One run of `choose` on every node of `p`, blob after blob (module docstring)."""

    def __init__(self, p: Params, trace: float = 0.0) -> None:
        self.p = p
        self.blobs = p.layout()
        self.counts = [piece_count(size, piece) for size, piece in self.blobs]
        self.rng = random.Random(p.seed)
        link = p.link * p.efficiency / 8
        self.store = p.nodes
        store = p.store_rate * p.efficiency / 8
        self.net = Network([link] * p.nodes + [store], [link] * p.nodes, p.cpu)
        self.nodes = [Node() for _ in range(p.nodes)]
        # a node's next blob while it finishes the one in `nodes` (`Params.pipeline`): its
        # events and flows are handled with the two swapped (`_as`)
        self.ahead: list[Node | None] = [None] * p.nodes
        self.store_bytes = 0.0
        # requests for a piece their peer streamed (not held, as last heard) when made
        self.streamed: set[Flow] = set()
        self.usage = Usage(self.net, trace) if trace else None  # `--trace`
        self.dead = set(self.rng.sample(range(p.nodes), p.dead))
        for i, node in enumerate(self.nodes):
            others = [j for j in range(p.nodes) if j != i]
            node.watches = watch(others, [], (), p.view, self.rng)
            start = p.startup + self.rng.uniform(0, p.jitter)
            if i not in self.dead:
                self.net.at(start, START, i)

    def run(self) -> Outcome:
        net, nodes = self.net, self.nodes
        horizon = 4 * peers_off(self.p).last + self.p.jitter + 10 * self.p.refresh
        while net.events and net.now <= horizon:  # a stalled node is reported as never ready
            when, _, kind, obj, ver = heapq.heappop(net.events)
            if self.usage is not None:
                self.usage.until(when)
            net.now = when
            if kind == END and isinstance(obj, Flow) and obj.ver == ver and obj.active:
                with self._as(obj.dst, self._owner(obj)):
                    self._arrived(obj)
            elif kind == BEGIN and isinstance(obj, Flow) and obj.ver == ver:
                dl = self._owner(obj)
                net.start(obj, self._upstream(obj, dl))
                with self._as(obj.dst, dl):
                    self._answered(obj.dst, obj.src, obj not in self.streamed)
            elif kind == CAUGHT and isinstance(obj, Flow):
                net.caught(obj, ver)  # a rate changes, nothing the policy sees
                continue
            elif kind in (START, BOOTED) and isinstance(obj, int):
                self._start(obj, kind, ver)
            elif not isinstance(obj, int) or (dl := self._download(obj, ver)) is None:
                continue  # an event of a blob this node is done with
            else:
                with self._as(obj, dl):
                    self._node_event(kind, obj, ver)
            self._pipeline(obj.dst if isinstance(obj, Flow) else obj)
        ready = [n.ready if n.ready is not None else float("inf")
                 for i, n in enumerate(nodes) if i not in self.dead]  # fmt: skip
        return Outcome(max(ready), statistics.median(ready), self.store_bytes / self.p.size, ready,
                       net.cpu_used)  # fmt: skip

    def _node_event(self, kind: int, i: int, blob: int) -> None:
        if kind == JOIN:
            self._join(i)
        elif kind == REFRESH:
            self._refresh(i)
            self._decide(i)
            self.net.at(self.net.now + self.p.refresh, REFRESH, i, blob)
        elif kind == POLL:
            self._decide(i)

    # -- two blobs at once (`Params.pipeline`) ------------------------------------------------

    def _download(self, i: int, blob: int) -> Node | None:
        """Node `i`'s download of `blob` while it has pieces missing, else None."""
        for dl in (self.nodes[i], self.ahead[i]):
            if dl is not None and dl.blob == blob and dl.ready is None and not self._complete(dl):
                return dl
        return None

    def _complete(self, dl: Node) -> bool:
        return dl.blob < len(self.blobs) and dl.have == (1 << self.counts[dl.blob]) - 1

    def _owner(self, f: Flow) -> Node | None:
        """The download (of node `f.dst`) whose request `f` is."""
        for dl in (self.nodes[f.dst], self.ahead[f.dst]):
            if dl is not None and any(g is f for g in dl.inflight.get(f.piece, ())):
                return dl
        return None

    def _upstream(self, f: Flow, dl: Node | None) -> Flow | None:
        """The store's flow of `f`'s piece to the peer `f` is asked of, if that peer does
        not hold the piece yet: `f` passes its bytes on as they arrive (cut-through). The
        peer advertised the piece as held or streamed, and either stays so until it holds
        it (nothing fails here), so one of the two is true."""
        if f.src == self.store or dl is None:
            return None
        peer = self._holding(f.src, dl.blob)
        if peer.blob != dl.blob or peer.have >> f.piece & 1:
            return None
        up = next((g for g in peer.inflight.get(f.piece, ()) if g.src == self.store), None)
        assert up is not None, f"node {f.src} neither holds nor streams piece {f.piece}"
        return up

    def _streaming(self, dl: Node | None, count: int) -> Bitmap | None:
        """What a peer advertises it streams (`PeerView.streaming`): the pieces its download
        `dl` has in flight from the store (none for None: past the blob, or no state yet);
        with `Params.cut_through` off, no advertisement."""
        if not self.p.cut_through:
            return None
        bits = 0
        for k, flows in dl.inflight.items() if dl is not None else ():
            if any(g.src == self.store for g in flows):
                bits |= 1 << k
        return Bitmap(count, bits)

    def _holding(self, j: int, blob: int) -> Node:
        """Node `j`'s download of `blob` if it has one, else its earliest (which tells
        whether `j` is before or past `blob`)."""
        dls = [dl for dl in (self.nodes[j], self.ahead[j]) if dl is not None]
        return next((dl for dl in dls if dl.blob == blob), min(dls, key=lambda dl: dl.blob))

    @contextlib.contextmanager
    def _as(self, i: int, dl: Node | None) -> Iterator[None]:
        """Handle an event of node `i`'s download `dl` with it in `nodes[i]`, where every
        method looks (the other one in `ahead[i]` meanwhile)."""
        current = self.nodes[i]
        if dl is None or dl is current:
            yield
            return
        self.nodes[i], self.ahead[i] = dl, current
        try:
            yield
        finally:
            self.nodes[i], self.ahead[i] = current, dl

    def _pipeline(self, i: int) -> None:
        """Start node `i`'s next blob if every piece of its current one is held or asked
        for, here or by a peer in view (`SwarmDownload`'s `all_claimed`), it has no other
        in progress, and `Params.pipeline` allows two."""
        node = self.nodes[i]
        if self.p.pipeline < 2 or self.ahead[i] is not None or node.ready is not None:
            return
        if not node.started or not node.joined or node.blob + 1 >= len(self.blobs):
            return
        claimed, _ = in_view(self._views(node))
        if ((1 << self.counts[node.blob]) - 1) & ~(node.have | node.fetching | claimed):
            return
        ahead = Node(node.blob + 1, started=True, watches=node.watches, seen=node.seen)
        self.ahead[i] = ahead
        with self._as(i, ahead):
            self._next_blob(i)

    def _done(self, i: int) -> None:
        """`nodes[i]`'s blob is complete: the next one in progress (if any) becomes node
        `i`'s current, or its next blob starts; a next blob done before its current one
        waits for it."""
        node, other = self.nodes[i], self.ahead[i]
        if other is not None and other.blob < node.blob:
            return
        if other is None:
            node.blob += 1
            self._next_blob(i)
            return
        self.nodes[i], self.ahead[i] = other, None
        if self._complete(other):
            self._done(i)

    def _start(self, i: int, kind: int, ver: int) -> None:
        """Node `i`'s daemon spawned (START) or finished its start-up CPU (BOOTED)."""
        if kind == START and self.p.cpu.startup > 0:
            self.net.boot(i, self.p.cpu.startup)  # a BOOTED event when done
            return
        if kind == BOOTED and not self.net.booted(i, ver):
            return  # a stale event: the boot's rate changed since
        self.nodes[i].started = True
        self._next_blob(i)

    def _next_blob(self, i: int) -> None:
        """Start node `i`'s download of its next blob: a fresh `SwarmDownload`, whose first
        HEAD round (one RTT) comes before its first choice; or, all done, ready."""
        node, now = self.nodes[i], self.net.now
        if node.blob == len(self.blobs):
            node.ready = now
            self._background(i)
            return
        node.joined, node.have, node.fetching, node.view = False, 0, 0, {}
        node.store, node.per_request, node.best = StoreView(), {}, 0.0
        node.began = node.idle_since = now
        node.late, node.advertised = Late(now, self.counts[node.blob]), {}
        node.claims, node.expired = Claims(), {}
        node.watched_at = dict.fromkeys(node.watches, now)
        self.net.at(now + self.p.rtt, JOIN, i, node.blob)
        self.net.at(now + self.p.refresh, REFRESH, i, node.blob)
        self._background(i)

    def _join(self, i: int) -> None:
        """The blob's first HEAD round answered: the members' views; each member that
        swarms the blob counts node `i` in from now on (`PeerViews.joined`)."""
        node = self.nodes[i]
        node.joined = True
        for j in node.watches:
            self._look(i, j)
            peer = self._holding(j, node.blob)
            if peer.blob == node.blob and peer.ready is None and i in peer.watches:
                count = self.counts[node.blob]
                empty, streaming = Bitmap(count), self._streaming(None, count)
                peer.view.setdefault(i, PeerView(str(i), empty, empty, 0, streaming))
        self._decide(i)

    def _look(self, i: int, j: int) -> None:
        """Node `i` hears from peer `j` about its blob: `j`'s bitmaps (all held when it is
        past the blob), or, not serving yet or on an earlier blob, no advertisement; those it
        streams from the store as of now, as the others."""
        node = self.nodes[i]
        b, count = node.blob, self.counts[node.blob]
        peer = self._holding(j, b)
        load = len(self.net.up_flows[j])
        if not peer.started or peer.blob < b:
            node.view.pop(j, None)
        elif peer.blob > b:
            full, none = Bitmap.full(count), Bitmap(count)
            node.view[j] = PeerView(str(j), full, none, load, self._streaming(None, count))
        else:
            have, fetching = Bitmap(count, peer.have), Bitmap(count, peer.fetching)
            node.view[j] = PeerView(str(j), have, fetching, load, self._streaming(peer, count))
        if j in node.view:
            node.advertised[j] = self.net.now

    def _answered(self, i: int, j: int, fresh: bool = True) -> None:
        """A piece request's answer from `j` reached `i`: it advertises, as HEADs do, and
        spares `j` the next HEAD round unless it is the start of a streamed piece (`fresh`
        False), which lasts as long as the store's flow: its advertisement would go stale."""
        if j != self.store and self.nodes[i].ready is None:
            self._look(i, j)
            self.nodes[i].answered[j] = self.net.now
            if fresh:
                self.nodes[i].fresh[j] = self.net.now
            self._decide(i)

    def _background(self, i: int) -> None:
        """Node `i`'s CPU besides its flows while it downloads: the benchmark's polls, and
        for each of its downloads (two while blobs overlap: each runs its own loop and view
        rounds) busy and a view round's HEADs to the peers it watches that did not answer it
        a piece request lately."""
        cpu, now = self.p.cpu, self.net.now
        loops = [dl for dl in (self.nodes[i], self.ahead[i]) if dl is not None and dl.ready is None]
        if len(loops) == 2:  # a blob complete ahead of the other has ended its loop
            loops = [dl for dl in loops if not self._complete(dl)] or loops[:1]
        if not loops:
            self.net.set_background(i, 0.0)
            return
        heads = sum(1 for dl in loops for j in dl.watches
                    if now - dl.fresh.get(j, -1e9) >= self.p.refresh)  # fmt: skip
        cores = cpu.poll + cpu.busy * len(loops) + cpu.probe * heads / self.p.refresh
        self.net.set_background(i, cores)

    def _refresh(self, i: int) -> None:
        """A HEAD round: every watched peer but those that answered a piece request within
        the last round, after replacing those gone (`PeerViews.refresh`)."""
        node, now = self.nodes[i], self.net.now
        self._rewatch(node, i, now)
        for j in node.watches:
            if now - node.fresh.get(j, -1e9) >= self.p.refresh:
                self._look(i, j)
        self._background(i)

    def _rewatch(self, node: Node, i: int, now: float) -> None:
        """`PeerViews._rewatch`: past the bound, a watched peer that has not advertised the
        blob for MEMBER_TTL is gone (dead, or not on this blob yet), replaced by another."""
        if len(node.watches) >= self.p.nodes - 1:
            return
        for j in node.watches:
            if now - max(node.advertised.get(j, -1e9), node.watched_at.get(j, now)) >= MEMBER_TTL:
                node.gone[j] = now + GONE_SECONDS
        node.gone = {j: t for j, t in node.gone.items() if t > now}
        others = [j for j in range(self.p.nodes) if j != i]
        busy = {j for j, t in node.answered.items() if now - t < self.p.refresh}
        busy |= {j for j, t in node.watched_at.items() if now - t < MEMBER_TTL}
        node.watches = watch(others, node.watches, node.gone.keys(), self.p.view, self.rng,
                             ROTATE, busy)  # fmt: skip
        node.watched_at = {j: node.watched_at.get(j, now) for j in node.watches}
        for j in list(node.view):
            if j not in node.watched_at:
                del node.view[j]

    def _decide(self, i: int) -> None:
        """`Chooser.choose`: the policy on the node's view, then the store regardless
        of its room after IDLE_GRACE idle (not for pieces someone in view claims)."""
        node, now = self.nodes[i], self.net.now
        if node.ready is not None or not node.joined:
            return
        count = self.counts[node.blob]
        # the daemons' membership: the peers advertising the blob and those seen swarming the
        # revision's earlier blobs (`SwarmMembers`); a node watching only some
        # of them stripes among all nodes instead (as by discovery's list), or each group in
        # view would take the whole blob from the store (23 copies at 1,000 nodes, view 32)
        partial = len(node.watches) < self.p.nodes - 1
        node.seen |= node.view.keys()  # no node dies here: no MEMBER_TTL to apply
        members = range(self.p.nodes) if partial else sorted(node.seen | {i})
        inflow = self.net.inflow(i)
        node.best = max(node.best, inflow)
        local = Local(
            Bitmap(count, node.have),
            {k: frozenset(self._source(f) for f in fs) for k, fs in node.inflight.items()},
            rank=members.index(i),
            nodes=len(members),
            spare=not node.inflight or inflow < SPARE * node.best,
        )
        self._expire(node)
        views, limits = self._views(node), self.p.limits
        claimed, held = in_view(views)
        node.late.saw(claimed | node.have | node.fetching, held | node.have, now)
        requests = choose(local, views, node.store, limits, self.rng)
        if requests or node.inflight:
            node.idle_since = now
        elif (
            now >= node.idle_since + IDLE_GRACE
        ):  # as the POLL below is scheduled: no rounding loop
            orphans = orphaned(members, node.gone.keys(), count) if partial else 0
            scope = idle_scope(
                partial, local, orphans, node.late.late(now, local.rank, local.nodes)
            )
            requests = idle_requests(local, views, node.store, limits, self.rng, scope)
        else:  # the daemon's loop looks again every TICK: at the grace's end at the latest
            self.net.at(node.idle_since + IDLE_GRACE, POLL, i, node.blob)
        size, piece = self.blobs[node.blob]
        for r in requests:
            src = self.store if r.source == ORIGIN else int(r.source)
            start, end = r.piece * piece, min((r.piece + 1) * piece, size)
            f = Flow(src, i, r.piece, end - start, now)
            if src != self.store and not node.view[src].have.bits >> r.piece & 1:
                self.streamed.add(f)
            node.inflight.setdefault(r.piece, []).append(f)
            node.fetching |= 1 << r.piece
            self.net.at(now + self.p.rtt, BEGIN, f, f.ver)

    def _expire(self, node: Node) -> None:
        """`Chooser._unclaimed`: the peers' claims older than `claim_wait` (a store
        piece's time here: its measured pace, or its oldest request's age) expire. Nothing
        fails here: a claim expires only when the store is that much slower for its
        claimant."""
        now = self.net.now
        node.claims.saw(list(node.view.values()), now)
        oldest = min((f.made for fs in node.inflight.values() for f in fs if f.src == self.store),
                     default=now)  # fmt: skip
        piece = self.blobs[node.blob][1]
        wait = claim_wait(piece, node.per_request.get("origin"), now - oldest)
        node.expired = node.claims.expired(now, wait)

    def _views(self, node: Node) -> list[PeerView]:
        """The node's views of its peers without their expired claims."""
        return unclaim(list(node.view.values()), node.expired)

    def _source(self, f: Flow) -> str:
        return ORIGIN if f.src == self.store else str(f.src)

    def _measure(self, node: Node, f: Flow) -> None:
        """`SwarmDownload._measure` after a piece: the per-request rates (EWMA), and after
        one from the store its room (ROOM_FACTOR times a peer request's rate, or alone for
        ALONE_GRACE) and window. A piece a peer streamed counts as a peer's: measured
        without it, a node whose downlink is full of streams judged the store by its few
        held pieces, slow for sharing that downlink, saw room, and asked the store for
        pieces others claimed (1.24 store copies for config.json and four 16 MiB shards at
        8 nodes against 1.11 counting them)."""
        kind = "origin" if f.src == self.store else "peer"
        rate = f.size / max(1e-3, self.net.now - f.made)
        old = node.per_request.get(kind)
        node.per_request[kind] = rate if old is None else old + 0.3 * (rate - old)
        if kind != "origin":
            return
        peer = node.per_request.get("peer")
        alone = not node.view and self.net.now - node.began >= ALONE_GRACE
        room = rate >= ROOM_FACTOR * peer if peer is not None else alone
        window = next_window(node.store.window, room, self.p.limits)
        lag = 2 * self.p.refresh  # views.VIEW_LAG at the daemons' VIEW_EVERY
        ahead = math.ceil(lag * node.per_request["origin"] * window / self.blobs[node.blob][1])
        node.store = StoreView(room, window, ahead)

    def _arrived(self, f: Flow) -> None:
        node = self.nodes[f.dst]
        for g in node.inflight.pop(f.piece):
            sent = self.net.stop(g)  # a request still on its way is dropped: nothing sent
            self.streamed.discard(g)
            if g.src == self.store:
                self.store_bytes += sent
        self._measure(node, f)
        node.have |= 1 << f.piece
        node.fetching &= ~(1 << f.piece)
        if node.have == (1 << self.counts[node.blob]) - 1:
            self._done(f.dst)
        else:
            self._decide(f.dst)


def run(p: Params, seeds: int = 1, trace: float = 0.0) -> dict[str, object]:
    """The swarm and its comparisons for one setting, as a table row's worth of numbers:
    with `seeds` > 1, the median of runs with seeds `p.seed` onwards (the last node's, the
    p50's and the store's, each on its own); with `trace`, the links' use over time in the
    first run (`Usage`: bins of `trace` seconds)."""
    began = time.perf_counter()
    swarms = [Swarm(replace(p, seed=p.seed + k), trace if k == 0 else 0.0) for k in range(seeds)]
    runs = [s.run() for s in swarms]
    swarm = sorted(runs, key=lambda o: o.last)[len(runs) // 2]
    swarm = replace(swarm, p50=statistics.median(o.p50 for o in runs),
                    store_copies=statistics.median(o.store_copies for o in runs))  # fmt: skip
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
        "trace": swarms[0].usage.rows() if swarms[0].usage else [],
    }


# -- command line ---------------------------------------------------------------------------

HEADERS = (
    "nodes", "store egress", "pieces", "blobs at once", "cut-through", "swarm last s",
    "swarm p50 s", "store x model", "last / line", "p50 / line", "peers off last s",
    "peers off store x", "today last s", "today p50 s", "line s", "bound s", "sim s",
)  # fmt: skip


def row(r: dict[str, object]) -> list[object]:
    p, s, off, now = (r[k] for k in ("params", "swarm", "peers_off", "today"))
    assert isinstance(p, dict) and isinstance(s, dict)
    assert isinstance(off, dict) and isinstance(now, dict)
    ln, bd = float(str(r["line"])), float(str(r["bound"]))
    return [
        p["nodes"], fmt_bits(p["store_rate"]), sum(piece_count(*b) for b in Params(**{**p,
            "limits": RequestLimits(), "cpu": Cpu()}).layout()), p["pipeline"],
        "on" if p["cut_through"] else "off",
        f"{s['last']:.1f}", f"{s['p50']:.1f}", f"{s['store_copies']:.2f}",
        f"{s['last'] / ln:.2f}", f"{s['p50'] / ln:.2f}", f"{off['last']:.1f}",
        f"{off['store_copies']:.0f}",
        f"{now['last']:.1f}", f"{now['p50']:.1f}", f"{ln:.1f}", f"{bd:.1f}",
        f"{float(str(r['sim_seconds'])):.1f}",
    ]  # fmt: skip


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
    ap.add_argument(
        "--view", default=DEFAULT_PEER_VIEW, type=int, help="peers a node watches at most"
    )
    ap.add_argument("--dead", default=0, type=int, help="members that never start")
    ap.add_argument("--efficiency", default=0.95, type=float, help="payload share of a link")
    ap.add_argument("--per-peer", default=RequestLimits.per_peer, type=int)
    ap.add_argument("--fill", default=RequestLimits.fill, type=int)
    ap.add_argument("--per-origin", default=RequestLimits.per_origin, type=int)
    ap.add_argument("--claims", default=RequestLimits.claims, type=int)
    ap.add_argument("--total", default=RequestLimits.total, type=int)
    ap.add_argument("--endgame", default=RequestLimits.endgame, type=int)
    ap.add_argument("--seed", default=1, type=int)
    ap.add_argument("--seeds", default=1, type=int, help="runs per setting (seed onwards), medians")
    ap.add_argument("--pipeline", default=str(Params.pipeline),
                    help="blobs a node brings at once at most, comma-separated: 1,2")  # fmt: skip
    ap.add_argument("--model-bytes", type=int, default=0,
                    help="simulate benchmarks/swarm.py's model: --size in 4 shards and its small "
                    "files, this many bytes in all (its JSON's model_bytes)")  # fmt: skip
    ap.add_argument("--cut-through", default="on",
                    help="peers pass on the store's pieces as they arrive: on, off or on,off "
                    "(each, side by side)")  # fmt: skip
    ap.add_argument("--calibration", type=Path, help="the CPU model from swarmcal.py --json")
    ap.add_argument("--json", type=Path, help="write every run's numbers here")
    ap.add_argument("--trace", type=float, default=0.0, metavar="SECONDS",
                    help="also print how full the links were, in bins of this many seconds "
                    "(the first seed of each setting)")  # fmt: skip
    add_cpu_options(ap)
    a = ap.parse_args(argv)
    limits = RequestLimits(
        per_peer=a.per_peer,
        fill=a.fill,
        per_origin=a.per_origin,
        claims=a.claims,
        total=a.total,
        endgame=a.endgame,
    )
    cpu = cpu_from_args(a)
    if a.calibration:
        cpu = Cpu(**json.loads(a.calibration.read_text())["cpu"])
    size, blobs = parse_size(a.size), ()
    if a.model_bytes:
        from swarmplot import model_blobs  # it imports this module

        size, blobs = a.model_bytes, model_blobs(size, a.model_bytes)
    modes = {"on": True, "off": False}
    if not set(cuts := a.cut_through.split(",")) <= modes.keys():
        ap.error(f"--cut-through: on, off or on,off, not {a.cut_through!r}")
    results = []
    for n in (int(x) for x in a.nodes.split(",")):
        for store in store_rates(a.store_rate, a.link):
            for depth, cut in ((int(x), c) for x in a.pipeline.split(",") for c in cuts):
                p = Params(
                    n, size, parse_size(a.piece), a.link, store, a.rtt, a.refresh, a.jitter,
                    a.startup, a.view, a.efficiency, a.seed, limits, cpu, blobs, depth,
                    dead=a.dead, cut_through=modes[cut],
                )  # fmt: skip
                results.append(run(p, a.seeds, a.trace))
                print(f"N={n} store {fmt_bits(store)} pipeline {depth} cut-through {cut}: done",
                      file=sys.stderr, flush=True)  # fmt: skip
    print(f"size {a.size}, piece {a.piece}, link {fmt_bits(a.link)}, rtt {a.rtt} s, refresh "
          f"{a.refresh} s, startup {a.startup} s, jitter {a.jitter} s, view {a.view}, "
          f"dead {a.dead}, efficiency {a.efficiency}, {limits}, seed {a.seed}; CPU: "
          f"{cpu.describe() if cpu.on else 'not modelled'}\n")  # fmt: skip
    print(ms.md_table(HEADERS, [row(r) for r in results]))
    for r, values in ((r, row(r)) for r in results if r["trace"]):
        print(f"\nN = {values[0]}, store {values[1]}, seed {a.seed}: the links' use\n")
        print(ms.md_table(("from s", "nodes' downlinks", "store's egress"), r["trace"]))
    if a.json:
        ms.write_json(a.json, {"argv": sys.argv, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
