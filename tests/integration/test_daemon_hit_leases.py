"""A Pod's hit leases its revision through the daemon (a Pod on a read-only mount cannot
write its own lease), and nothing more (design §5, The fetch socket): the socket is open to
every Pod on the node, so a hit naming a source the revision was not fetched from, or a
source outside `--allow-source`, leases nothing, and one Pod's leases are bounded: a Pod
cannot keep every cached revision from eviction. Real daemon, real socket."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, CLI
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    ls_json,
    wait_for,
    write_models,
)
from tests.support.cached import add_revision
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache
from weightcache.daemon.coordinator import LEASES_PER_POD

POD = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
HITS = 'weightcache_fetches_total{result="hit"}'


def hit(socket_path: Path, source: str, pod_uid: str = POD) -> None:
    line = {"op": "hit", "source": source, "name": None, "revision": None, "pod_uid": pod_uid}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(socket_path))
        s.sendall(json.dumps(line).encode() + b"\n")
        s.recv(100)  # until the daemon closes it: the hit was handled


def leased(wc: CLI, cache_dir: Path) -> set[tuple[str, str]]:
    return {key for key, row in ls_json(wc, cache_dir).items() if POD in row["leases"]}


@pytest.mark.timeout(240)
def test_a_hit_leases_only_its_own_allowed_source_and_a_pods_leases_are_bounded(
    wc: CLI, store: Any, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    cache = Cache(Layout.open(cache_dir))
    count = LEASES_PER_POD + 6
    sources = {f"m{i}": f"s3://{BUCKET}/team/m{i}/r1" for i in range(count)}
    for name, source in sources.items():
        add_revision(cache, name, "r1", 1024, source=source)
    add_revision(cache, "outside", "r1", 1024, source="s3://elsewhere/team/outside/r1")
    (tmp_path / "pods" / POD).mkdir(parents=True)  # the Pod lives: its leases stay
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url)
    sock = cache_dir / ".weightcache" / "daemon.sock"

    hit(sock, "s3://anything/m0/r1")  # not the source m0/r1 was fetched from
    hit(sock, f"s3://{BUCKET}/other-team/m1/r1")  # allowed, but not m1/r1's source either
    hit(sock, "s3://elsewhere/team/outside/r1")  # its own source, outside --allow-source
    wait_for("three hits counted", lambda: daemon.metrics().get(HITS) == 3)
    assert leased(wc, cache_dir) == set(), daemon.log()

    for source in sources.values():
        hit(sock, source)
    wait_for("every hit counted", lambda: daemon.metrics().get(HITS) == 3 + count)
    held = leased(wc, cache_dir)
    assert len(held) == LEASES_PER_POD, sorted(held)
    assert ("m0", "r1") in held
    hit(sock, sources["m0"])  # a revision it holds already is leased again, not refused
    assert len(leased(wc, cache_dir)) == LEASES_PER_POD
    assert "Traceback" not in daemon.log(), daemon.log()
