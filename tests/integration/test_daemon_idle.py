"""An idle daemon's cost does not grow with the revisions it caches (design §5, Capacity):
it surveys the cache (every marker read and parsed) when something changed on the cache's
disk, not at every --interval. Many small revisions are ordinary (LoRA adapters, per-tenant
fine-tunes). Measured as the read syscalls the daemon makes (/proc/PID/io), not as time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, CLI
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    wait_for,
    write_models,
)
from tests.support.cached import add_revision
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache

REVISIONS = 600
EVICTIONS = "weightcache_evictions_total"
INTERVALS = 8  # --interval is 0.5 s (daemon_helpers)


def read_syscalls(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError(f"no syscr in /proc/{pid}/io")


@pytest.mark.timeout(300)
def test_an_idle_daemon_does_not_read_every_marker_at_every_interval(
    wc: CLI, store: Any, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    cache = Cache(Layout.open(cache_dir))
    for i in range(REVISIONS):
        add_revision(cache, f"adapter{i}", "r1", 512, source=f"s3://{BUCKET}/lora/adapter{i}/r1")
    models = write_models(tmp_path / "models.yaml", [])
    # Room for the adapters, under the high watermark (0.95 x 350,000 bytes).
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url, capacity="350000")
    wait_for("the first survey", lambda: "Traceback" in daemon.log() or daemon.metrics()
             .get("weightcache_cache_bytes", 0) > 0)  # fmt: skip
    time.sleep(4)  # the start's converge and its capacity check are done; the blobs settled
    before = read_syscalls(daemon.proc.pid)
    time.sleep(INTERVALS * 0.5)
    reads = read_syscalls(daemon.proc.pid) - before
    # Reading the markers once is two reads each; an idle interval needs a few dozen.
    assert reads < REVISIONS, f"{reads} reads in {INTERVALS} idle intervals\n{daemon.log()}"

    # Something changes (a fetch alone adds a revision past the high watermark): the next
    # survey sees it and evicts the least recently used adapters.
    assert daemon.metrics().get(EVICTIONS) == 0, daemon.log()
    add_revision(cache, "base", "r1", 100_000, used_at=time.time(), source=f"s3://{BUCKET}/b/r1")
    wait_for("adapters to be evicted", lambda: daemon.metrics().get(EVICTIONS, 0) > 0)
    assert (cache_dir / "base" / "r1" / ".weightcache").is_file()
    assert daemon.alive(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()
