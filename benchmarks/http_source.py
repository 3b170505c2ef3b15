"""Cold fetch from a web server (an http:// source): weightcache vs `curl` vs `wget`, the
same files from the same nginx on loopback, page cache dropped before every run when allowed.

    python benchmarks/http_source.py --size 1024 [--rounds 5] [--workdir DIR]

Writes one model (4 random shards + SHA256SUMS) under the work directory, serves it with
nginx (tests/support/webservers.py: Debian's nginx, sendfile, keep-alive), then runs the
tools interleaved (A B C D A B C D ...), each into a fresh directory on the same disk;
`+sync` adds the `sync` after the download (weightcache fsyncs what it publishes, curl and
wget do not). weightcache reads each file with parallel ranged GETs and hashes every byte
against SHA256SUMS; `curl -Z` fetches the files in parallel, one GET each; `wget -i` one
after the other. Neither verifies anything. The last row, weightcache reading the served
directory itself (file://), is what the fetch costs without HTTP (hashing, fsync).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import benchlib  # noqa: F401 - puts the repository on sys.path
from file_source import SHARDS, drop_caches, run_once, write_model

from tests.support.webservers import Nginx


def commands(url: str, src: Path, names: list[str], dest: Path) -> dict[str, list[str]]:
    wc = [sys.executable, "-m", "weightcache", "fetch", url, "--no-daemon",
          "--cache-dir", str(dest)]  # fmt: skip
    urls = [f"{url}/{n}" for n in names]
    curl = ["curl", "-sSf", "--no-progress-meter", "-Z", "--parallel-max", str(len(urls)),
            "--create-dirs",
            "--output-dir", str(dest)] + [a for u in urls for a in ("-O", u)]  # fmt: skip
    wget = ["wget", "-q", "-P", str(dest), *urls]
    # The same fetch from the served directory itself: what the fetch costs without HTTP.
    local = [*wc[:4], f"file://{src}", *wc[5:]]
    return {"weightcache": wc, "curl -Z": curl, "wget": wget, "weightcache file://": local}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wc-http-bench-", dir=args.workdir)).resolve()
    src = work / "served" / "llama" / "v1"
    write_model(src, args.size << 20)
    names = sorted(f.name for f in src.iterdir())
    (work / "nginx").mkdir()
    nginx = Nginx(work / "served", work / "nginx").start()
    times: dict[str, list[tuple[float, float]]] = {}
    dropped = True
    try:
        for r in range(args.rounds):
            dest = work / "dest"
            for tool, argv in commands(f"{nginx.url}/llama/v1", src, names, dest).items():
                dropped = drop_caches() and dropped
                times.setdefault(tool, []).append(run_once(argv, dest))
                print(f"round {r + 1} {tool}: {times[tool][-1][0]:.2f}s", file=sys.stderr)
    finally:
        nginx.stop()
        shutil.rmtree(work)
    print(f"\n{args.size} MiB, {SHARDS} files + SHA256SUMS from nginx on loopback, "
          f"{args.rounds} rounds, page cache {'dropped' if dropped else 'NOT dropped'} "
          "before each run; medians\n")  # fmt: skip
    print("| tool | seconds | MiB/s | seconds +sync | MiB/s +sync | verifies |")
    print("|---|---|---|---|---|---|")
    for tool, runs in times.items():
        bare = statistics.median(t for t, _ in runs)
        synced = statistics.median(t for _, t in runs)
        verifies = "sha256 of every byte" if tool.startswith("weightcache") else "nothing"
        print(f"| {tool} | {bare:.2f} | {args.size / bare:.0f} | {synced:.2f} | "
              f"{args.size / synced:.0f} | {verifies} |")  # fmt: skip


if __name__ == "__main__":
    main()
