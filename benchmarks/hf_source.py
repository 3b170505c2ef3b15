"""Cold fetch from the Hugging Face Hub (an hf:// source): weightcache vs `hf download`,
against the same Hub on loopback (tests/support/hubserver.py: the Hub's metadata, resolve
and LFS-storage endpoints, LFS files served with sendfile), in one run.

    python benchmarks/hf_source.py --size 1024 [--rounds 3] [--workdir DIR]

One repository of 4 LFS shards (--size MiB in all) is committed to the loopback Hub; the
tools then run interleaved (A B A B ...), each into a fresh directory on the same disk:
weightcache `fetch hf://org/bench@<commit> --no-daemon` (parallel ranged GETs, every byte
hashed against the LFS sha256) and `hf download org/bench --revision <commit> --local-dir`
(one stream per file, sizes checked). The storage is served from the page cache, so the
numbers are the clients' (CPU, connections, writes), not a WAN's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import measure as ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from tests.support.hubserver import HubServer

SHARDS = 4
REPO = "org/bench"


def commit_model(hub: HubServer, size: int) -> str:
    """SHARDS random LFS shards of size/SHARDS bytes; the commit id."""
    files = {
        f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors": os.urandom(size // SHARDS)
        for i in range(SHARDS)
    }
    return hub.add_commit(REPO, files)


def commands(commit: str, dest: Path) -> dict[str, list[str]]:
    hf = shutil.which("hf")
    hf_argv = [hf] if hf else [sys.executable, "-m", "huggingface_hub.cli.hf"]
    return {
        "weightcache": [sys.executable, "-m", "weightcache", "fetch", f"hf://{REPO}@{commit}",
                        "--no-daemon", "--cache-dir", str(dest)],
        "hf download": [*hf_argv, "download", REPO, "--revision", commit,
                        "--local-dir", str(dest)],
    }  # fmt: skip


def check(dest: Path, size: int) -> str | None:
    """A problem with what the tool left, or None."""
    files = [p for p in dest.rglob("*.safetensors") if ".cache" not in p.parts]
    got = sum(p.stat().st_size for p in files)
    return None if len(files) == SHARDS and got == size else f"{len(files)} files, {got} bytes"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wc-hf-bench-", dir=args.workdir)).resolve()
    hub = HubServer(work / "hub").start()
    size = args.size << 20
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(work / "hf-home"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    env.pop("HF_TOKEN", None)
    runs: dict[str, list[ms.Run]] = {}
    try:
        commit = commit_model(hub, size)
        for r in range(args.rounds):
            for tool, argv in commands(commit, work / "dest").items():
                run = ms.run_measured(tool, argv, env, work / "logs", timeout=1800)
                run.problem = run.problem or check(work / "dest", size)
                runs.setdefault(tool, []).append(run)
                print(f"round {r + 1} {tool}: {run.wall_s:.2f}s ok={run.ok}", file=sys.stderr)
                if not run.ok:
                    print(run.problem, run.stderr_tail, file=sys.stderr)
                shutil.rmtree(work / "dest", ignore_errors=True)
                shutil.rmtree(work / "hf-home", ignore_errors=True)
    finally:
        hub.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.size} MiB, {SHARDS} LFS files, {args.rounds} rounds, loopback Hub\n")
    rows = []
    for tool, done in runs.items():
        wall = [x.wall_s for x in done]
        verifies = "sha256 of every byte" if tool == "weightcache" else "sizes"
        rows.append([tool, f"{sum(x.ok for x in done)}/{len(done)}",
                     ms.fmt_num(ms.median(wall)), ms.fmt_num(ms.p90(wall)),
                     f"{args.size / ms.median(wall):.0f}",
                     ms.fmt_num(ms.median([x.cpu_s for x in done])),
                     f"{ms.median([x.maxrss_mib for x in done]):.0f}", verifies])  # fmt: skip
    print(ms.md_table(["tool", "ok", "wall s (median)", "wall s (p90)", "MiB/s", "CPU s",
                       "peak RSS MiB", "verifies"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
