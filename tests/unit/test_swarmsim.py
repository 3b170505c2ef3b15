"""benchmarks/swarmsim.py: the fair-share arithmetic and small runs with known answers."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import swarmsim as sim
from swarmnet import CAUGHT, Cpu

MiB = 1 << 20


def test_a_flow_gets_the_smaller_of_its_two_links_fair_shares() -> None:
    # nodes 0 and 1 (100 B/s each way), the store (index 2) with 300 B/s of egress
    net = sim.Network([100.0, 100.0, 300.0], [100.0, 100.0])
    a, b, c = sim.Flow(2, 0, 0, 1000), sim.Flow(2, 1, 0, 1000), sim.Flow(1, 0, 1, 1000)
    for f in (a, b, c):
        net.start(f)
    assert (a.rate, b.rate, c.rate) == (50.0, 100.0, 50.0)  # 0's downlink is shared by a, c
    assert net.inflow(0) == 100.0 and net.inflow(1) == 100.0
    net.now = 4.0
    assert net.stop(c) == pytest.approx(200.0)  # 4 s at 50 B/s
    assert a.rate == 100.0  # 0's downlink is a's alone now; the store has 150 for it
    net.now = 5.0
    assert net.sent_by(2) == pytest.approx(4 * 150 + 1 * 200)
    assert net.stop(a) == pytest.approx(4 * 50 + 1 * 100)


def test_a_flow_s_end_is_rescheduled_when_its_share_changes() -> None:
    net = sim.Network([100.0, 100.0], [100.0])  # node 0 downloads from the store (1)
    f, g = sim.Flow(1, 0, 0, 400), sim.Flow(1, 0, 1, 100)
    net.start(f)
    net.start(g)
    ends = {}
    while net.events:
        net.now, _, kind, flow, ver = sim.heapq.heappop(net.events)
        if kind == sim.END and flow.ver == ver and flow.active:
            ends[flow.piece] = net.now
            net.stop(flow)
    # both at 50 B/s until g ends at 2 s, then f alone at 100 B/s for its last 300 B
    assert ends == {1: pytest.approx(2.0), 0: pytest.approx(5.0)}


def advance(net: sim.Network, until: float, ends: list[tuple[sim.Flow, float]]) -> None:
    """Run `net`'s events up to `until` as swarmsim does (a flow whose END comes is stopped,
    a CAUGHT re-rates its flow); `ends` gets each flow that ended, and when, in order."""
    while net.events and net.events[0][0] <= until:
        net.now, _, kind, flow, ver = sim.heapq.heappop(net.events)
        if kind == sim.END and flow.ver == ver and flow.active:
            ends.append((flow, net.now))
            net.stop(flow)
        elif kind == CAUGHT:
            net.caught(flow, ver)
    net.now = until


@pytest.mark.parametrize("cpu", [None, Cpu(recv=1e-6)], ids=["links", "cpu-model"])
def test_a_piece_passed_on_as_it_arrives_never_ends_before_the_store_s_flow_of_it(
    cpu: Cpu | None,
) -> None:
    # node 0 receives piece 0 from the store (2) at the store's 100 B/s, and from t = 1
    # passes it on to node 1 over links of 1000 B/s (cut-through): node 1 gets at most what
    # node 0 has. 100 B behind, it catches up in 1/9 s, then follows at 100 B/s and ends
    # with the store's flow at 10 s (event order: after it); a CPU model that never binds
    # (`_reshare_all`) changes nothing
    net = sim.Network([1000.0, 1000.0, 100.0], [1000.0, 1000.0], cpu)
    f, g, ends = sim.Flow(2, 0, 0, 1000), sim.Flow(0, 1, 0, 1000), []
    net.start(f)
    advance(net, 1.0, ends)
    net.start(g, upstream=f)
    assert g.rate == 1000.0
    advance(net, 1.1, ends)
    assert g.rate == 1000.0  # still behind
    advance(net, 1.2, ends)
    assert g.rate == pytest.approx(100.0)
    assert net.sent_by(0) == pytest.approx(net.sent_by(2)) == pytest.approx(120.0)  # level
    # the store's egress shared with a flow to node 1 from t = 2: node 0's piece comes at
    # 50 B/s, and so does node 1's copy (its own links would allow 500)
    advance(net, 2.0, ends)
    h = sim.Flow(2, 1, 1, 1000)
    net.start(h)
    assert (f.rate, g.rate, h.rate) == pytest.approx((50.0, 50.0, 50.0))
    advance(net, 100.0, ends)
    # f: 200 B by 2 s, 800 B at 50 B/s: 18 s; h: 800 B by 18 s, then 200 B at 100 B/s
    assert [(e is f, e is g, t) for e, t in ends] == [
        (True, False, pytest.approx(18.0)),
        (False, True, pytest.approx(18.0)),
        (False, False, pytest.approx(20.0)),
    ]


def test_a_piece_passed_on_over_a_slower_link_goes_at_its_own_pace() -> None:
    # node 1's downlink (50 B/s) is slower than the store's flow to node 0 (100 B/s): node
    # 1's copy never catches up and ends 20 s after its start, not with the store's flow
    net = sim.Network([1000.0, 1000.0, 100.0], [1000.0, 50.0])
    f, g, ends = sim.Flow(2, 0, 0, 1000), sim.Flow(0, 1, 0, 1000), []
    net.start(f)
    advance(net, 1.0, ends)
    net.start(g, upstream=f)
    advance(net, 100.0, ends)
    assert [(e is g, t) for e, t in ends] == [(False, 10.0), (True, pytest.approx(21.0))]


def test_a_piece_passed_on_waits_for_the_store_s_first_byte_and_goes_on_once_held() -> None:
    # node 1 asks node 0 for a piece whose request to the store is still on its way: no
    # byte until the store's flow starts (t = 0.5), then at its pace. At 5 s the piece lands
    # at node 0 from elsewhere (its store flow is dropped; swarmsim stops every flow of a
    # piece once one delivers it): node 0 holds it all, node 1's copy goes on at its
    # links' 1000 B/s for the 550 B it lacks
    net = sim.Network([1000.0, 1000.0, 100.0], [1000.0, 1000.0])
    f, g, ends = sim.Flow(2, 0, 0, 1000), sim.Flow(0, 1, 0, 1000), []
    net.start(g, upstream=f)
    assert g.rate == 0.0
    advance(net, 0.5, ends)
    net.start(f)
    assert g.rate == 100.0
    advance(net, 5.0, ends)
    assert net.stop(f) == pytest.approx(450.0)
    advance(net, 100.0, ends)
    assert [(e is g, t) for e, t in ends] == [(True, pytest.approx(5.55))]


def params(nodes: int, store_x: float, **kw: object) -> sim.Params:
    link = 80e6  # 10 MB/s
    return sim.Params(nodes, 64 * MiB, 1 * MiB, link, store_x * link, efficiency=1.0, **kw)  # type: ignore[arg-type]


def test_one_node_alone_runs_at_its_link() -> None:
    out = sim.Swarm(params(1, 1.0)).run()
    assert out.store_copies == pytest.approx(1.0)
    assert out.last == pytest.approx(64 * MiB / 10e6, rel=0.02)


def test_the_trace_shows_the_links_idle_before_the_start_and_full_while_one_node_fetches() -> None:
    # one node, the blob in one piece: one flow from the store, from 3.15 s (two RTTs more)
    # to ~9.9 s; bins of 0.3 s, so that the view rounds (every 0.5 s) end slices inside bins
    swarm = sim.Swarm(replace(params(1, 1.0, startup=3.15), piece=64 * MiB), trace=0.3)
    out = swarm.run()
    assert swarm.usage is not None
    rows = [[float(x) for x in r] for r in swarm.usage.rows()]
    assert [r[0] for r in rows[:3]] == [0.0, 0.0, 1.0]  # the bins' starts, to whole seconds
    assert all(r[1:] == [0.0, 0.0] for r in rows[:10])  # not started
    assert rows[10][1:] == pytest.approx([0.5, 0.5], abs=0.02)  # 3.0-3.3 s: half
    assert all(r[1:] == [1.0, 1.0] for r in rows[11 : int(out.last / 0.3)])


def test_the_daemons_start_up_counts_in_the_ready_time() -> None:
    alone = 64 * MiB / 10e6
    out = sim.Swarm(params(1, 1.0, startup=3.0)).run()
    assert out.last == pytest.approx(3.0 + alone, rel=0.02)
    spread = sim.Swarm(params(4, 4.0, startup=2.0, jitter=2.0)).run()
    assert 2.0 + alone <= min(spread.ready) and max(spread.ready) <= 4.0 + 2 * alone
    late = params(8, 1.0, startup=3.0)
    assert sim.peers_off(late).last == pytest.approx(3.0 + 8 * alone, rel=1e-3)
    assert sim.today(late).last == pytest.approx(3.0 + 7 * alone, rel=1e-3)


def test_a_store_bound_swarm_sends_one_copy_and_beats_the_store_alone() -> None:
    p = params(6, 1.0)
    out, alone = sim.Swarm(p).run(), sim.peers_off(p)
    assert out.store_copies == pytest.approx(1.0, abs=0.05)
    assert out.last < alone.last / 3
    assert out.last >= sim.bound(p)


def test_closed_forms_of_the_comparisons() -> None:
    p = params(8, 1.0)
    line = 64 * MiB * 8 / 80e6
    assert sim.line(p) == pytest.approx(line)
    assert sim.peers_off(p).last == pytest.approx(8 * line, rel=1e-3)
    assert sim.peers_off(params(8, 4.0)).last == pytest.approx(2 * line, rel=1e-3)
    # today: the followers share the first node's uplink, 7 ways
    assert sim.today(p).last == pytest.approx(7 * line, rel=1e-3)
    assert sim.today(p).store_copies == 1.0


@pytest.mark.parametrize(("text", "bits"), [("400M", 400e6), ("25G", 25e9), ("100Gbit", 100e9)])
def test_rates_are_decimal_bits(text: str, bits: float) -> None:
    assert sim.parse_bits(text) == bits
    assert sim.store_rates(f"1x,4x,{text}", 400e6) == [400e6, 1600e6, bits]


def test_the_blobs_of_a_model_are_swarmed_one_after_another_in_the_daemons_pieces() -> None:
    # four shards of 16 MiB one at a time take longer than one blob of 64 MiB: each
    # blob's start (the store's first pieces, the first view round) and its end game come
    # once per blob (pipelined, they overlap: the test below)
    one = sim.Params(4, 64 * MiB, 0, 400e6, 400e6, pipeline=1)
    four = replace(one, blobs=(16 * MiB,) * 4)
    assert one.layout() == [(64 * MiB, 1 * MiB)]  # piece_size_for: 64 pieces of 1 MiB
    assert four.layout() == [(16 * MiB, 512 << 10)] * 4
    single, shards = sim.Swarm(one).run(), sim.Swarm(four).run()
    assert shards.last > 1.15 * single.last
    assert shards.store_copies == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("refresh", [0.5, 0.2])
def test_a_peer_s_piece_is_fetched_once_the_node_hears_of_it_at_its_next_view_round(
    refresh: float,
) -> None:
    # two small files of one piece each: node 1 owns the first (its stripe), fetches it
    # from the store and goes on alone to the second (node 0, still on the first, is not
    # in its swarm), so it takes that from the store too; node 0 learns of node 1's copy
    # at its next HEAD round only, then takes both files from node 1
    p = sim.Params(
        2, 200, 0, 8e9, 8e9, refresh=refresh, efficiency=1.0, blobs=(100, 100), pipeline=1
    )
    out = sim.Swarm(p).run()
    assert out.ready[1] == pytest.approx(4 * p.rtt, abs=1e-4)
    assert out.ready[0] == pytest.approx(refresh + 3 * p.rtt, abs=1e-4)
    assert out.store_copies == pytest.approx(1.0)


def test_an_idle_node_waits_for_its_next_view_round_as_the_daemon_does() -> None:
    # one blob of two pieces, a node's stripe each, both from the store (1 MiB/s shared:
    # both land at 2 s); each node is then idle and learns of the other's piece at its next
    # HEAD round (every 0.3 s: at 2.1 s), not by looking again at once, which the daemon's
    # loop does not do; then 1 s to fetch it from the other (store-and-forward: with
    # cut-through, the test below, each takes the other's piece while it arrives)
    p = sim.Params(2, 2 * MiB, MiB, 8 * MiB, 8 * MiB, refresh=0.3, efficiency=1.0)
    out = sim.Swarm(replace(p, cut_through=False)).run()
    assert out.ready == pytest.approx([2.1 + 1.0 + p.rtt] * 2, abs=1e-6)


def test_a_node_takes_a_peer_s_piece_as_the_store_sends_it_with_cut_through() -> None:
    # the test above, peers advertising what they stream from the store: node 1 chooses
    # after node 0 has asked the store for piece 0 (both at the first HEAD round's answer,
    # 1 ms), sees it streamed and asks node 0 for it at once, level with the store's flow
    # (both at 0.5 MiB/s: its downlink is shared with its own store flow): both land at 2 s
    # + 2 RTTs. Node 0 hears of node 1's stream at its round at 0.3 s; its request starts at
    # 0.301 s, 0.1495 MiB behind node 1's store flow, and stays that far behind until that
    # flow ends, then takes the rest at its whole link (1 MiB/s)
    p = sim.Params(2, 2 * MiB, MiB, 8 * MiB, 8 * MiB, refresh=0.3, efficiency=1.0)
    out = sim.Swarm(p).run()
    behind = (0.301 - 0.002) * 0.5
    assert out.ready == pytest.approx([2.002 + behind, 2.002], abs=1e-6)
    assert out.store_copies == pytest.approx(1.0)


def test_a_node_watching_some_peers_stripes_among_all_nodes() -> None:
    # 40 nodes each watching 8: striped among the 9 each sees, every group of them would
    # take the whole blob from the store (4 copies); among all 40, about one
    p = sim.Params(40, 64 * MiB, 2 * MiB, 400e6, 400e6, view=8)
    assert sim.Swarm(p).run().store_copies < 1.5


def test_a_node_starts_its_next_blob_at_the_end_game_of_the_one_before() -> None:
    # one node alone, two blobs of one piece each, 0.1 s from a request to its first
    # byte: one after the other, 2 x (HEAD round + request + 1 s); pipelined, the second
    # blob's HEAD round and request go while the first's piece (all it has to request)
    # is in flight, and the two pieces share the link
    p = sim.Params(
        1, 2 * MiB, MiB, 8 * MiB, 8 * MiB, rtt=0.1, efficiency=1.0, blobs=(MiB, MiB), pipeline=1
    )
    assert sim.Swarm(p).run().last == pytest.approx(2.4)
    assert sim.Swarm(replace(p, pipeline=2)).run().last == pytest.approx(2.2)


def test_pipelined_blobs_keep_the_links_busy_between_blobs() -> None:
    # four shards, nodes in lockstep: each blob's start (the store's pieces one by one, a
    # view round before any peer piece) overlaps the end game of the one before; with
    # cut-through and without. The bound allows for what one request per peer first costs
    # a four-node lockstep (design §8, One request per peer first).
    for cut_through in (True, False):
        p = sim.Params(
            4, 64 * MiB, 0, 400e6, 400e6, blobs=(16 * MiB,) * 4, pipeline=1, cut_through=cut_through
        )
        one, two = sim.Swarm(p).run(), sim.Swarm(replace(p, pipeline=2)).run()
        assert two.last < 0.97 * one.last
        assert two.last < 3.2
        assert two.store_copies == pytest.approx(1.0, abs=0.05)


def test_the_first_node_at_a_blob_takes_its_stripe_not_the_whole_blob() -> None:
    # 8 nodes in lockstep, config.json (one piece) then four shards: the owner of
    # config.json's piece is first at every shard. Striping only among the peers on the
    # shard, it would be alone there and take each shard whole from the store, its uplink
    # then every other node's only source (twice the time of one blob of the same bytes);
    # striping among the peers seen on the revision (`SwarmMembers`) stays well within the
    # bound. Without cut-through, which these small shards (512 KiB pieces at 400 mbit)
    # come later with than the single blob; the single blob in 2 MiB pieces, the size the
    # bound was set with.
    p = sim.Params(8, 64 * MiB, 0, 400e6, 400e6, blobs=(100, *(16 * MiB,) * 4), cut_through=False)
    shards, single = sim.Swarm(p).run(), sim.Swarm(replace(p, blobs=(), piece=2 * MiB)).run()
    assert shards.last < 1.75 * single.last
    assert shards.store_copies == pytest.approx(1.0, abs=0.05)


def test_an_idle_node_watching_some_peers_leaves_pieces_out_of_view_to_their_owners() -> None:
    # 100 nodes, 64 pieces, each node watching 8: asking the store for any piece nobody in
    # view has when idle cost 2.03 copies (most were held or fetched out of view); only the
    # own stripe, orphaned stripes and pieces unseen for long: about one
    out = sim.Swarm(params(100, 1.0, view=8)).run()
    assert out.store_copies < 1.1
    assert max(out.ready) < 3 * 64 * MiB / 10e6


def test_members_that_never_start_leave_no_piece_behind() -> None:
    # 40 nodes watching 8 each, 4 of them listed but dead: their stripes are taken from the
    # store by the nodes that find them gone, or late by their successors
    p = params(40, 1.0, view=8, dead=4)
    out = sim.Swarm(p).run()
    assert len(out.ready) == 36 and max(out.ready) < 6 * 64 * MiB / 10e6
    assert out.store_copies < 1.5
