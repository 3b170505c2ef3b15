"""LeaseReaper in-process: which leases end, with a tmp kubelet pods dir (design §5)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from weightcache.cache.index import Index, for_cache
from weightcache.cache.layout import Layout
from weightcache.config import KUBELET_PODS_DIR
from weightcache.daemon.leases import LeaseReaper

LIVE = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
GONE = "1f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
HOUR = 3600.0


@pytest.fixture
def index(layout: Layout) -> Index:
    index = for_cache(layout)
    now = time.time()
    index.lease("m", "r1", LIVE, now=now)
    index.lease("m", "r1", GONE, now=now - 2 * HOUR)
    index.lease("m", "r1", "by-hand", now=now)
    return index


def test_a_lease_ends_when_its_pod_directory_is_gone(index: Index, tmp_path: Path) -> None:
    pods = tmp_path / "pods"
    (pods / LIVE).mkdir(parents=True)
    LeaseReaper(index, pods, max_age=24 * HOUR).reap()
    assert index.lease_holders() == {LIVE}


def test_without_a_pods_directory_a_lease_ends_after_max_age(index: Index, tmp_path: Path) -> None:
    LeaseReaper(index, tmp_path / "absent", max_age=HOUR).reap()
    assert index.lease_holders() == {LIVE}


def test_a_missing_pods_directory_is_said_once_at_start(
    index: Index, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in --kubelet-pods-dir (or a forgotten mount) keeps every lease a day."""
    with caplog.at_level("WARNING"):
        reaper = LeaseReaper(index, tmp_path / "typo", 86400)
        reaper.reap()
        reaper.reap()
    said = [r.getMessage() for r in caplog.records if "no directory" in r.getMessage()]
    assert said == [
        f"{tmp_path / 'typo'} is no directory: a lease ends 24h after it was taken, not when "
        "its Pod goes; mount the kubelet's pods directory there (--kubelet-pods-dir) on a node"
    ]
    caplog.clear()
    LeaseReaper(index, tmp_path, 86400)
    assert caplog.records == []


@pytest.mark.parametrize("in_cluster", [False, True])
def test_the_default_pods_directory_missing_off_a_cluster_is_no_warning(
    index: Index, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    in_cluster: bool,
) -> None:  # fmt: skip
    """`prefetch` or `daemon` on a laptop: no kubelet, nothing to mount, nothing to warn of;
    in a cluster (a forgotten mount) it is said."""
    if KUBELET_PODS_DIR.is_dir():
        pytest.skip(f"{KUBELET_PODS_DIR} exists here")
    if in_cluster:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    else:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with caplog.at_level("INFO"):
        LeaseReaper(index, KUBELET_PODS_DIR, 86400)
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == int(in_cluster), [r.getMessage() for r in caplog.records]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_a_pods_directory_it_cannot_search_keeps_every_pod_lease(
    index: Index, tmp_path: Path
) -> None:
    pods = tmp_path / "pods"
    pods.mkdir()
    pods.chmod(0o600)  # readable, not searchable: stat() of an entry is EACCES
    try:
        LeaseReaper(index, pods, max_age=HOUR).reap()
    finally:
        pods.chmod(0o755)
    assert index.lease_holders() == {LIVE, GONE}  # only the malformed holder ends


def test_a_pods_directory_it_cannot_search_keeps_every_pod_lease_even_as_root(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The test above is skipped as root (root searches any directory): EACCES simulated.
    pods = tmp_path / "pods"
    pods.mkdir()
    real = Path.stat

    def denied(self: Path, **kwargs: bool) -> os.stat_result:
        if self.parent == pods:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, **kwargs)

    monkeypatch.setattr(Path, "stat", denied)
    with caplog.at_level("ERROR"):
        LeaseReaper(index, pods, max_age=HOUR).reap()
    assert index.lease_holders() == {LIVE, GONE}  # only the malformed holder ends
    assert "setfacl -m u:" in caplog.text


def test_without_a_pods_directory_a_lease_exactly_max_age_old_is_kept(
    layout: Layout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Older than max_age" ends a lease: one taken exactly max_age ago is not yet.
    index = for_cache(layout)
    now = 1_000_000.0
    index.lease("m", "r1", LIVE, now=now - HOUR)
    index.lease("m", "r1", GONE, now=now - HOUR - 1)
    monkeypatch.setattr(time, "time", lambda: now)
    LeaseReaper(index, tmp_path / "absent", max_age=HOUR).reap()
    assert index.lease_holders() == {LIVE}


def test_the_leases_it_ends_are_logged_with_holders_that_are_no_pod_cut_short(
    index: Index, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder written by hand may be anything: it is shown, cut at 40 characters."""
    index.lease("m", "r1", "x" * 50)
    pods = tmp_path / "pods"
    (pods / LIVE).mkdir(parents=True)
    reaper = LeaseReaper(index, pods, max_age=24 * HOUR)
    with caplog.at_level("INFO", logger="weightcache.daemon.leases"):
        reaper.reap()
        assert [r.getMessage() for r in caplog.records] == [
            f"ending 2 lease(s) not held by a Pod UID: 'by-hand', {'x' * 40!r}",
            "ending 1 lease(s) of Pods that are gone",
        ]
        caplog.clear()
        reaper.reap()  # nothing left to end: nothing said
        assert caplog.records == []
