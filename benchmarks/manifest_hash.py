"""Hashing one large object in the store: `weightcache manifest` vs `aws s3 cp - | sha256sum`.

    python benchmarks/manifest_hash.py [--size 1G] [--rounds 3] [--part-size 16M]

Starts a throwaway SeaweedFS (`DevStore`) on loopback, uploads one object of random bytes
(no SHA256SUMS), then per round, alternating which goes first:
- `weightcache manifest s3://models/bench-manifest/m/r1` (ranged GETs in parallel, hashed
  in order, no local copy; this checkout's code);
- `aws s3 cp s3://models/bench-manifest/m/r1/model.bin - | sha256sum` (awscli v1 from
  setup.sh; `set -o pipefail`).
Both digests are checked against the one computed while generating. Prints a table of
medians (wall, CPU, peak RSS). A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

from benchlib import (
    BUCKET,
    REPO,
    _aws_binary,
    fmt_size,
    log,
    parse_size,
    peer_env,
    s3_client,
)
from measure import Run, fmt_num, md_table, median, run_measured

PREFIX = "bench-manifest/m/r1"


def make_object(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 8 << 20))
            f.write(block)
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def upload(path: Path, endpoint: str, env: dict[str, str]) -> None:
    from boto3.s3.transfer import TransferConfig

    client = s3_client(endpoint, env)
    config = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=4)
    client.upload_file(str(path), BUCKET, f"{PREFIX}/model.bin", Config=config)


def commands(aws: str, part_size: str) -> dict[str, list[str]]:
    source = f"s3://{BUCKET}/{PREFIX}"
    pipe = f"set -o pipefail; {aws} s3 cp {source}/model.bin - | sha256sum"
    return {
        "weightcache manifest": [
            *(sys.executable, "-m", "weightcache", "-q", "manifest", source),
            *("--part-size", part_size),
        ],
        "aws s3 cp - | sha256sum": ["bash", "-c", pipe],
    }


def check(run: Run, digest: str) -> Run:
    if run.returncode == 0 and not run.stdout_tail.startswith(digest):
        run.problem = f"digest {run.stdout_tail[:64]!r} is not {digest}"
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1G", help="object size (default 1G = 1 GiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part-size", default="16M", help="weightcache --part-size")
    args = parser.parse_args()
    aws = _aws_binary()
    if aws is None:
        sys.exit("awscli not found: run benchmarks/setup.sh")
    from weightcache.ops.devstore import DevStore

    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="wc-manifest-bench-") as tmp, DevStore(
        Path(tmp) / "store"
    ) as store:  # fmt: skip
        env = peer_env(store.endpoint_url, store.env)
        env["PYTHONPATH"] = str(REPO)
        local = Path(tmp) / "model.bin"
        digest = make_object(local, size)
        upload(local, store.endpoint_url, env)
        local.unlink()
        log(f"uploaded {fmt_size(size)} (sha256 {digest[:12]}...) to {store.endpoint_url}")
        runs: dict[str, list[Run]] = {}
        cmds = commands(aws, args.part_size)
        for i in range(args.rounds):
            order = list(cmds) if i % 2 == 0 else list(reversed(cmds))
            for n, tool in enumerate(order):
                logs = Path(tmp) / "logs" / f"round{i}-{n}"
                run = check(run_measured(tool, cmds[tool], env, logs), digest)
                run.round = i
                log(f"round {i} {tool}: {run.wall_s:.2f}s ok={run.ok} {run.problem or ''}")
                runs.setdefault(tool, []).append(run)
    rows = []
    for tool, rs in runs.items():
        ok = [r for r in rs if r.ok]
        wall = median([r.wall_s for r in ok])
        rows.append([
            tool, f"{len(ok)}/{len(rs)}", fmt_num(wall), fmt_num(size / wall / 2**20, 0),
            fmt_num(median([r.cpu_s for r in ok])), fmt_num(median([r.maxrss_mib for r in ok]), 0),
        ])  # fmt: skip
    print(f"hash one {fmt_size(size)} object, {args.rounds} rounds, medians")
    print(md_table(["tool", "ok", "wall s", "MiB/s", "CPU s", "peak RSS MiB"], rows))


if __name__ == "__main__":
    main()
