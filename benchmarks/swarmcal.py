"""Calibrate the swarm simulator's CPU model on this machine with real daemons, and compare
its prediction with the measured swarm.

    sudo python benchmarks/swarmcal.py [--size 256M] [--link 400mbit] [--json cal.json]
    python benchmarks/swarmcal.py --loopback      # no root: loopback, rates set by flags
    python benchmarks/swarmcal.py --from-json cal.json [--cores 2]   # compare again only

Measures, per daemon, CPU-seconds from /proc/<pid>/stat (every thread), nothing fitted to
the swarm's results:
1. *start-up*: a `weightcache daemon` (as benchmarks/swarm.py starts them: the model pinned,
   peers on) from its spawn until its /readyz answers;
2. *received, fast*: daemon `a` fetches the pinned model from the store through a link of
   `--link` (CPU from /readyz answering until the model is ready);
3. *sent*, *received from a peer*: daemon `b` then fetches it, the store slowed to 1/50 of
   the link so that nearly every piece comes from `a`: `a`'s CPU meanwhile per MiB it
   uploaded; `b`'s download checks the model below;
4. *a view round's HEAD*: `Peers.probe` (the daemons' code) from this process to `a`, 300
   times, this process's CPU and `a`'s;
5. *received, slow*: daemon `c` (no peers) fetches it with the store at a quarter of the link;
6. *hashed*: sha256 in this process (the daemons' hasher), per MiB;
7. *a /readyz*: daemon a's CPU per /readyz answered (300 asked in a row), by which this
   process's own waiting (about 40 polls a second) is taken out of a's and c's CPU, and
   the swarm benchmark's (one every 0.1 s) becomes the model's `poll`.
A MiB costs more when bytes trickle in: a daemon spends CPU per second while it downloads,
whatever its rate. So received CPU = busy x seconds + per-MiB x MiB, solved from the fast
and the slow download: the model's `busy` (cores) and `recv` (per MiB, less the hashing,
which `hash` charges). Beside each download, what the model gives for it.
By default a, b, c and the polling run in a network namespace of their own
(`wccal<hex>-n`) whose loopback is shaped to `--link` by tc at MTU 1500, the store in
another (`-s`) behind a veth pair shaped the same (its egress re-shaped for b and c); so
bytes arrive at a link's pace as in benchmarks/swarm.py. Needs root; both namespaces are
removed after.
`--loopback` runs on the host's loopback instead, paced by the daemons' own `--bwlimit` and
`--peer-upload-limit`: bytes arrive in bursts (fewer, larger reads), and the swarm's store
path may not honour `--bwlimit`; a lower bound of the CPU.

Then the simulator (benchmarks/swarmsim.py) with this CPU model and `--cores` (default: this
machine's) against the swarm measured at 400 mbit (`MEASURED`), and the flags that give
benchmarks/swarm.py the same model (`--sim-...`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import benchlib as bl
import measure as ms
import netlab as nl
import swarmplot
import swarmsim as sim
from swarm import METRICS_PORT, PEER_PORT, daemon_argv, pinned_ready
from swarmnet import Cpu, MiB, cpu_flags

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # daemons a, b and c
#: The two ends of the veth pair between the calibration's own two namespaces (a range for
#: benchmarks; nothing outside them routes it).
STORE_ADDR, NODES_ADDR = "198.18.0.1", "198.18.0.2"

#: The swarm at commit 6d71f3c (`git show 70e0249:benchmarks/RESULTS.md`, "Swarm, fourth
#: pass"): 256 MiB of shards and 0.69 MiB of small files, 400 mbit links; (N, store egress
#: in links) -> (last node ready s, the daemons' CPU-s), peers on, then off; and the spread
#: of the daemons' start (s, peers on).
MEASURED = {(8, 1): ((15.7, 27), (48.5, 31), 0.63), (8, 4): ((13.7, 26), (14.7, 18), 0.72),
            (16, 1): ((28.4, 55), (94.9, 119), 0.57),
            (16, 4): ((35.3, 67), (29.7, 44), 0.36)}  # fmt: skip
MEASURED_BYTES, MEASURED_SHARDS = 269161025, 256 * MiB
#: Seconds between benchmarks/swarm.py's /readyz polls of a daemon (its --poll).
SWARM_POLL = 0.1


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, every thread, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def page(addr: str, path: str) -> str | None:
    """The body of the daemon's page at `path` ("" for an error status: /readyz answers 503
    while not serving), None if it does not answer. `swarm.pinned_ready` reads /readyz's."""
    try:
        with _DIRECT.open(f"http://{addr}:{METRICS_PORT}{path}", timeout=5) as r:
            return str(r.read().decode())
    except urllib.error.HTTPError:
        return ""
    except OSError:
        return None


def wait(what: str, test: Callable[[], bool], timeout: float, period: float = 0.02) -> float:
    """Poll `test` until true; the monotonic time it was. Raises RuntimeError on timeout."""
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(period)
    return time.monotonic()


@dataclass
class Daemon:
    """One running daemon and what was read of it."""

    name: str
    addr: str
    proc: subprocess.Popen[bytes]
    spawned: float
    polls: int = 0  # /readyz requests this process made of it: each costs it CPU

    def readyz(self) -> str | None:
        self.polls += 1
        return page(self.addr, "/readyz")

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def counter(self, key: str) -> float:
        text = page(self.addr, "/metrics") or ""
        value = bl.metric_value(text, bl.DAEMON_COUNTERS[key])
        return 0.0 if value != value else value

    def up(self, timeout: float = 60) -> tuple[float, float]:
        """(seconds from the spawn, CPU-s) when /readyz first answers."""
        t = wait(f"{self.name}'s /readyz", lambda: self.readyz() is not None, timeout)
        return t - self.spawned, self.cpu()

    def ready(self, timeout: float = 300) -> tuple[float, float]:
        """(seconds from the spawn, CPU-s) when the pinned model is ready."""
        t = wait(f"{self.name}'s model", lambda: pinned_ready(self.readyz() or ""), timeout)
        return t - self.spawned, self.cpu()


@dataclass(frozen=True)
class Receive:
    """One daemon's download: MiB received, seconds from serving to ready, CPU-s meanwhile
    and the /readyz polls it answered meanwhile (this process waiting for it)."""

    who: str
    mib: float
    seconds: float
    cpu: float
    polls: int = 0


@dataclass(frozen=True)
class Calibration:
    """What was measured; `cpu(cores)` is the simulator's model from it."""

    startup: list[float]  # CPU-s per daemon, spawn to serving
    startup_s: list[float]  # seconds, the same
    fast: Receive  # a, from the store at the link's rate
    peer: Receive  # b, from a at the link's rate (a check of the model)
    slow: Receive  # c, from the store at a quarter of it
    sent: float  # CPU-s per MiB a uploaded while b fetched
    sent_mib: float
    hash: float  # CPU-s per MiB, sha256 in this process
    probe: float  # CPU-s per HEAD of a view round, both ends
    mode: str  # "tc" (a shaped loopback in a namespace) or "loopback" (self-paced)
    link: str
    poll: float = 0.0  # CPU-s of a daemon per /readyz it answers (0: not measured)

    def split(self) -> tuple[float, float]:
        """(busy cores, CPU-s per MiB) with cpu = busy x seconds + per_mib x MiB through
        the fast and the slow download (two equations, two unknowns), the CPU of this
        process's own polls taken out first: waiting for a download, it asks /readyz about
        40 times a second, 0.06-0.08 cores of the daemon, half of what was taken for busy."""
        (fc, fs, fm), (sc, ss, sm) = (
            (r.cpu - r.polls * self.poll, r.seconds, r.mib) for r in (self.fast, self.slow)
        )
        per_mib = (fc / fs - sc / ss) / (fm / fs - sm / ss)
        return max(0.0, fc / fs - per_mib * fm / fs), per_mib

    def cpu(self, cores: float) -> Cpu:
        """The model's costs; `poll`: the swarm benchmark's polls (every SWARM_POLL s)."""
        busy, per_mib = self.split()
        return Cpu(
            cores,
            recv=max(0.0, per_mib - self.hash),
            sent=self.sent,
            hash=self.hash,
            startup=sum(self.startup) / len(self.startup),
            busy=busy,
            probe=self.probe,
            poll=self.poll / SWARM_POLL,
        )


def hash_cost(mib: int = 256) -> float:
    """CPU-s per MiB of sha256 over 8 MiB buffers, as the daemon's hasher."""
    data, h = os.urandom(8 * MiB), hashlib.sha256()
    began = time.process_time()
    for _ in range(mib // 8):
        h.update(data)
    return (time.process_time() - began) / mib


def spawn(
    args: argparse.Namespace,
    workdir: Path,
    k: int,
    endpoint: str,
    env: dict[str, str],
    source: str,
    extra: list[str],
) -> Daemon:
    """Daemon k (0 = a, 1 = b, 2 = c) on ADDRS[k], pinning `source`; a and b are each other's
    peers, c has none."""
    name = "abc"[k]
    home = workdir / name
    (home / "kubelet-pods").mkdir(parents=True)
    (home / "models.yaml").write_text(f"models:\n  - source: {source}\n    pin: true\n")
    peers = ",".join(f"{a}:{PEER_PORT}" for a in (ADDRS[:2] if k < 2 else ADDRS[2:]))
    argv = daemon_argv(args.exe, _Loopback(ADDRS[k]), home, endpoint, peers, extra)  # type: ignore[arg-type]
    with open(home / "daemon.log", "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    return Daemon(name, ADDRS[k], proc, time.monotonic())


@dataclass(frozen=True)
class _Loopback:
    """The part of a `netlab.Host` that `daemon_argv` uses."""

    addr: str

    def exec_prefix(self) -> list[str]:
        return []


def calibrate(args: argparse.Namespace, workdir: Path) -> Calibration:
    """The store and a model on it, then daemons a, b and c (see the module's docstring)."""
    model = bl.make_model(workdir / "model", bl.parse_size(args.size), name="swarmcal")
    link = nl.parse_rate(args.link)
    # --loopback: the daemons pace themselves; in the namespaces, tc paces every byte
    paced = {
        k: ["--bwlimit", str(rate // 8), "--peer-upload-limit", str(link // 8)]
        for k, rate in (("a", link), ("b", link // 50), ("c", link // 4))
    }
    procs: list[subprocess.Popen[bytes]] = []
    store = (
        nl.NetnsStore(workdir / "store", host=nl.Host("store", args.store_ns, STORE_ADDR, "", ""))
        if args.store_ns
        else nl.DevStore(workdir / "store")
    )
    with store:
        bl.upload_model(model, store.endpoint_url, store.env)
        env = {**bl.peer_env(store.endpoint_url, store.env), "WEIGHTCACHE_PEER_TOKEN": "c" * 32}

        def start(k: int, store_bits: int) -> Daemon:
            if args.store_ns:
                qdisc = ("qdisc", "replace", "dev", "s0", "root")
                nl.run("tc", "-n", args.store_ns, *qdisc, *nl.tbf_args(store_bits))
            extra = paced["abc"[k]] if args.loopback else []
            d = spawn(args, workdir, k, store.endpoint_url, env, model.source, extra)
            procs.append(d.proc)
            return d

        try:
            a = start(0, link)
            boot_a, fast = receive(a)
            b = start(1, link // 50)  # nearly every piece from a
            sent0, boot_b = a.counter("peer_upload_bytes"), b.up()
            a_cpu = a.cpu()
            _, peer = receive(b, boot_b)
            serve, sent = a.cpu() - a_cpu, a.counter("peer_upload_bytes") - sent0
            bl.log(
                f"b: {b.counter('peer_bytes') / MiB:.1f} MiB from a, "
                f"{b.counter('origin_bytes') / MiB:.1f} MiB from the store"
            )
            probe = probe_cost(a, model.sha256[max(model.listed, key=model.listed.__getitem__)])
            poll = poll_cost(a)
            c = start(2, link // 4)
            boot_c, slow = receive(c)
        finally:
            ms.stop_processes(procs)
    boots = [boot_a, boot_b, boot_c]
    return Calibration(
        startup=[x[1] for x in boots],
        startup_s=[x[0] for x in boots],
        fast=fast,
        peer=peer,
        slow=slow,
        sent=serve / max(sent / MiB, 1e-9),
        sent_mib=sent / MiB,
        hash=hash_cost(),
        probe=probe,
        mode="loopback" if args.loopback else "tc",
        link=args.link,
        poll=poll,
    )


def receive(
    d: Daemon, up: tuple[float, float] | None = None
) -> tuple[tuple[float, float], Receive]:
    """(d's start-up: seconds, CPU-s; its download) until its model is ready."""
    up = up or d.up()
    polls = d.polls
    ready, cpu = d.ready()
    mib = (d.counter("origin_bytes") + d.counter("peer_bytes")) / MiB
    return up, Receive(d.name, mib, ready - up[0], cpu - up[1], d.polls - polls)


def poll_cost(a: Daemon, count: int = 300) -> float:
    """CPU-s daemon a (done, idle) spends per /readyz, asked as `Daemon.ready` asks."""
    theirs = a.cpu()
    for _ in range(count):
        a.readyz()
    return (a.cpu() - theirs) / count


def probe_cost(a: Daemon, sha256: str, count: int = 300) -> float:
    """CPU-s per HEAD of a swarm's view round: `Peers.probe` (the daemons' own code, its
    own connection each) in this process, and daemon a answering it."""
    from weightcache.config import PeerSettings
    from weightcache.swarm.entry import NodeSwarm

    peers = NodeSwarm(PeerSettings(("127.0.0.9", 9), "c" * 32))
    mine, theirs = time.process_time(), a.cpu()
    for _ in range(count):
        peers.probe(f"{a.addr}:{PEER_PORT}", sha256)
    return (time.process_time() - mine + a.cpu() - theirs) / count


def in_namespace(argv: list[str], link: str) -> int:
    """Run this script (`--inside`) in a new network namespace, the nodes', whose loopback
    (MTU 1500, as a link's packets) is shaped to `link`; the store in another, joined to it
    by a veth pair whose store end is shaped to `link` (the store's own traffic between its
    servers stays unshaped). Both namespaces are removed after. Returns the run's exit."""
    tag, rate = f"wccal{secrets.token_hex(2)}", nl.tbf_args(nl.parse_rate(link))
    nodes, store = f"{tag}-n", f"{tag}-s"
    try:
        for ns in (nodes, store):
            nl.run("ip", "netns", "add", ns)
            nl.run("ip", "-n", ns, "link", "set", "lo", "mtu", "1500", "up")
        nl.run("ip", "-n", store, "link", "add", "s0", "type", "veth", "peer", "n0", "netns", nodes)
        for ns, dev, addr in ((store, "s0", STORE_ADDR), (nodes, "n0", NODES_ADDR)):
            nl.run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            nl.run("ip", "-n", ns, "link", "set", dev, "up")
        nl.run("tc", "-n", store, "qdisc", "replace", "dev", "s0", "root", *rate)
        nl.run("tc", "-n", nodes, "qdisc", "replace", "dev", "lo", "root", *rate)
        inside = [sys.executable, __file__, "--inside", "--store-ns", store, *argv]
        cmd = ["ip", "netns", "exec", nodes, *inside]
        return subprocess.run(cmd, check=False).returncode
    finally:
        for ns in (nodes, store):
            nl.kill_netns_processes(ns)
            nl.run("ip", "netns", "del", ns, check=False)


def report(cal: Calibration) -> str:
    """The measurements, and the model's costs from them."""
    busy, per_mib = cal.split()
    boots = (
        " / ".join(f"{c:.2f}" for c in cal.startup),
        " / ".join(f"{s:.1f}" for s in cal.startup_s) + " s spawn to /metrics",
    )
    rows = [["start-up (a, b, c)", "", "", "", *boots]]
    for what, r in (
        ("a: store, link", cal.fast),
        ("b: peer a, link", cal.peer),
        ("c: store, link / 4", cal.slow),
    ):
        model = busy * r.seconds + per_mib * r.mib
        rows.append([what, f"{r.mib:.0f}", f"{r.seconds:.1f}", f"{r.cpu:.2f}",
                     f"{r.cpu / r.mib:.5f} per MiB", f"model {model:.2f} CPU-s"])  # fmt: skip
    rows += [
        ["a: sent to b", f"{cal.sent_mib:.0f}", "", "", f"{cal.sent:.5f} per MiB", ""],
        ["sha256, this process", "", "", "", f"{cal.hash:.5f} per MiB", "in the received"],
        ["a view round's HEAD", "", "", "", f"{cal.probe:.5f} per HEAD", "asker + a"],
        ["a: /readyz answered", "", "", "", f"{cal.poll:.5f} per poll",
         f"polls a, c: {cal.fast.polls}, {cal.slow.polls}"],
        ["from a and c", "", "", "", f"{per_mib:.5f} per MiB", f"busy {busy:.3f} cores"],
    ]  # fmt: skip
    return ms.md_table(["what", "MiB", "s", "CPU-s", "CPU-s", "note"], rows)


def compare(cpu: Cpu, piece: int) -> str:
    """The simulator with `cpu` (and without) against the measured swarm."""
    rows = []
    blobs = swarmplot.model_blobs(MEASURED_SHARDS, MEASURED_BYTES)
    for (n, x), (on, off, spread) in MEASURED.items():
        p = sim.Params(
            n, MEASURED_BYTES, piece, 400e6, x * 400e6, jitter=spread, cpu=cpu, blobs=blobs
        )
        links = sim.Swarm(replace(p, cpu=Cpu())).run().last
        for mode, got, want in (
            ("peers on", on, sim.Swarm(p).run()),
            ("peers off", off, sim.peers_off(p)),
        ):
            rows.append([n, f"{x}x", mode, f"{got[0]:.1f}", f"{want.last:.1f}",
                         f"{got[0] / want.last:.2f}x", f"{got[1]:.0f}", f"{want.cpu_s:.0f}",
                         f"{links:.1f}" if mode == "peers on" else "-"])  # fmt: skip
    headers = ["N", "store egress", "mode", "measured last s", "simulated last s",
               "measured / sim", "measured CPU-s", "simulated CPU-s",
               "links only, sim s"]  # fmt: skip
    return ms.md_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="256M", help="model bytes (default 256M)")
    ap.add_argument("--link", default="400mbit", help="the link's rate (default 400mbit)")
    ap.add_argument("--loopback", action="store_true", help="no namespace: loopback, no root")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store-ns", help=argparse.SUPPRESS)
    ap.add_argument(
        "--cores",
        type=float,
        default=float(os.cpu_count() or 1),
        help="the host's cores in the model (default: this machine's)",
    )
    ap.add_argument("--piece", default="0", help="the simulator's piece size (0: the daemons')")
    ap.add_argument("--json", type=Path, help="write the calibration here")
    ap.add_argument("--from-json", type=Path, help="a saved calibration: compare only")
    args = ap.parse_args()
    if not (args.from_json or args.loopback or args.inside):
        if os.geteuid() != 0:
            raise SystemExit("swarmcal.py needs root for its namespace; or use --loopback")
        raise SystemExit(in_namespace(sys.argv[1:], args.link))
    if args.from_json:
        saved: dict[str, Any] = json.loads(args.from_json.read_text())
        saved_cal = saved["calibration"]
        cal = Calibration(
            **{k: Receive(**v) if isinstance(v, dict) else v for k, v in saved_cal.items()}
        )
    else:
        args.exe = bl.available_tools(["weightcache"], required=True)[0]["weightcache"]
        bl.precompile(args.exe)  # as installed in the image: not compiled again at each start
        with tempfile.TemporaryDirectory(prefix="wc-swarmcal-") as tmp:
            began = time.monotonic()
            cal = calibrate(args, Path(tmp))
            bl.log(f"calibrated in {time.monotonic() - began:.0f} s")
        if args.json:
            ms.write_json(
                args.json,
                {
                    "calibration": asdict(cal),
                    "cpu": asdict(cal.cpu(args.cores)),
                    "machine": bl.machine_info(None),
                },
            )
    cpu = cal.cpu(args.cores)
    print(
        f"\ncalibration ({cal.mode}, link {cal.link}); load average at the end "
        f"{os.getloadavg()[0]:.1f}:\n\n{report(cal)}\n"
    )
    print(
        f"CPU model: {cpu.describe()}\n  swarmsim.py {cpu_flags(cpu)}\n  swarm.py "
        f"{cpu_flags(cpu, 'sim-')}\n"
    )
    print(
        "against the swarm measured at 6d71f3c (256.69 MiB, 400 mbit; the model's blobs in turn):\n"
    )
    print(compare(cpu, bl.parse_size(args.piece)))


if __name__ == "__main__":
    main()
