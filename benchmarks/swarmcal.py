"""Calibrate the swarm simulator's CPU model on this machine with real daemons, and compare
its prediction with the measured swarm.

    sudo python benchmarks/swarmcal.py [--size 256M] [--link 400mbit] [--json cal.json]
    python benchmarks/swarmcal.py --loopback      # no root: loopback, rates set by flags
    python benchmarks/swarmcal.py --from-json cal.json [--cores 2]   # compare again only

Measures, per daemon, CPU-seconds from /proc/<pid>/stat (every thread), nothing fitted to
the swarm's results:
1. *start-up*: a `weightcache daemon` (as benchmarks/swarm.py starts them: the model pinned,
   peers on) from its spawn until its /metrics answers;
2. *received*: daemon `a` fetches the pinned model from the store through a link of
   `--link` (CPU from /metrics answering until the model is ready, per MiB received);
3. *sent* and *received from a peer*: daemon `b` then fetches the model, the store slowed
   to 1/50 of the link so that nearly every piece comes from `a`; `a`'s CPU meanwhile per
   MiB it uploaded, `b`'s per MiB it received;
4. *hashed*: sha256 in this process (the daemons' hasher), per MiB.
The model's `recv` is both daemons' receiving CPU per MiB received less the hashing; `hash`
is charged on top of it. By default everything (the store, a, b, the polling) runs in a
network namespace of its own (`wccal<hex>`, removed after; needs root) whose loopback is
shaped to `--link` by tc at MTU 1500, so bytes arrive at a link's pace as in
benchmarks/swarm.py (one link for all: b's bytes from the store and from a share it).
`--loopback` runs on the host's loopback instead, paced by the daemons' own `--bwlimit` and
`--peer-upload-limit`: bytes arrive in bursts (fewer, larger reads), and the swarm's store
path may not honour `--bwlimit`; a lower bound of the CPU.

Then the simulator (benchmarks/swarmsim.py) with this CPU model and `--cores` (default: this
machine's) against the swarm as measured in benchmarks/RESULTS.md ("Swarm: the piece
swarm"), and the flags that give benchmarks/swarm.py the same model (`--sim-...`).
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
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import benchlib as bl
import measure as ms
import netlab as nl
import swarmsim as sim
from swarm import METRICS_PORT, PEER_PORT, daemon_argv, pinned_ready
from swarmnet import Cpu, MiB, cpu_flags

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
ADDRS = ("127.0.0.2", "127.0.0.3")  # daemons a and b

#: benchmarks/RESULTS.md, "Swarm: the piece swarm" (commits 0834ae9, 3960086): 256.69 MiB,
#: 400 mbit links; (N, store egress in links) -> last node ready s, peers on and off.
MEASURED = {(8, 1): (16.4, 48.8), (8, 4): (14.7, 15.2), (16, 1): (26.9, 95.6),
            (16, 4): (30.0, 28.6)}  # fmt: skip
MEASURED_BYTES = int(256.69 * MiB)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, every thread, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metrics(addr: str) -> str | None:
    try:
        with _DIRECT.open(f"http://{addr}:{METRICS_PORT}/metrics", timeout=5) as r:
            return str(r.read().decode())
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

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def counter(self, key: str) -> float:
        text = metrics(self.addr) or ""
        value = bl.metric_value(text, bl.DAEMON_COUNTERS[key])
        return 0.0 if value != value else value

    def up(self, timeout: float = 60) -> tuple[float, float]:
        """(seconds from the spawn, CPU-s) when /metrics first answers."""
        t = wait(f"{self.name}'s /metrics", lambda: metrics(self.addr) is not None, timeout)
        return t - self.spawned, self.cpu()

    def ready(self, timeout: float = 300) -> tuple[float, float]:
        """(seconds from the spawn, CPU-s) when the pinned model is ready."""
        t = wait(f"{self.name}'s model", lambda: pinned_ready(metrics(self.addr) or ""), timeout)
        return t - self.spawned, self.cpu()


@dataclass(frozen=True)
class Calibration:
    """What was measured; `cpu(cores)` is the simulator's model from it."""

    startup: list[float]  # CPU-s per daemon, spawn to serving
    startup_s: list[float]  # seconds, the same
    recv_store: float  # CPU-s per MiB, daemon a (store only), hashing included
    recv_peer: float  # CPU-s per MiB, daemon b (nearly all from a), hashing included
    received_mib: tuple[float, float]  # a's, b's
    sent: float  # CPU-s per MiB a uploaded while b fetched
    sent_mib: float
    hash: float  # CPU-s per MiB, sha256 in this process
    ready_s: tuple[float, float]  # a's, b's: spawn to the model ready
    mode: str  # "tc" (a shaped loopback in a namespace) or "loopback" (self-paced)
    link: str

    def cpu(self, cores: float) -> Cpu:
        mib_a, mib_b = self.received_mib
        recv = (self.recv_store * mib_a + self.recv_peer * mib_b) / (mib_a + mib_b)
        startup = sum(self.startup) / len(self.startup)
        return Cpu(cores, recv=max(0.0, recv - self.hash), sent=self.sent, hash=self.hash,
                   startup=startup)  # fmt: skip


def hash_cost(mib: int = 256) -> float:
    """CPU-s per MiB of sha256 over 8 MiB buffers, as the daemon's hasher."""
    data, h = os.urandom(8 * MiB), hashlib.sha256()
    began = time.process_time()
    for _ in range(mib // 8):
        h.update(data)
    return (time.process_time() - began) / mib


def spawn(args: argparse.Namespace, workdir: Path, k: int, endpoint: str,
          env: dict[str, str], source: str, extra: list[str]) -> Daemon:  # fmt: skip
    """Daemon k (0 = a, 1 = b) on 127.0.0.(k + 2), pinning `source`, both daemons its peers."""
    name = "ab"[k]
    home = workdir / name
    (home / "kubelet-pods").mkdir(parents=True)
    (home / "models.yaml").write_text(f"models:\n  - source: {source}\n    pin: true\n")
    peers = ",".join(f"{a}:{PEER_PORT}" for a in ADDRS)
    argv = daemon_argv(args.exe, _Loopback(ADDRS[k]), home, endpoint, peers, extra)  # type: ignore[arg-type]
    with open(home / "daemon.log", "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, start_new_session=True)  # fmt: skip
    return Daemon(name, ADDRS[k], proc, time.monotonic())


@dataclass(frozen=True)
class _Loopback:
    """The part of a `netlab.Host` that `daemon_argv` uses."""

    addr: str

    def exec_prefix(self) -> list[str]:
        return []


def calibrate(args: argparse.Namespace, workdir: Path) -> Calibration:
    """The store and a model on it, then daemons a and b (see the module's docstring)."""
    model = bl.make_model(workdir / "model", bl.parse_size(args.size), name="swarmcal")
    link = nl.parse_rate(args.link) // 8
    # --loopback: the daemons pace themselves; in the namespace, tc paces every byte
    pace_a = ["--bwlimit", str(link), "--peer-upload-limit", str(link)] if args.loopback else []
    pace_b = ["--bwlimit", str(link // 50)] if args.loopback else []
    procs = []
    with nl.DevStore(workdir / "store") as store:
        bl.upload_model(model, store.endpoint_url, store.env)
        env = {**bl.peer_env(store.endpoint_url, store.env), "WEIGHTCACHE_PEER_TOKEN": "c" * 32}
        try:
            a = spawn(args, workdir, 0, store.endpoint_url, env, model.source, pace_a)
            procs.append(a.proc)
            up_a, boot_a = a.up()
            ready_a, done_a = a.ready()
            got_a = a.counter("origin_bytes") + a.counter("peer_bytes")
            sent0 = a.counter("peer_upload_bytes")
            b = spawn(args, workdir, 1, store.endpoint_url, env, model.source, pace_b)
            procs.append(b.proc)
            up_b, boot_b = b.up()
            a_at_up_b = a.cpu()
            ready_b, done_b = b.ready()
            serve_a, sent = a.cpu() - a_at_up_b, a.counter("peer_upload_bytes") - sent0
            got_b = b.counter("origin_bytes") + b.counter("peer_bytes")
            bl.log(f"b: {b.counter('peer_bytes') / MiB:.1f} MiB from a, "
                   f"{b.counter('origin_bytes') / MiB:.1f} MiB from the store")  # fmt: skip
        finally:
            ms.stop_processes(procs)
    return Calibration(
        [boot_a, boot_b], [up_a, up_b], (done_a - boot_a) / (got_a / MiB),
        (done_b - boot_b) / (got_b / MiB), (got_a / MiB, got_b / MiB),
        serve_a / max(sent / MiB, 1e-9), sent / MiB, hash_cost(), (ready_a, ready_b),
        "loopback" if args.loopback else "tc", args.link,
    )  # fmt: skip


def in_namespace(argv: list[str], link: str) -> int:
    """Run this script (`--inside`) in a new network namespace whose loopback is shaped to
    `link` (MTU 1500, as a link's packets); remove the namespace after. Returns its exit."""
    ns = f"wccal{secrets.token_hex(2)}"
    nl.run("ip", "netns", "add", ns)
    try:
        nl.run("ip", "-n", ns, "link", "set", "lo", "mtu", "1500", "up")
        nl.run("tc", "-n", ns, "qdisc", "replace", "dev", "lo", "root",
               *nl.tbf_args(nl.parse_rate(link)))  # fmt: skip
        cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--inside", *argv]
        return subprocess.run(cmd, check=False).returncode
    finally:
        nl.kill_netns_processes(ns)
        nl.run("ip", "netns", "del", ns, check=False)


def report(cal: Calibration) -> str:
    rows = [
        ["start-up (a, b)", " / ".join(f"{c:.2f}" for c in cal.startup), "CPU-s per daemon",
         " / ".join(f"{s:.1f} s" for s in cal.startup_s) + " spawn to /metrics"],
        ["received from the store (a)", f"{cal.recv_store:.5f}", "CPU-s per MiB",
         f"{cal.received_mib[0]:.0f} MiB, ready {cal.ready_s[0]:.1f} s from the spawn"],
        ["received from a peer (b)", f"{cal.recv_peer:.5f}", "CPU-s per MiB",
         f"{cal.received_mib[1]:.0f} MiB, ready {cal.ready_s[1]:.1f} s from the spawn"],
        ["sent to a peer (a)", f"{cal.sent:.5f}", "CPU-s per MiB", f"{cal.sent_mib:.0f} MiB"],
        ["sha256 (this process)", f"{cal.hash:.5f}", "CPU-s per MiB", "part of the received"],
    ]  # fmt: skip
    return ms.md_table(["what", "CPU", "unit", "note"], rows)


def compare(cpu: Cpu, piece: int) -> str:
    """The simulator with `cpu` (and without) against the measured swarm."""
    rows = []
    for (n, x), (on, off) in MEASURED.items():
        p = sim.Params(n, MEASURED_BYTES, piece, 400e6, x * 400e6, cpu=cpu)
        links = sim.Swarm(replace(p, cpu=Cpu())).run().last
        s_on, s_off = sim.Swarm(p).run().last, sim.peers_off(p).last
        for mode, got, want in (("peers on", on, s_on), ("peers off", off, s_off)):
            rows.append([n, f"{x}x", mode, f"{got:.1f}", f"{want:.1f}", f"{got / want:.2f}x"]
                        + ([f"{links:.1f}"] if mode == "peers on" else ["-"]))  # fmt: skip
    headers = ["N", "store egress", "mode", "measured last s", "simulated last s",
               "measured / sim", "links only, sim s"]  # fmt: skip
    return ms.md_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="256M", help="model bytes (default 256M)")
    ap.add_argument("--link", default="400mbit", help="the link's rate (default 400mbit)")
    ap.add_argument("--loopback", action="store_true", help="no namespace: loopback, no root")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cores", type=float, default=float(os.cpu_count() or 1),
                    help="the host's cores in the model (default: this machine's)")  # fmt: skip
    ap.add_argument("--piece", default="4M", help="the simulator's piece size (default 4M)")
    ap.add_argument("--json", type=Path, help="write the calibration here")
    ap.add_argument("--from-json", type=Path, help="a saved calibration: compare only")
    args = ap.parse_args()
    if not (args.from_json or args.loopback or args.inside):
        if os.geteuid() != 0:
            raise SystemExit("swarmcal.py needs root for its namespace; or use --loopback")
        raise SystemExit(in_namespace(sys.argv[1:], args.link))
    if args.from_json:
        saved: dict[str, Any] = json.loads(args.from_json.read_text())
        cal = Calibration(**{k: tuple(v) if k in ("received_mib", "ready_s") else v
                             for k, v in saved["calibration"].items()})  # fmt: skip
    else:
        args.exe = bl.available_tools(["weightcache"], required=True)[0]["weightcache"]
        with tempfile.TemporaryDirectory(prefix="wc-swarmcal-") as tmp:
            began = time.monotonic()
            cal = calibrate(args, Path(tmp))
            bl.log(f"calibrated in {time.monotonic() - began:.0f} s")
        if args.json:
            ms.write_json(args.json, {"calibration": asdict(cal),
                                      "cpu": asdict(cal.cpu(args.cores)),
                                      "machine": bl.machine_info(None)})  # fmt: skip
    cpu = cal.cpu(args.cores)
    print(f"\ncalibration ({cal.mode}, link {cal.link}); load average at the end "
          f"{os.getloadavg()[0]:.1f}:\n\n{report(cal)}\n")  # fmt: skip
    print(f"CPU model: {cpu.describe()}\n  swarmsim.py {cpu_flags(cpu)}\n  swarm.py "
          f"{cpu_flags(cpu, 'sim-')}\n")  # fmt: skip
    print("against benchmarks/RESULTS.md 'Swarm: the piece swarm' (256.69 MiB, 400 mbit, "
          "pieces of 4 MiB):\n")  # fmt: skip
    print(compare(cpu, bl.parse_size(args.piece)))


if __name__ == "__main__":
    main()
