"""Pods mount the cache read-only and ask the node daemon (initcontainer/):
a miss is downloaded by the daemon, a hit is leased by it, and without a daemon a miss is
one line saying why (exit 2). Real read-only bind mounts (root)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (  # noqa: F401
    Daemons,
    daemons,
    ls_json,
    wait_for,
    write_models,
)
from tests.integration.test_cli_environment import read_only_view  # noqa: F401
from tests.support.checks import assert_fails, assert_ok_path, assert_revision_ok, describe
from tests.support.faultproxy import FaultProxy

KiB = 1024
POD_MISS = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
POD_HIT = "7d1e9b3a-2c4f-4a6e-8b0d-5f3a1c9e7b26"


@pytest.mark.timeout(180)
def test_pods_on_a_read_only_cache_fetch_and_lease_through_the_daemon(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
    read_only_view: Callable[[Path], Path],  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([256 * KiB, 64 * KiB], name="ro", rev="r1", seed="ro")
    other = publish([64 * KiB], name="ro", rev="r2", seed="ro2")
    for pod in (POD_MISS, POD_HIT):
        (tmp_path / "pods" / pod).mkdir(parents=True)
    daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", []),
                           endpoint=proxy.url)  # fmt: skip
    ro = read_only_view(cache_dir)

    # A miss on the read-only view: the daemon downloads; the path is the Pod's own mount.
    miss = wc.fetch(pub.source, ro, "--json", env={"POD_UID": POD_MISS})
    assert miss.returncode == 0, describe(miss)
    answer = json.loads(miss.stdout)
    assert (answer["path"], answer["hit"]) == (str(pub.local_path(ro)), False), answer
    assert answer["bytes_from_origin"] == pub.model.total_size, answer
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)

    # A hit on the read-only view: the Pod cannot write its lease, the daemon records it.
    hit = wc.fetch(pub.source, ro, env={"POD_UID": POD_HIT})
    assert_ok_path(hit, pub.local_path(ro))

    def leases() -> set[str]:
        return set(ls_json(wc, cache_dir)[(pub.name, pub.rev)]["leases"])

    wait_for("the hit's lease in state.db", lambda: POD_HIT in leases(), timeout=15, every=0.2)
    assert leases() == {POD_MISS, POD_HIT}, (leases(), daemon.log())

    # Without a daemon, a miss on the read-only view is one line saying why.
    daemon.terminate()
    assert daemon.wait(timeout=60) == 0, daemon.log()
    message = assert_fails(wc.fetch(other.source, ro, env={"POD_UID": POD_MISS}), 2)
    assert "read-only" in message and "no node daemon answers" in message, message
    assert "DaemonSet" in message, message
