"""The cache's bookkeeping under abuse (design §3 the index, §5 Capacity): a `state.db` replaced,
deleted or corrupt under real processes, lease holders that are not Pod UIDs, and blobs
that no revision links (orphans) filling the capacity."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    entry,
    is_marked,
    ls_json,
    wait_for,
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
)
from tests.support.faultproxy import FaultProxy

POD = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"


def state_db(cache_dir: Path) -> Path:
    return cache_dir / ".weightcache" / "state.db"


def remove_db(cache_dir: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{state_db(cache_dir)}{suffix}").unlink(missing_ok=True)


# -- item 7: POD_UID ------------------------------------------------------------------------


@pytest.mark.parametrize("uid", ["a" * 300, "../../..", "pod-L"])
@pytest.mark.timeout(60)
def test_a_pod_uid_that_is_no_kubernetes_uid_is_refused(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path, uid: str
) -> None:
    pub = publish([64 * 1024], name="uid", rev="r1", seed="uid")
    message = assert_fails(wc.fetch(pub.source, cache_dir, env={"POD_UID": uid}), 2)
    assert "POD_UID" in message, message
    assert len(message) < 400, message
    assert not is_marked(cache_dir, pub)


@pytest.mark.timeout(120)
def test_the_daemon_ends_leases_whose_holder_is_no_pod_uid(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([256 * 1024], name="planted", rev="r1", seed="planted")
    assert_ok_path(wc.fetch(pub.source, cache_dir, env={"POD_UID": POD}),
                   pub.local_path(cache_dir))  # fmt: skip
    pods = tmp_path / "pods"
    (pods / POD).mkdir(parents=True)  # a live Pod: its lease stays
    bad = ["x" * 300, "../../..", "pod-L"]  # from an old version or a hand-edited db
    with contextlib.closing(sqlite3.connect(state_db(cache_dir))) as db:
        db.executemany("INSERT INTO leases VALUES (?, ?, ?, ?)",
                       [(pub.name, pub.rev, uid, time.time()) for uid in bad])  # fmt: skip
        db.commit()
    assert sorted(ls_json(wc, cache_dir)[(pub.name, pub.rev)]["leases"]) == sorted([POD, *bad])

    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, pods_dir=pods)
    wait_for("the planted leases to end",
             lambda: ls_json(wc, cache_dir)[(pub.name, pub.rev)]["leases"] == [POD],
             timeout=30, every=0.3)  # fmt: skip
    time.sleep(2)  # several reaper rounds
    assert daemon.alive(), daemon.log()
    assert daemon.get("/healthz")[0] == 200, daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()


# -- item 5: state.db replaced or deleted under the daemon -------------------------------------


@pytest.mark.parametrize("how", ["deleted", "replaced"])
@pytest.mark.timeout(180)
def test_a_lease_taken_through_a_new_state_db_is_honoured_by_the_daemon(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons, how: str,  # noqa: F811
) -> None:  # fmt: skip
    used = publish([4 * MiB], name="used", rev="r1", seed="used")
    newcomer = publish([4 * MiB], name="newcomer", rev="r1", seed="newcomer")
    pods = tmp_path / "pods"
    (pods / POD).mkdir(parents=True)
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, pods_dir=pods,
                           capacity=str(6 * MiB))  # fmt: skip
    assert_ok_path(wc.fetch(used.source, cache_dir, env={"POD_UID": None}),
                   used.local_path(cache_dir))  # fmt: skip
    time.sleep(1.5)  # the daemon has its state.db open (reaper, capacity rounds)

    remove_db(cache_dir)
    if how == "replaced":  # e.g. restored from a backup, or another node's copy
        other = tmp_path / "other.db"
        with contextlib.closing(sqlite3.connect(other)) as db:
            db.execute("CREATE TABLE unrelated (x)")
            db.commit()
        shutil.move(other, state_db(cache_dir))
    # A Pod starts: a hit, leased through the file that is on disk now.
    assert_ok_path(wc.fetch(used.source, cache_dir, env={"POD_UID": POD}),
                   used.local_path(cache_dir))  # fmt: skip
    assert ls_json(wc, cache_dir)[(used.name, used.rev)]["leases"] == [POD]

    # The newcomer needs the room only evicting the leased revision would make.
    message = assert_fails(wc.fetch(newcomer.source, cache_dir, env={"POD_UID": None}), 5)
    assert "capacity" in message, message
    assert is_marked(cache_dir, used), f"the daemon evicted a leased revision\n{daemon.log()}"
    assert_revision_ok(cache_dir, used.name, used.rev, used.model)
    assert daemon.alive(), daemon.log()

    # The Pod is gone: now the room can be made.
    (pods / POD).rmdir()
    wait_for("the lease to end",
             lambda: ls_json(wc, cache_dir)[(used.name, used.rev)]["leases"] == [],
             timeout=30, every=0.3)  # fmt: skip
    assert_ok_path(wc.fetch(newcomer.source, cache_dir, env={"POD_UID": None}),
                   newcomer.local_path(cache_dir))  # fmt: skip
    assert not is_marked(cache_dir, used)


# -- item 6: corrupt state.db ----------------------------------------------------------------


def corrupt(cache_dir: Path, how: str) -> bytes:
    """Damage state.db (its WAL folded in and removed first); return what it holds now."""
    path = state_db(cache_dir)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    if how == "garbage":
        path.write_bytes(os.urandom(20_000))
    else:
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)
    return path.read_bytes()


def corrupt_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "WARNING" in line and " is corrupt (" in line]


@pytest.fixture
def warm_cache(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> Iterator[tuple[Published, Published]]:
    """Two revisions in the cache and a state.db that knows many of them (several pages)."""
    a = publish([256 * 1024], name="alpha", rev="r1", seed="alpha")
    b = publish([256 * 1024], name="beta", rev="r1", seed="beta")
    for pub in (a, b):
        assert_ok_path(wc.fetch(pub.source, cache_dir), pub.local_path(cache_dir))
    with contextlib.closing(sqlite3.connect(state_db(cache_dir))) as db:
        db.executemany("INSERT INTO entries VALUES (?, 'r', 's3://x/y', 1, 1.0, 1.0)",
                       [(f"gone{i}" * 20,) for i in range(400)])  # fmt: skip
        db.commit()
    yield a, b


@pytest.mark.parametrize("how", ["garbage", "truncated"])
@pytest.mark.timeout(120)
def test_ls_and_gc_on_a_corrupt_state_db(
    wc: CLI, cache_dir: Path, warm_cache: tuple[Published, Published], how: str
) -> None:
    a, b = warm_cache
    damaged = corrupt(cache_dir, how)
    ls = wc.run("ls", "--json", "--cache-dir", cache_dir)
    assert ls.returncode == 0, describe(ls)
    assert "Traceback" not in ls.stderr, describe(ls)
    assert len(corrupt_warnings(ls.stderr)) == 1, describe(ls)
    rows = ls_json(wc, cache_dir)
    assert set(rows) == {(a.name, a.rev), (b.name, b.rev)}, rows
    assert all(r["ready"] and r["size"] and r["last_access"] for r in rows.values()), rows
    kept = [p for p in state_db(cache_dir).parent.glob("state.db.corrupt-*")
            if p.read_bytes() == damaged]  # fmt: skip
    assert kept, "the corrupt state.db was not kept aside"

    corrupt(cache_dir, how)
    gc = wc.run("gc", "--capacity", "1B", "--cache-dir", cache_dir)
    assert gc.returncode == 0, describe(gc)
    assert "Traceback" not in gc.stderr and len(corrupt_warnings(gc.stderr)) == 1, describe(gc)
    assert ls_json(wc, cache_dir) == {}, "gc did not evict from a rebuilt index"


@pytest.mark.timeout(120)
def test_prefetch_on_a_corrupt_state_db(
    wc: CLI, cache_dir: Path, tmp_path: Path, warm_cache: tuple[Published, Published]
) -> None:
    a, b = warm_cache
    corrupt(cache_dir, "garbage")
    models = write_models(tmp_path / "models.yaml", [entry(a, pin=True), entry(b)])
    proc = wc.run("prefetch", "--cache-dir", cache_dir, "--models", models)
    assert proc.returncode == 0, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    assert len(corrupt_warnings(proc.stderr)) == 1, describe(proc)
    rows = ls_json(wc, cache_dir)
    assert rows[(a.name, a.rev)]["pinned"] and not rows[(b.name, b.rev)]["pinned"], rows


@pytest.mark.timeout(120)
def test_the_daemon_on_a_corrupt_state_db(
    wc: CLI, proxy: FaultProxy, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
    warm_cache: tuple[Published, Published],
) -> None:  # fmt: skip
    a, b = warm_cache
    corrupt(cache_dir, "garbage")
    models = write_models(tmp_path / "models.yaml", [entry(a, pin=True)])
    (tmp_path / "pods" / POD).mkdir(parents=True)
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url)
    wait_for("the pinned revision", daemon.pins_ready, timeout=30)
    rows = ls_json(wc, cache_dir)
    assert rows[(a.name, a.rev)]["pinned"], rows  # the pins came back from the models file
    assert_ok_path(wc.fetch(b.source, cache_dir, env={"POD_UID": POD}), b.local_path(cache_dir))
    assert ls_json(wc, cache_dir)[(b.name, b.rev)]["leases"] == [POD]
    assert daemon.alive(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()
    assert len(corrupt_warnings(daemon.log())) == 1, daemon.log()


# -- item 13: orphan blobs ---------------------------------------------------------------------


def plant_orphans(cache_dir: Path, total: int, size: int = 1 * MiB) -> list[str]:
    """Blobs no revision links, as a fetch that ended in exit 4 or a kill -9 leaves them."""
    names = []
    for i in range(total // size):
        data = hashlib.sha256(f"orphan {i}".encode()).digest() * (size // 32)
        name = hashlib.sha256(data).hexdigest()
        path = blobs_dir(cache_dir) / name
        path.write_bytes(data)
        path.chmod(0o444)
        names.append(name)
    return names


@pytest.mark.timeout(120)
def test_orphans_filling_the_capacity_are_collected_for_a_fetch(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    old = publish([3 * MiB], name="old", rev="r1", seed="old-orphans")
    new = publish([4 * MiB], name="new", rev="r1", seed="new-orphans")
    assert_ok_path(wc.fetch(old.source, cache_dir, "--no-daemon"), old.local_path(cache_dir))
    shutil.rmtree(old.local_path(cache_dir))  # an operator's rm -rf: its blob stays
    planted = plant_orphans(cache_dir, 4 * MiB)
    models = write_models(tmp_path / "models.yaml", [])
    # Nothing is cached, yet 7 MiB of the 8 MiB capacity is in use.
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, capacity=str(8 * MiB))
    proc = wc.fetch(new.source, cache_dir, env={"POD_UID": None})
    assert_ok_path(proc, new.local_path(cache_dir))
    assert_revision_ok(cache_dir, new.name, new.rev, new.model)
    assert not any((blobs_dir(cache_dir) / name).exists() for name in planted)
    assert set(os.listdir(blobs_dir(cache_dir))) == set(new.model.hashes.values())
    assert daemon.metrics()['weightcache_fetches_total{result="miss"}'] == 1, daemon.log()


@pytest.mark.timeout(60)
def test_gc_collects_fresh_orphans(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([1 * MiB], name="kept", rev="r1", seed="kept-gc")
    assert_ok_path(wc.fetch(pub.source, cache_dir), pub.local_path(cache_dir))
    plant_orphans(cache_dir, 2 * MiB)
    dry = wc.run("gc", "--dry-run", "--capacity", "1G", "--cache-dir", cache_dir)
    assert dry.returncode == 0 and f"{2 * MiB} bytes of orphaned blobs" in dry.stdout, describe(dry)
    gc = wc.run("gc", "--capacity", "1G", "--cache-dir", cache_dir)
    assert gc.returncode == 0, describe(gc)
    assert f"{2 * MiB} bytes of orphaned blobs freed" in gc.stdout, describe(gc)
    assert set(os.listdir(blobs_dir(cache_dir))) == set(pub.model.hashes.values())
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)


@contextlib.contextmanager
def holding_blob_lock(cache_dir: Path, sha256: str) -> Iterator[None]:
    """Another process downloading this blob, as far as a fetch can tell."""
    locks = cache_dir / ".weightcache" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"blob-{sha256}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@pytest.mark.parametrize("collector", ["daemon", "gc"])
@pytest.mark.timeout(120)
def test_a_blob_a_running_fetch_is_about_to_link_is_not_collected(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons, collector: str,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB, 1 * MiB], name="linking", rev="r1", seed="linking")
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    early = blobs_dir(cache_dir) / pub.model.hashes[first]
    if collector == "daemon":
        daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", []),
                               endpoint=proxy.url, capacity=str(64 * MiB))  # fmt: skip
    with holding_blob_lock(cache_dir, pub.model.hashes[second]):
        # The fetch downloads and publishes the first shard, then waits for the second.
        fetch = wc.fetch_popen(pub.source, cache_dir, "--no-daemon", endpoint=proxy.url)
        wait_for("the first shard's blob", early.is_file, timeout=60)
        assert early.stat().st_nlink == 1  # not linked into a revision yet
        if collector == "daemon":
            time.sleep(2.5)  # five collection rounds of the daemon
        else:
            gc = wc.run("gc", "--capacity", "1G", "--cache-dir", cache_dir)
            assert gc.returncode == 0, describe(gc)
        assert early.is_file(), "a blob a running fetch is about to link was collected"
        assert fetch.poll() is None
    assert_ok_path(fetch.finish(timeout=60), pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert proxy.stats().bytes_for(first) == pub.model.sizes[first], "downloaded twice"
    assert_blobs_valid(cache_dir)
    if collector == "daemon":
        assert daemon.alive(), daemon.log()


def test_a_first_fetch_creates_state_db_while_it_downloads(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    """Made after the last byte, state.db (its file, WAL and schema, each synced) added
    tens of milliseconds to a cold fetch on a new cache: it is made during the download,
    and the fetch's record of the revision is then one transaction."""
    pub = publish([2 * MiB], name="statedb", rev="r", small_files=False)
    running = wc.fetch_popen(pub.source, cache_dir, "--bwlimit", "512K",
                             endpoint=wc.store.endpoint_url)  # fmt: skip
    db = cache_dir / ".weightcache" / "state.db"
    tmp = cache_dir / ".weightcache" / "tmp"
    deadline = time.monotonic() + 60
    while not (tmp.is_dir() and any(p.suffix == ".part" for p in tmp.iterdir())):
        assert running.poll() is None and time.monotonic() < deadline, "no download seen"
        time.sleep(0.02)
    while not db.exists() and running.poll() is None:
        time.sleep(0.02)
    downloading = any(p.suffix == ".part" for p in tmp.iterdir())
    assert_ok_path(running.finish(), pub.local_path(cache_dir))
    assert downloading, "state.db was made only once the download was over"
    row = ls_json(wc, cache_dir)[("statedb", "r")]
    assert row["size"] == pub.model.total_size, row
