"""One peer serving one complete blob to one client on loopback: throughput and the
server's CPU time (design §8, Peers: requests).

The server is a `PeerServer` in a child process (no upload limit) with one blob of
`--size` bytes in a throwaway cache; the client (this process) reads the whole blob with
`http.client` into one reused buffer, `--rounds` times. The server's CPU is read from
/proc/PID/stat around each round. `--code DIR` runs the server from another checkout of
the package (for example the code before sendfile, exported with `git archive`), so two
versions compare on the same machine:

    python benchmarks/peer_serve.py --size 1G --rounds 5
    git archive <commit> weightcache | tar -x -C /tmp/old
    python benchmarks/peer_serve.py --size 1G --rounds 5 --code /tmp/old
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKEN = "benchmark-token-0123456789abcdef"
SHA = "ab" * 32  # the served file's name; nothing checks it (the client does not hash)

SERVER = """
import sys, threading
import weightcache
print(weightcache.__file__, file=sys.stderr)
from weightcache.cache.layout import Layout
from weightcache.config import PeerSettings
from weightcache.swarm.client import Peers
from weightcache.swarm.server import PeerServer
from weightcache.listeners.http import LoopThread

class Quiet:
    def peer_uploaded(self, n): pass
    def peer_streamed(self, n): pass
    def peer_refused(self, reason): pass

settings = PeerSettings(("127.0.0.1", 0), sys.argv[2], upload_limit=None)
layout = Layout.open(sys.argv[1])
server = PeerServer(settings, layout, Peers(settings), Quiet())
loop = LoopThread()
loop.run(server.start())
print(server.address[1], flush=True)
threading.Event().wait()
"""


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, every thread, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(port: int, size: int, pid: int) -> tuple[float, float]:
    """(seconds, server CPU seconds) for one GET of the whole blob."""
    buf = memoryview(bytearray(4 << 20))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    conn.request("GET", f"/blobs/sha256/{SHA}", headers={"Authorization": f"Bearer {TOKEN}"})
    resp = conn.getresponse()
    got = 0
    while n := resp.readinto(buf):
        got += n
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    conn.close()
    if resp.status != 200 or got != size:
        raise SystemExit(f"bad response: HTTP {resp.status}, {got} of {size} bytes")
    return elapsed, cpu


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--code", type=Path, default=REPO, help="checkout the server runs from")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="peer-serve-") as tmp:
        blobs = Path(tmp) / "cache" / ".weightcache" / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        with (blobs / SHA).open("wb") as f:
            for _ in range(args.size >> 20):
                f.write(os.urandom(1 << 20))
            f.write(os.urandom(args.size & ((1 << 20) - 1)))
        env = {**os.environ, "PYTHONPATH": str(args.code.resolve())}
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(Path(tmp) / "cache"), TOKEN],
                                  env=env, cwd=tmp, stdout=subprocess.PIPE,
                                  text=True)  # fmt: skip  # cwd: not this checkout's package
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            one_round(port, args.size, server.pid)  # warm the page cache
            results = [one_round(port, args.size, server.pid) for _ in range(args.rounds)]
        finally:
            server.terminate()
            server.wait()
    rates = [args.size / s / (1 << 20) for s, _ in results]
    cpus = [c for _, c in results]
    print(f"server code: {args.code.resolve()}")
    print(f"blob {args.size} bytes, {args.rounds} rounds")
    print("rounds MiB/s:", " ".join(f"{r:.0f}" for r in rates))
    print("rounds server CPU s:", " ".join(f"{c:.2f}" for c in cpus))
    print(f"median {statistics.median(rates):.0f} MiB/s, server CPU "
          f"{statistics.median(cpus):.2f} s per blob")  # fmt: skip


if __name__ == "__main__":
    main()
