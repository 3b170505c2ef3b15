"""Cold fetch from a directory (a file:// source, as from a mounted PVC): weightcache vs
`cp -r` vs `rsync -a`, same disk, page cache dropped before every run when allowed.

    python benchmarks/file_source.py --size 1G [--rounds 5] [--workdir DIR]

Writes one model (4 random shards + SHA256SUMS) under the work directory, then runs the
tools interleaved (A B C A B C ...), each into a fresh directory on the same disk; `+sync`
adds the `sync` after the copy (weightcache fsyncs what it publishes, cp and rsync do not).
weightcache also hashes every byte against SHA256SUMS; cp and rsync verify nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARDS = 4
CHUNK = 1 << 20


def write_model(root: Path, size: int) -> None:
    """SHARDS random shards of size/SHARDS bytes and their SHA256SUMS."""
    root.mkdir(parents=True)
    lines = []
    for i in range(SHARDS):
        name = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        digest = hashlib.sha256()
        with open(root / name, "wb") as f:
            for _ in range(size // SHARDS // CHUNK):
                block = os.urandom(CHUNK)
                digest.update(block)
                f.write(block)
        lines.append(f"{digest.hexdigest()}  {name}\n")
    (root / "SHA256SUMS").write_text("".join(lines))
    subprocess.run(["sync"], check=True)


def drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def commands(src: Path, dest: Path) -> dict[str, list[str]]:
    wc = [sys.executable, "-m", "weightcache", "fetch", f"file://{src}", "--no-daemon",
          "--cache-dir", str(dest)]  # fmt: skip
    return {
        "weightcache": wc,
        "cp -r": ["cp", "-r", str(src), str(dest)],
        "rsync -a": ["rsync", "-a", f"{src}/", str(dest)],
    }


def run_once(argv: list[str], dest: Path) -> tuple[float, float]:
    """(seconds of the command, seconds including the `sync` after it)."""
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    t1 = time.monotonic()
    subprocess.run(["sync"], check=True)
    t2 = time.monotonic()
    shutil.rmtree(dest)
    return t1 - t0, t2 - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wc-file-bench-", dir=args.workdir)).resolve()
    src = work / "volume" / "llama" / "v1"
    write_model(src, args.size << 20)
    times: dict[str, list[tuple[float, float]]] = {}
    dropped = True
    try:
        for r in range(args.rounds):
            for tool, argv in commands(src, work / "dest").items():
                dropped = drop_caches() and dropped
                times.setdefault(tool, []).append(run_once(argv, work / "dest"))
                print(f"round {r + 1} {tool}: {times[tool][-1][0]:.2f}s", file=sys.stderr)
    finally:
        shutil.rmtree(work)
    print(f"\n{args.size} MiB, {SHARDS} files, {args.rounds} rounds, page cache "
          f"{'dropped' if dropped else 'NOT dropped'} before each run; medians\n")  # fmt: skip
    print("| tool | seconds | MiB/s | seconds +sync | MiB/s +sync | verifies |")
    print("|---|---|---|---|---|---|")
    for tool, runs in times.items():
        bare = statistics.median(t for t, _ in runs)
        synced = statistics.median(t for _, t in runs)
        verifies = "sha256 of every byte" if tool == "weightcache" else "nothing"
        print(f"| {tool} | {bare:.2f} | {args.size / bare:.0f} | {synced:.2f} | "
              f"{args.size / synced:.0f} | {verifies} |")  # fmt: skip


if __name__ == "__main__":
    main()
