"""The swarm benchmark's pure helpers: what it reads from tc and /metrics, and its table.

The harness itself needs root and namespaces and is not run by the test suite.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import netlab
import swarm
import swarmplot
from swarmnet import Cpu

BENCH = Path(swarm.__file__).parent

# `tc -s -j qdisc show dev X` of iproute2 6.1, a shaped veth end after some traffic.
TC_JSON = (
    '[{"kind":"tbf","handle":"8002:","root":true,"refcnt":3,"options":{"rate":50000000,'
    '"burst":500000,"lat":50000},"bytes":281920318,"packets":9371,"drops":0,"overlimits":812,'
    '"requeues":0,"backlog":0,"qlen":0}]'
)


def test_qdisc_sent_bytes_reads_the_root_qdisc() -> None:
    assert netlab.qdisc_sent_bytes(TC_JSON) == 281920318
    with pytest.raises(ValueError, match="no root qdisc"):
        netlab.qdisc_sent_bytes("[]")  # a veth end without shaping: nothing to count


def test_qdisc_drops_are_the_root_qdiscs() -> None:
    dropped = TC_JSON.replace('"drops":0', '"drops":17')
    assert netlab.qdisc_counter(dropped, "drops") == 17
    assert netlab.qdisc_counter(dropped, "bytes") == 281920318


# /proc/net/netstat of Linux 6.1, shortened: a header line and a value line per group.
NETSTAT = (
    "TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes\n"
    "TcpExt: 0 42 7\n"
    "IpExt: InNoRoutes TCPTimeouts\n"
    "IpExt: 3 99\n"
)


def test_netstat_counter_reads_its_group() -> None:
    assert netlab.netstat_counter(NETSTAT, "TcpExt:TCPTimeouts") == 42
    assert netlab.netstat_counter(NETSTAT, "IpExt:TCPTimeouts") == 99
    with pytest.raises(ValueError, match="no TcpExt:TCPLossRetransmits"):
        netlab.netstat_counter(NETSTAT, "TcpExt:TCPLossRetransmits")


def test_rates_are_tc_decimal_bits() -> None:
    assert netlab.parse_rate("400mbit") == 400_000_000
    assert netlab.parse_rate("1.6Gbit") == 1_600_000_000
    assert netlab.fmt_rate(1_600_000_000) == "1.6gbit"
    with pytest.raises(ValueError):
        netlab.parse_rate("400M")  # bytes or bits? tc's own words only
    # 10 ms of the rate, never below 64 KiB.
    for bits, burst in ((400_000_000, 500_000), (1_000_000, 64 << 10)):
        args = netlab.tbf_args(bits)
        assert args[args.index("burst") + 1] == str(burst)


def test_pinned_ready_needs_readyz_to_name_no_missing_pin() -> None:
    assert swarm.pinned_ready("ready\n")
    assert not swarm.pinned_ready("ready; pinned revisions not cached yet: m/r1\n")
    assert not swarm.pinned_ready("")  # 503: not serving yet
    assert not swarm.pinned_ready("not serving: the fetch socket is not up yet\n")


def test_summarize_in_line_rates_and_model_copies() -> None:
    s = swarm.summarize([6.0, 12.0, 9.0, 3.0], 3.0, store_payload=200.0, model_bytes=100,
                        store_wire=209.0)  # fmt: skip
    assert (s.nodes_ready, s.last_s, s.p50_s) == (4, 12.0, 7.5)
    assert (s.last_x_line, s.p50_x_line, s.store_x_model, s.wire_x_model) == (4, 2.5, 2, 2.09)
    # A node that never got ready: no "last" (the run did not finish), p50 still known.
    s = swarm.summarize([6.0, None, 9.0], line_s=3.0, store_payload=0.0, model_bytes=100)
    assert s.nodes_ready == 2 and math.isnan(s.last_s) and s.p50_s == 7.5


def test_the_table_shows_what_each_node_received_over_the_model() -> None:
    # two nodes received 110 and 130 of a 100-byte model (store and peers): duplicates;
    # a run without counters (an older JSON) shows none, not a made-up 0
    counters = [{"origin_bytes": 10.0, "peer_bytes": 100.0},
                {"origin_bytes": 30.0, "peer_bytes": 100.0}]  # fmt: skip
    run = swarm.Run(1, 2, "p2p", 1, [4.0, 6.6], [0.5, 0.5], 105, 100.0, 3.0, 0.5,
                    daemon_counters=counters)  # fmt: skip
    assert swarm.received_x_model(run, 100) == pytest.approx(1.2)
    bare = replace(run, daemon_counters=[])
    assert math.isnan(swarm.received_x_model(bare, 100))
    for r, want in ((run, "1.20x"), (bare, "n/a")):
        table = swarm.report([r], 1, [2], line_s=3.0, model_bytes=100)
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()]
        head, on = rows[0], rows[2]
        assert on[head.index("received / model")] == want
        assert on[head.index("p50 / line")] == "1.77x"  # two digits: the target is 1.2x


def test_line_rate_is_the_model_over_one_link() -> None:
    assert swarm.line_rate_s(256 << 20, 400_000_000) == pytest.approx(5.37, abs=0.01)


MACHINE = {"date": "2026-12-01 06:00 UTC", "commit": "abc1234", "nproc": 2, "memory": "8 GiB",
           "cpu": "x", "kernel": "6.1", "python": "3.11", "loadavg_at_start": "1 1 1"}  # fmt: skip


def saved(n_values: list[int], size: int = 16 << 20) -> dict[str, object]:
    """A `--json` output of swarm.py, synthetic: peers on and off per N, store = 1x."""
    runs = []
    for n in n_values:
        for mode, last in (("p2p", 1.0 + 0.1 * n), ("off", 0.5 * n)):
            ready = [last - 0.01 * k for k in range(n)]
            runs.append(dict(regime=1, n=n, mode=mode, round=1, ready_s=ready,
                             up_s=[0.2 + 0.1 * k for k in range(n)], store_wire_bytes=size,
                             store_payload_bytes=float(size), daemon_cpu_s=1.0,
                             host_cpu_busy=0.5))  # fmt: skip
    params = {"nodes": ",".join(map(str, n_values)), "n_values": n_values, "regime_values": [1],
              "link": "400mbit", "link_bits": 400_000_000, "rounds": 1}  # fmt: skip
    return {"benchmark": "swarm", "machine": MACHINE, "params": params, "model_bytes": size,
            "model_files": 4, "line_rate_s": size * 8 / 400e6, "wire_overhead": {"1": 1.05},
            "runs": runs}  # fmt: skip


def test_saved_results_of_several_n_merge() -> None:
    merged = swarmplot.merge([saved([2]), saved([3])])
    assert merged["params"]["n_values"] == [2, 3]
    assert sorted(r["n"] for r in merged["runs"]) == [2, 2, 3, 3]
    other = saved([4], size=32 << 20)
    with pytest.raises(ValueError, match="model_bytes"):
        swarmplot.merge([saved([2]), other])


def test_the_simulator_gets_the_measured_start_up_and_setting() -> None:
    out = saved([3])
    runs = [swarm.Run(**r) for r in out["runs"]]  # type: ignore[attr-defined]
    p = swarmplot.sim_params(out, runs, regime=1, n=3, piece=1 << 20)
    assert (p.nodes, p.size, p.piece, p.link, p.store_rate) == (3, 16 << 20, 1 << 20, 4e8, 4e8)
    assert (p.startup, p.jitter) == pytest.approx((0.2, 0.2))


def test_the_simulated_model_is_the_benchmark_s_blobs_in_the_daemons_order(tmp_path: Path) -> None:
    import benchlib

    model = benchlib.make_model(tmp_path, 1 << 20, name="m")
    blobs = swarmplot.model_blobs(1 << 20, model.total_bytes)
    order = sorted(model.listed)  # the manifest's order: by path
    assert blobs == tuple(model.files[rel] for rel in order)
    assert order[0] == "config.json" and order[-1] == "tokenizer.json"
    out = {**saved([3]), "model_bytes": model.total_bytes}
    out["params"] = {**out["params"], "size_bytes": 1 << 20}  # type: ignore[dict-item]
    runs = [swarm.Run(**r) for r in out["runs"]]  # type: ignore[attr-defined]
    p = swarmplot.sim_params(out, runs, regime=1, n=3, piece=0)
    assert p.blobs == blobs and sum(p.blobs) < p.size  # SHA256SUMS is not a blob
    # the daemons' pieces: at least 32 a blob, 256 KiB .. 4 MiB
    assert [piece for _, piece in p.layout()] == [256 << 10] * 6


def test_from_json_prints_the_agreement_and_draws_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = []
    for n in (2, 3):
        files.append(tmp_path / f"n{n}.json")
        files[-1].write_text(json.dumps(saved([n])))
    png = tmp_path / "swarm.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "swarm.py"), "--from-json", *map(str, files),
         "--plot", str(png), "--sim-piece", "1M"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
            if "measured / sim" in proc.stdout and line.startswith("|")]  # fmt: skip
    agreement = {(r[1], r[2]): r for r in rows if len(r) == 8}
    assert set(agreement) >= {("2", "peers on"), ("3", "peers on"), ("3", "peers off")}
    assert agreement["3", "peers on"][3] == "1.3"  # the last node of the synthetic N = 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_with_a_cpu_model_the_simulator_models_the_start_up_too() -> None:
    out = saved([3])
    runs = [swarm.Run(**r) for r in out["runs"]]  # type: ignore[attr-defined]
    cpu = Cpu(cores=2.0, recv=0.01, startup=0.5)
    p = swarmplot.sim_params(out, runs, regime=1, n=3, piece=1 << 20, cpu=cpu)
    # booted by the model, spread as they came up (in lockstep one node would lead always)
    assert (p.startup, p.jitter, p.cpu) == (0.0, pytest.approx(0.2), cpu)
    no_boot = swarmplot.sim_params(out, runs, 1, 3, 1 << 20, Cpu(cores=2.0, recv=0.01))
    assert (no_boot.startup, no_boot.jitter) == pytest.approx((0.2, 0.2))


def agreement_of(stdout: str) -> dict[tuple[str, str], list[str]]:
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("|")]  # fmt: skip
    return {(r[1], r[2]): r for r in rows if len(r) == 8 and r[1].isdigit()}


def test_from_json_simulates_with_the_cpu_model_of_flags_or_a_calibration(tmp_path: Path) -> None:
    """3 nodes x 16 MiB x 0.1 CPU-s per MiB on one core: 4.8 CPU-s, so at least 4.8 s,
    where the links alone (and the measured start-up) take about 1 s."""
    saved_run = tmp_path / "n3.json"
    saved_run.write_text(json.dumps(saved([3])))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"cpu": {"cores": 1.0, "recv": 0.08, "hash": 0.02}}))
    base = [sys.executable, str(BENCH / "swarm.py"), "--from-json", str(saved_run),
            "--sim-piece", "1M"]  # fmt: skip
    results = {}
    for name, extra in (("links", []), ("flags", ["--sim-cores", "1", "--sim-cpu-per-mib-recv",
                        "0.1"]), ("file", ["--sim-calibration", str(cal)])):  # fmt: skip
        proc = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        results[name] = agreement_of(proc.stdout)
        assert ("CPU: 1 cores" in proc.stdout) == (name != "links")
    for mode in ("peers on", "peers off"):
        assert float(results["links"]["3", mode][4]) < 2.0
        assert results["links"]["3", mode][6:] == ["1", "0"]  # the daemons' CPU-s, the sim's
        for name in ("flags", "file"):
            assert 4.8 <= float(results[name]["3", mode][4]) <= 4.8 * 1.15
            assert float(results[name]["3", mode][7]) == pytest.approx(4.8, rel=0.15)


def test_the_prediction_is_the_median_of_several_simulated_swarms() -> None:
    import swarmsim as sim

    out = saved([6], size=64 << 20)
    runs = [swarm.Run(**r) for r in out["runs"]]  # type: ignore[attr-defined]
    p = swarmplot.sim_params(out, runs, regime=1, n=6, piece=1 << 20)
    lasts = sorted(sim.Swarm(replace(p, seed=s)).run().last for s in range(1, 6))
    assert lasts[0] < lasts[-1]  # the seeds do differ here
    assert swarmplot.predict(out, runs, 1 << 20)[1, 6]["p2p"].last == lasts[2]


def test_the_poller_asks_readyz_until_up_then_only_once_the_marker_is_there(
    tmp_path: Path,
) -> None:
    """Ten /readyz a second cost a swarming daemon a tenth of its CPU: once a node is up,
    the poller watches its cache for the revision's marker and asks /readyz only then."""
    import http.server
    import threading
    import time

    asked: list[float] = []

    class Readyz(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            asked.append(time.monotonic())
            body = b"ready\n" if (cache / "m" / "r1" / ".weightcache").exists() else (
                b"ready; pinned revisions not cached yet: m/r1\n")  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    cache = tmp_path / "cache"
    (cache / ".weightcache" / "tmp" / ".weightcache").mkdir(parents=True)  # the cache's own
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Readyz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    halt = threading.Event()
    t0 = time.perf_counter()
    url = f"http://127.0.0.1:{server.server_address[1]}/readyz"
    poller = swarm.Poller(url, cache, t0, 0.02, halt)
    try:
        poller.start()
        time.sleep(0.5)
        assert poller.up is not None and poller.ready is None
        assert len(asked) == 1, "asked /readyz again while no marker was there"
        (cache / "m" / "r1").mkdir(parents=True)
        (cache / "m" / "r1" / ".weightcache").write_text("{}")
        appeared = time.perf_counter() - t0
        poller.join(5)
        assert poller.ready is not None and poller.ready >= appeared
        assert len(asked) == 2
    finally:
        halt.set()
        server.shutdown()
        server.server_close()


def test_link_trace_turns_counter_samples_into_rates_per_host() -> None:
    trace = netlab.LinkTrace(None, 0.0)  # type: ignore[arg-type]  # no lab: samples given
    # host 0 (the store) sends 1 MB/s; host 1 receives 0.5 MB/s, then nothing
    trace.samples = [(0.0, [0, 0, 0, 0]), (1.0, [10**6, 0, 0, 5 * 10**5]),
                     (2.0, [2 * 10**6, 0, 0, 5 * 10**5])]  # fmt: skip
    assert trace.rates(0) == [(1.0, 8e6, 0.0), (2.0, 8e6, 0.0)]
    assert trace.rates(1) == [(1.0, 0.0, 4e6), (2.0, 0.0, 0.0)]
    assert netlab.busy_share([8e6, 7e6, 4e6, 0.0], 8e6) == 0.25  # at 90% or more
    assert math.isnan(netlab.busy_share([], 8e6))


def test_link_trace_times_a_sample_by_its_stamp_not_by_when_the_harness_read_it() -> None:
    trace = netlab.LinkTrace(None, 10.0)  # type: ignore[arg-type]
    # two samples 0.5 s apart that reached the harness together (it was starved)
    trace._proc = type("P", (), {"stdout": io.StringIO("10.5 0 0\n11.0 500000 0\n")})()
    trace._read()
    assert trace.samples == [(0.5, [0, 0]), (1.0, [500000, 0])]
    assert trace.rates(0) == [(1.0, 8e6, 0.0)]


def test_link_trace_reads_the_host_s_cpu_busy_share_beside_the_counters() -> None:
    trace = netlab.LinkTrace(None, 10.0)  # type: ignore[arg-type]
    lines = ("10.5 0 0 cpu 100 1000\n11.0 500000 0 cpu 190 1100\n"
             "11.2 500000 0 cpu 190\n"  # cut short: in neither list, which stay aligned
             "11.5 500000 0 cpu 190 1100\n")  # fmt: skip
    trace._proc = type("P", (), {"stdout": io.StringIO(lines)})()
    trace._read()
    assert trace.rates(0) == [(1.0, 8e6, 0.0), (1.5, 0.0, 0.0)]
    busy = trace.cpu_busy()
    assert busy[0] == (1.0, 0.9) and busy[1][0] == 1.5 and math.isnan(busy[1][1])


def test_store_rate_by_cpu_compares_the_store_s_pace_in_busy_and_calm_intervals() -> None:
    use = {
        "store_from": 1.0,
        "store_to": 4.0,
        "store_mbit": [(0.5, 0.0), (1.0, 12.0), (2.0, 6.0), (3.0, 10.0), (4.0, 11.0), (5.0, 0)],
        "host_cpu": [(0.5, 0.1), (1.0, 0.5), (2.0, 0.99), (3.0, 0.97), (4.0, 0.2), (5.0, 0.99)],
    }
    assert swarm.store_rate_by_cpu(use) == (
        "2 intervals at 95% host CPU: the store's uplink 8.0 Mbit/s mean; "
        "2 intervals below 95% host CPU: the store's uplink 11.5 Mbit/s mean"
    )


def test_link_use_counts_the_store_from_its_first_byte_and_a_node_while_it_downloads() -> None:
    trace = netlab.LinkTrace(None, 0.0)  # type: ignore[arg-type]
    mb = 10**6 // 8  # bytes a second of 1 Mbit/s
    store = [0, 0, 10, 10, 5, 10, 0]  # Mbit/s in each second
    node = [0, 0, 10, 2, 10, 2, 10]
    rx0 = rx1 = 0
    trace.samples = [(0.0, [0, 0, 0, 0])]
    for t, (s, d) in enumerate(zip(store, node, strict=True), 1):
        rx0, rx1 = rx0 + s * mb, rx1 + d * mb
        trace.samples.append((float(t), [rx0, 0, 0, rx1]))
    up = swarm.link_use(trace, 10e6, 10e6, [type("P", (), {"up": 2.5, "ready": 6.0})()])
    assert (up["store_from"], up["store_to"]) == (3.0, 6.0)
    assert up["store_busy"] == 0.75  # 10, 10, 5, 10
    assert up["node_busy"] == [0.5]  # the seconds ending at 3-6: 10, 2, 10, 2
    assert up["node_mean"][0] == pytest.approx(24 / 40)


def test_the_link_sampler_stamps_each_sample_of_each_device_s_counters() -> None:
    before = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", netlab._SAMPLER, "lo", "0.05"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().split() for _ in range(2)]
    finally:
        proc.kill()
        proc.wait()
    for line in lines:  # stamp, rx, tx of lo, "cpu", busy and all ticks of the host
        assert len(line) == 6 and line[3] == "cpu"
        assert all(x.isdigit() for x in line[1:3] + line[4:])
    assert int(lines[1][1]) >= int(lines[0][1])
    assert int(lines[1][5]) >= int(lines[0][5]) > int(lines[0][4])
    # stamped when read, on the harness's clock: 0.05 s apart, however late the lines come
    stamps = [float(line[0]) for line in lines]
    assert before < stamps[0] < stamps[1] <= time.perf_counter()
    assert stamps[1] - stamps[0] >= 0.05
