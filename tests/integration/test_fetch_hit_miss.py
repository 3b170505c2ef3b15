"""`fetch` miss then hit against the real store through the proxy (design §2.2, §3, §4)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published, cli_env, dead_endpoint
from tests.support.checks import (
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024
#: Libraries a hit must not load: each costs tens of milliseconds to import, and finding a
#: marked revision needs none of them (design §4).
HEAVY = ("boto3", "botocore", "yaml", "prometheus_client", "aiohttp", "fsspec")
#: `python -m weightcache ARGS`, printing on stderr, as it exits, the modules it loaded.
WITH_MODULES = (
    "import atexit, json, runpy, sys\n"
    "atexit.register(lambda: print('modules:', json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
    "sys.argv[0] = 'weightcache'\n"
    "runpy.run_module('weightcache', run_name='__main__', alter_sys=True)\n"
)
#: `python -m weightcache ARGS`, printing on stderr the modules it had loaded when its first
#: GET of a model's file (not the listing, not SHA256SUMS; a small file's as well as a
#: shard's, as benchmarks/cold_fetch.py counts it) went out, and how many passes the garbage
#: collector had made since the script started.
AT_FIRST_GET = (
    "import gc, json, runpy, sys\n"
    "def passes():\n"
    "    return sum(s['collections'] for s in gc.get_stats())\n"
    "def hook(event, args):\n"
    "    data = args[1] if event == 'http.client.send' else b''\n"
    "    line = data.split(b'\\r\\n')[0] if isinstance(data, bytes) else b''\n"
    "    data_get = b'SHA256SUMS' not in line and b'list-type=' not in line\n"
    "    if line.startswith(b'GET ') and data_get and not hook.seen:\n"
    "        hook.seen = True\n"
    "        print('collections:', passes() - hook.start, file=sys.stderr)\n"
    "        print('modules:', json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    "hook.seen = False\n"
    "hook.start = passes()\n"
    "sys.addaudithook(hook)\n"
    "import atexit\n"
    "atexit.register(lambda: print('frozen:', gc.get_freeze_count(), file=sys.stderr))\n"
    "sys.argv[0] = 'weightcache'\n"
    "runpy.run_module('weightcache', run_name='__main__', alter_sys=True)\n"
)
#: What a cold fetch loads only after its first data GET is out, if at all: the other
#: commands, the fetch of a revision without SHA256SUMS (and its HEADs' thread pool),
#: ctypes (the writeback hint), the marker (written after the download), the idna codec
#: (ASCII host names need none), ElementTree (expat alone reads the listing), queue (the
#: workers take their parts from a deque). sqlite3 is imported by the thread that creates
#: state.db while the store answers: before the first GET, but off its path.
NOT_BEFORE_FIRST_GET = (
    "weightcache.cli.admin", "weightcache.cli.node", "weightcache.fetch.vouched", "ctypes",
    "xml.dom", "weightcache.daemon.daemon", "weightcache.ops", "s3transfer",
    "concurrent.futures", "weightcache.cache.marker", "encodings.idna", "stringprep",
    "unicodedata", "xml.etree", "queue",
)  # fmt: skip
#: Of the operator commands (weightcache.ops), a cold fetch loads only its own policy.
FETCH_OPS = ("weightcache.ops", "weightcache.ops.fetching")
#: Passes of the garbage collector a cold fetch may make before its first data GET: its
#: imports and set-up make objects that live on, so it runs only once the download starts.
PASSES_BEFORE_FIRST_GET = 8
SLACK = 64 * 1024  # manifest, listing and error bodies on top of the model's bytes

pytestmark = pytest.mark.timeout(180)


def measured(
    wc: CLI, script: str, args: list[str], env: dict[str, Any] | None = None, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`weightcache ARGS` run under `script` (WITH_MODULES, AT_FIRST_GET), which prints the
    modules it saw loaded as a `modules: <json>` line on stderr; (the process, those
    modules)."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], env=cli_env(wc.store, env),
        cwd=wc.cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    line = next((x for x in proc.stderr.splitlines() if x.startswith("modules: ")), None)
    assert line is not None, describe(proc)
    return proc, json.loads(line.removeprefix("modules: "))


def test_miss_then_hit_needs_no_network(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([3 * MiB, 1 * MiB, 2 * MiB + 17], name="tiny", rev="2026-01-01")
    expected = pub.local_path(cache_dir)

    miss = wc.fetch(pub.source, cache_dir, "--part-size", "1M", endpoint=proxy.url)
    assert_ok_path(miss, expected)
    assert_revision_ok(cache_dir, "tiny", "2026-01-01", pub.model)
    assert_linked_to_blobs(cache_dir, "tiny", "2026-01-01", pub.model)
    assert markers(cache_dir) == [expected / ".weightcache"]
    s = proxy.stats()
    assert pub.model.total_size <= s.body_bytes <= pub.model.total_size + SLACK, s

    proxy.reset_stats()
    hit = wc.fetch(pub.source, cache_dir, endpoint=proxy.url)
    assert_ok_path(hit, expected)
    assert proxy.stats().requests == 0, "a hit talked to the object store"

    # The store is unreachable: a warm node must still start its Pods (invariant 3).
    down = dead_endpoint()
    hit = wc.fetch(pub.source, cache_dir, endpoint=down, timeout=30)
    assert_ok_path(hit, expected)
    proxy.set_down("refuse")
    hit = wc.fetch(pub.source, cache_dir, "--timeout", "2s", endpoint=proxy.url, timeout=30)
    assert_ok_path(hit, expected)
    assert_revision_ok(cache_dir, "tiny", "2026-01-01", pub.model)


def test_json_output_for_miss_and_hit(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([2 * MiB, 2 * MiB], name="j", rev="v1")
    expected = pub.local_path(cache_dir)

    miss = wc.fetch(pub.source, cache_dir, "--json", endpoint=proxy.url)
    assert miss.returncode == 0, describe(miss)
    assert miss.stdout.count("\n") <= 1 and miss.stdout.strip(), describe(miss)
    doc = json.loads(miss.stdout)
    assert isinstance(doc, dict), doc
    assert {"path", "hit", "bytes_from_origin", "seconds", "throughput"} <= set(doc), doc
    assert Path(doc["path"]).resolve() == expected.resolve()
    assert doc["hit"] is False
    size = pub.model.total_size
    assert size <= doc["bytes_from_origin"] <= size + SLACK, doc
    assert doc["bytes_from_origin"] <= proxy.stats().body_bytes, "more bytes than were sent"
    assert 0 < doc["seconds"] < 120, doc
    assert doc["throughput"] == pytest.approx(doc["bytes_from_origin"] / doc["seconds"],
                                              rel=0.05), doc  # fmt: skip

    hit = wc.fetch(pub.source, cache_dir, "--json", endpoint=dead_endpoint())
    assert hit.returncode == 0, describe(hit)
    doc = json.loads(hit.stdout)
    assert Path(doc["path"]).resolve() == expected.resolve()
    assert doc["hit"] is True
    assert doc["bytes_from_origin"] == 0
    assert doc["seconds"] >= 0 and doc["throughput"] >= 0


def test_hit_is_fast(
    wc: CLI, publish: Callable[..., Published], store: object, cache_dir: Path
) -> None:
    """A hit takes a few tens of ms past the interpreter's start (benchmarks/hit_latency.py
    measures it); this guards against it doing real work, bounded past the start of a bare
    `python -c pass` measured alongside, so that a loaded machine does not fail it."""
    pub = publish([64 * 1024], name="fast", rev="r")
    assert wc.fetch(pub.source, cache_dir).returncode == 0
    best, floor = float("inf"), float("inf")
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        floor = min(floor, time.monotonic() - t0)
        t0 = time.monotonic()
        hit = wc.fetch(pub.source, cache_dir, endpoint=dead_endpoint())
        best = min(best, time.monotonic() - t0)
        assert_ok_path(hit, pub.local_path(cache_dir))
    assert best - floor < 0.5, f"fastest of 3 hits took {best:.3f} s, python -c pass {floor:.3f} s"


def test_hit_loads_no_heavy_library(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    """Measured inside the hit's own process, through the real entry point."""
    pub = publish([64 * 1024], name="light", rev="r")
    assert wc.fetch(pub.source, cache_dir).returncode == 0
    down = dead_endpoint()
    args = wc.fetch_args(pub.source, cache_dir, endpoint=down)
    hit, loaded = measured(wc, WITH_MODULES, args, {"AWS_ENDPOINT_URL": down}, timeout=60)
    assert_ok_path(hit, pub.local_path(cache_dir))
    assert "weightcache.fetch" in loaded, loaded  # the measurement saw the hit path
    heavy = sorted({m.split(".")[0] for m in loaded} & set(HEAVY))
    assert heavy == [], f"a hit imported {heavy}"


def _miss_modules(wc: CLI, source: str, cache: Path, env: dict[str, str | None]) -> set[str]:
    """The top-level packages a miss loaded, measured inside its own process."""
    args = wc.fetch_args(source, cache, endpoint=wc.store.endpoint_url)
    miss, loaded = measured(wc, WITH_MODULES, args, env)
    assert miss.returncode == 0, describe(miss)
    assert "weightcache.transfer.downloader" in loaded, loaded  # the measurement saw a miss
    return {m.split(".")[0] for m in loaded}


def test_a_cold_fetch_loads_only_what_its_first_get_needs(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    """Every import before the first data GET delays it (design §4): by then a cold fetch
    has loaded the control plane (the listing, SHA256SUMS) and the data plane, nothing
    else, and the garbage collector has not traversed what they made. And its exit spares
    the teardown's collection of every object."""
    pub = publish([300 * 1024, 64 * 1024], name="first", rev="r")
    args = wc.fetch_args(pub.source, cache_dir, endpoint=wc.store.endpoint_url)
    miss, modules = measured(wc, AT_FIRST_GET, args)
    assert_ok_path(miss, pub.local_path(cache_dir))
    loaded = set(modules)
    assert "weightcache.transfer.downloader" in loaded, sorted(loaded)  # it saw the first GET
    early = sorted(m for m in loaded - set(FETCH_OPS) for n in (*NOT_BEFORE_FIRST_GET, *HEAVY)
                   if m == n or m.startswith(f"{n}."))  # fmt: skip
    assert early == [], f"loaded before the first data GET: {early}"
    passes = next(x for x in miss.stderr.splitlines() if x.startswith("collections: "))
    assert int(passes.removeprefix("collections: ")) <= PASSES_BEFORE_FIRST_GET, miss.stderr
    # Its objects are out of the teardown's garbage collection: the exit is quicker.
    frozen = next(x for x in miss.stderr.splitlines() if x.startswith("frozen: "))
    assert int(frozen.removeprefix("frozen: ")) > 0, miss.stderr


def test_the_way_to_the_first_get_imports_no_sqlite3(tmp_path: Path) -> None:
    """sqlite3 is imported where it is used: by a cold fetch, in the thread that creates
    state.db while the store answers (design §4), not by the modules it imports first."""
    path = (
        "weightcache.cli.fetching",
        "weightcache.ops.fetching",
        "weightcache.fetch",
        "weightcache.cache.alone",
        "weightcache.transfer.backends.s3.client",
        "weightcache.transfer.downloader",
    )
    code = f"import sys, {', '.join(path)}; print('sqlite3' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path)  # fmt: skip
    assert proc.stdout.strip() == "False", describe(proc)


def test_a_miss_with_static_credentials_loads_no_boto(
    wc: CLI, publish: Callable[..., Published], tmp_path: Path
) -> None:
    """botocore's imports and S3 model were most of a cold fetch's time before its first
    GET: with credentials in the environment and an endpoint, the list, the manifest and
    the presigned data GETs are signed without it. Credentials from a shared file still go
    through boto3's chain, and work."""
    pub = publish([300 * 1024, 64 * 1024], name="noboto", rev="r")
    loaded = _miss_modules(wc, pub.source, tmp_path / "env", {})
    assert not loaded & {"boto3", "botocore", "s3transfer"}, sorted(loaded)
    assert_revision_ok(tmp_path / "env", "noboto", "r", pub.model)

    env = wc.store.env
    shared = tmp_path / "credentials"
    shared.write_text(f"[default]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
                      f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")  # fmt: skip
    from_file = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
                 "AWS_SHARED_CREDENTIALS_FILE": str(shared)}  # fmt: skip
    loaded = _miss_modules(wc, pub.source, tmp_path / "file", from_file)
    assert "botocore" in loaded, sorted(loaded)
    assert_revision_ok(tmp_path / "file", "noboto", "r", pub.model)


def test_endpoint_flag_and_environment(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, tmp_path: Path
) -> None:
    """--endpoint-url wins over AWS_ENDPOINT_URL; WEIGHTCACHE_ENDPOINT_URL and
    AWS_ENDPOINT_URL each work alone; WEIGHTCACHE_CACHE_DIR replaces --cache-dir."""
    pub = publish([256 * 1024], name="env", rev="r")
    size = pub.model.total_size

    def fetched_via_proxy(proc: object, cache: Path) -> None:
        assert_ok_path(proc, pub.local_path(cache))  # type: ignore[arg-type]
        assert size <= proxy.stats().body_bytes <= size + SLACK
        proxy.reset_stats()

    cache = tmp_path / "c1"
    proc = wc.run("fetch", pub.source, "--cache-dir", cache, "--endpoint-url", proxy.url,
                  env={"AWS_ENDPOINT_URL": dead_endpoint()})  # fmt: skip
    fetched_via_proxy(proc, cache)

    cache = tmp_path / "c2"
    env = {"AWS_ENDPOINT_URL": None, "WEIGHTCACHE_ENDPOINT_URL": proxy.url}
    proc = wc.run("fetch", pub.source, "--cache-dir", cache, env=env)
    fetched_via_proxy(proc, cache)

    cache = tmp_path / "c3"
    proc = wc.run("fetch", pub.source, "--cache-dir", cache,
                  env={"AWS_ENDPOINT_URL": proxy.url})  # fmt: skip
    fetched_via_proxy(proc, cache)

    cache = tmp_path / "c4"
    proc = wc.run("fetch", pub.source, env={"AWS_ENDPOINT_URL": proxy.url,
                                            "WEIGHTCACHE_CACHE_DIR": str(cache)})  # fmt: skip
    fetched_via_proxy(proc, cache)


def test_name_and_revision_options(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([100_000], name="upstream-name", rev="abc123")
    proc = wc.fetch(pub.source, cache_dir, "--name", "served", "--revision", "prod")
    assert_ok_path(proc, cache_dir / "served" / "prod")
    assert_revision_ok(cache_dir, "served", "prod", pub.model)
    assert not (cache_dir / "upstream-name").exists()
