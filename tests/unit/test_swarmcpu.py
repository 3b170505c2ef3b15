"""benchmarks/swarmnet.py's CPU model: processor sharing of a host's cores among its nodes,
checked against times computed by hand from the parameters."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import swarmcal
import swarmsim as sim
from swarmnet import Cpu, Flow, Network, share

MiB = 1 << 20


def test_cores_are_shared_equally_and_what_one_node_leaves_goes_to_the_others() -> None:
    assert share([0.1, 1.0, 1.0, 1.0], 2.0, 1.0) == pytest.approx([0.1, 1.9 / 3, 1.9 / 3, 1.9 / 3])
    assert share([5.0, 5.0], math.inf, 1.0) == [1.0, 1.0]  # a node's own cores at most
    assert share([0.3, 0.0], 2.0, 1.0) == [0.3, 0.0]  # no more than asked
    assert share([4.0] * 8, 2.0, 1.0) == [0.25] * 8


def test_a_node_short_of_cpu_slows_its_flows_and_gets_it_back_when_others_stop() -> None:
    # nodes 0 and 1 receive from the store (2) at 100 B/s by their links; receiving a byte
    # costs 0.01 CPU-s: each asks for 1 core, the host has 1, so each gets 0.5 -> 50 B/s
    cpu = Cpu(cores=1.0, recv=0.01 * MiB)
    net = Network([100.0, 100.0, 1000.0], [100.0, 100.0], cpu)
    a, b = Flow(2, 0, 0, 1000), Flow(2, 1, 1, 1000)
    net.start(a)
    net.start(b)
    assert (a.rate, b.rate) == (pytest.approx(50.0), pytest.approx(50.0))
    net.now = 2.0
    net.stop(b)
    assert a.rate == pytest.approx(100.0)  # the whole core for node 0 now
    assert a.left == pytest.approx(900.0)


def test_serving_costs_cpu_at_the_sender() -> None:
    # node 0 serves node 1 at 100 B/s by the links; 0.01 CPU-s per byte sent, half a core
    net = Network([100.0, 100.0, 0.0], [100.0, 100.0], Cpu(cores=0.5, sent=0.01 * MiB))
    f = Flow(0, 1, 0, 1000)
    net.start(f)
    assert f.rate == pytest.approx(50.0)


def params(nodes: int, **kw: object) -> sim.Params:
    link = 8e9  # 1 GB/s: the links never bind in these runs
    return sim.Params(nodes, 64 * MiB, 4 * MiB, link, 8 * link, efficiency=1.0, **kw)  # type: ignore[arg-type]


def test_eight_nodes_on_two_cores_take_the_cpu_time_computed_by_hand() -> None:
    # 8 nodes x 64 MiB received x 0.02 CPU-s per MiB = 10.24 CPU-s on 2 cores: 5.12 s
    cpu = Cpu(cores=2.0, recv=0.015, hash=0.005)
    p = params(8, cpu=cpu, cut_through=False)  # with it, a node waits on a peer's store flow
    assert sim.peers_off(p).last == pytest.approx(5.12 + p.rtt)
    out = sim.Swarm(p).run()
    assert out.last == pytest.approx(5.12, rel=0.01)  # the 16 pieces leave no endgame here
    assert out.cpu_s == pytest.approx(10.24, rel=0.01)
    assert sim.peers_off(p).cpu_s == pytest.approx(10.24)
    links_only = sim.Swarm(replace(p, cpu=Cpu())).run()
    assert links_only.last < 5.12 / 4  # the links alone would not take a quarter of it


def test_start_up_cpu_is_shared_by_the_daemons_booting_together() -> None:
    # 8 daemons x 1 CPU-s of start-up on 2 cores: all serve at 4 s (each capped at one core)
    slow_link = dict(link=80e6, store_rate=640e6)
    booted = sim.Swarm(replace(params(8, cpu=Cpu(cores=2.0, startup=1.0)), **slow_link)).run()
    late = sim.Swarm(replace(params(8, startup=4.0), **slow_link)).run()
    assert booted.last == pytest.approx(late.last, rel=0.02)
    assert min(booted.ready) > 4.0
    assert Cpu(cores=2.0, startup=1.0).boot_time(8) == 4.0
    assert Cpu(cores=16.0, startup=1.0).boot_time(8) == 1.0  # one core per daemon at most


def test_without_a_cpu_model_the_results_are_today_s() -> None:
    # recorded with the simulator's links alone (same settings, seed 1), since the nodes
    # follow the daemons' own view rounds and store measurements (no idealised looks) and
    # take an endgame's second copy only from an idle peer, and one request per peer first
    # (with up to four from the first: 7.74, 12.52 and 13.51 s), and a node whose stripe is
    # claimed takes a laggard's pieces (before: 10.74 and 11.50 s at 4x, 1.016 copies);
    # without cut-through (the recorded runs had none), and with it a CPU model that never
    # binds changes nothing
    for (n, x, startup, jitter), last, copies in (
        ((8, 1, 0.0, 0.0), 7.046306842105264, 1.0),
        ((8, 4, 2.0, 2.0), 9.542622849182163, 1.03125),
        ((16, 4, 3.0, 1.0), 10.848292200862462, 1.015625),
    ):
        p = sim.Params(n, 256 * MiB, 4 * MiB, 400e6, x * 400e6, startup=startup, jitter=jitter,
                       cut_through=False)  # fmt: skip
        assert not p.cpu.on
        out = sim.Swarm(p).run()
        assert (out.last, out.store_copies) == pytest.approx((last, copies), rel=1e-4)
        # a CPU model that never binds changes nothing either
        roomy = sim.Swarm(replace(p, cpu=Cpu(cores=64.0, recv=1e-6))).run()
        assert roomy.last == pytest.approx(last, rel=1e-4)
        # with cut-through too, but for ends at the same instant, taken in the order they
        # were scheduled, which differs when every flow is re-rated at once (16 nodes: one)
        cut = sim.Swarm(replace(p, cut_through=True)).run()
        roomy = sim.Swarm(replace(p, cut_through=True, cpu=Cpu(cores=64.0, recv=1e-6))).run()
        assert roomy.last == pytest.approx(cut.last, rel=1e-3)


def test_a_calibration_becomes_the_model_s_costs() -> None:
    # received CPU = 0.1 cores x seconds + 0.004 CPU-s x MiB, in both downloads
    fast = swarmcal.Receive("a", 256.0, 5.0, 0.1 * 5 + 0.004 * 256)
    slow = swarmcal.Receive("c", 256.0, 20.0, 0.1 * 20 + 0.004 * 256)
    cal = swarmcal.Calibration(
        startup=[0.5, 0.7, 0.6], startup_s=[0.6, 0.8, 0.7], fast=fast, peer=fast, slow=slow,
        sent=0.001, sent_mib=256.0, hash=0.001, probe=0.002, mode="tc", link="400mbit",
    )  # fmt: skip
    assert cal.split() == pytest.approx((0.1, 0.004))
    cpu = cal.cpu(2.0)
    assert (cpu.cores, cpu.busy, cpu.startup, cpu.probe) == pytest.approx((2.0, 0.1, 0.6, 0.002))
    assert (cpu.recv, cpu.sent, cpu.hash) == pytest.approx((0.003, 0.001, 0.001))  # less hashing


def test_a_downloading_node_s_busy_cpu_slows_its_flows_with_it() -> None:
    # one node, one core: its flow asks for 1 core at 100 B/s, being busy for 0.5 more;
    # granted 1 of 1.5, everything runs at 2/3
    net = Network([100.0, 1000.0], [100.0], Cpu(cores=1.0, recv=0.01 * MiB))
    f = Flow(1, 0, 0, 1000)
    net.start(f)
    assert f.rate == pytest.approx(100.0)
    net.set_background(0, 0.5)
    assert f.rate == pytest.approx(100.0 / 1.5)
    # the closed form of peers off does the same: 8 nodes on 2 cores, 0.25 each
    cpu = Cpu(cores=2.0, recv=0.001 * MiB, busy=0.25)
    assert cpu.recv_rate(8, 1000.0) == pytest.approx(1000.0 * 0.25 / (0.25 + 1.0))


def test_view_rounds_cost_cpu_for_every_watched_peer_not_answering_pieces() -> None:
    # 8 nodes, each watching 7 peers; a HEAD costs 0.01 CPU-s, a round every 0.5 s: a node
    # that starts (nothing in flight yet) asks for 0.05 busy + 0.14 cores besides its flows
    cpu = Cpu(cores=1.6, recv=0.02, busy=0.05, probe=0.01)
    slow_links = {"link": 80e6, "store_rate": 640e6}  # 10 MB/s: 0.19 cores of bytes a node
    swarm = sim.Swarm(replace(params(8, cpu=cpu), **slow_links))
    swarm._start(0, sim.START, 0)
    assert swarm.net.background[0] == pytest.approx(0.05 + 0.01 * 7 / 0.5)
    assert swarm.net.background[1] == 0.0  # not started yet
    plain = sim.Swarm(replace(params(8, cpu=replace(cpu, busy=0.0, probe=0.0)), **slow_links))
    probing = sim.Swarm(replace(params(8, cpu=cpu), **slow_links))
    assert probing.run().last > plain.run().last * 1.2


def test_two_blobs_in_progress_cost_two_loops_of_busy_cpu() -> None:
    # a node pipelining two blobs runs two downloads, each with its own loop and view
    # rounds: busy and HEADs count twice, the benchmark's polls once
    cpu = Cpu(cores=1.6, recv=0.02, busy=0.05, probe=0.01, poll=0.02)
    p = replace(params(8, cpu=cpu), blobs=(32 * MiB, 32 * MiB), size=64 * MiB, pipeline=2)
    swarm = sim.Swarm(p)
    swarm._start(0, sim.START, 0)
    one = swarm.net.background[0]
    assert one == pytest.approx(0.02 + 0.05 + 0.01 * 7 / 0.5)
    swarm.ahead[0] = sim.Node(1, started=True, watches=swarm.nodes[0].watches)
    swarm._background(0)
    assert swarm.net.background[0] == pytest.approx(one + 0.05 + 0.01 * 7 / 0.5)


def test_the_calibration_s_own_readyz_polls_are_not_taken_for_the_daemon_s_busy_cpu() -> None:
    # the daemon: 0.05 cores x seconds + 0.004 CPU-s x MiB; the calibration asked /readyz
    # 40 times a second meanwhile, at 2 ms of the daemon's CPU each: 0.08 cores more
    fast = swarmcal.Receive("a", 256.0, 5.0, (0.05 + 0.08) * 5 + 0.004 * 256, polls=200)
    slow = swarmcal.Receive("c", 256.0, 20.0, (0.05 + 0.08) * 20 + 0.004 * 256, polls=800)
    cal = swarmcal.Calibration(
        startup=[0.5], startup_s=[0.6], fast=fast, peer=fast, slow=slow, sent=0.001,
        sent_mib=256.0, hash=0.001, probe=0.002, mode="tc", link="400mbit", poll=0.002,
    )  # fmt: skip
    assert cal.split() == pytest.approx((0.05, 0.004))
    assert replace(cal, poll=0.0).split() == pytest.approx((0.13, 0.004))  # as it was taken
    # the swarm benchmark asks every 0.1 s: 0.02 cores, charged apart from busy
    cpu = cal.cpu(2.0)
    assert (cpu.busy, cpu.poll, cpu.waiting) == pytest.approx((0.05, 0.02, 0.07))


def test_the_benchmark_s_polls_cost_a_daemon_until_it_is_ready() -> None:
    cpu = Cpu(cores=2.0, recv=0.01, busy=0.05, poll=0.02)
    slow_links = {"link": 80e6, "store_rate": 640e6}
    swarm = sim.Swarm(replace(params(2, cpu=cpu), **slow_links))
    swarm._start(0, sim.START, 0)
    assert swarm.net.background[0] == pytest.approx(0.07)  # one peer: no HEADs costed
    out = swarm.run()
    assert all(swarm.net.background[i] == 0.0 for i in range(2)) and out.last < math.inf
    # peers off: 8 nodes streaming 64 MiB each at their links' 10 MB/s for 6.7 s (the CPU
    # never binds: 0.07 + 0.095 cores each), every second charged
    off = sim.peers_off(replace(params(8, cpu=cpu), **slow_links))
    rate = 10e6
    assert off.cpu_s == pytest.approx(8 * (0.07 + rate * 0.01 / MiB) * 64 * MiB / rate, rel=1e-3)
