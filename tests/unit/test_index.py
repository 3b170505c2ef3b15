"""index: state.db bookkeeping of entries, last access, pins and leases."""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
from pathlib import Path

import pytest

from weightcache.cache.index import Entry, Index

SRC = "s3://models/m/r"


@pytest.fixture
def index(tmp_path: Path) -> Index:
    return Index(tmp_path / "state.db")


def test_empty(index: Index) -> None:
    assert index.entries() == []
    assert index.lease_holders() == set()


def test_uses_wal(index: Index) -> None:
    assert index.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_record_access_creates_an_entry(index: Index) -> None:
    index.record_access("m", "r", source=SRC, size=1234, now=1000.0)
    assert index.entries() == [Entry("m", "r", SRC, 1234, 1000.0, ())]


def test_record_access_updates_last_access_and_keeps_what_is_not_given(index: Index) -> None:
    index.record_access("m", "r", source=SRC, size=1234, now=1000.0)
    index.record_access("m", "r", now=2000.0)  # a hit: no source, no size
    assert index.entries() == [Entry("m", "r", SRC, 1234, 2000.0, ())]
    index.record_access("m", "r", source="s3://other/m/r", size=99, now=3000.0)
    assert index.entries() == [Entry("m", "r", "s3://other/m/r", 99, 3000.0, ())]
    index.record_access("m", "r", size=0, now=4000.0)  # zero is a size, not "unknown"
    assert index.entries() == [Entry("m", "r", "s3://other/m/r", 0, 4000.0, ())]
    created = index.db.execute("SELECT created FROM entries").fetchone()
    assert created == (1000.0,)


def test_record_access_without_size_starts_at_zero(index: Index) -> None:
    index.record_access("m", "r", now=5.0)
    assert index.entries() == [Entry("m", "r", "", 0, 5.0, ())]


def test_entries_are_sorted_by_name_and_revision(index: Index) -> None:
    for name, rev, t in [("b", "2", 1.0), ("a", "9", 2.0), ("b", "1", 3.0), ("a", "10", 4.0)]:
        index.record_access(name, rev, now=t)
    assert [(e.name, e.revision, e.last_access) for e in index.entries()] == [
        ("a", "10", 4.0), ("a", "9", 2.0), ("b", "1", 3.0), ("b", "2", 1.0)
    ]  # fmt: skip


def test_leases(index: Index) -> None:
    index.record_access("m", "r", size=10, pod_uid="uid-b", now=1.0)
    index.record_access("m", "r", pod_uid="uid-a", now=2.0)
    index.record_access("m", "r", pod_uid="uid-a", now=3.0)  # same Pod again: one lease
    index.record_access("n", "r", pod_uid="uid-a", now=4.0)
    index.record_access("o", "r", now=5.0)
    by_key = {(e.name, e.revision): e.leases for e in index.entries()}
    assert by_key == {("m", "r"): ("uid-a", "uid-b"), ("n", "r"): ("uid-a",), ("o", "r"): ()}
    assert index.lease_holders() == {"uid-a", "uid-b"}
    assert index.db.execute("SELECT COUNT(*) FROM leases").fetchone() == (3,)

    index.end_leases({"uid-a"})
    by_key = {(e.name, e.revision): e.leases for e in index.entries()}
    assert by_key == {("m", "r"): ("uid-b",), ("n", "r"): (), ("o", "r"): ()}
    assert index.lease_holders() == {"uid-b"}

    index.end_leases({"uid-b", "uid-unknown"})
    index.end_leases(set())
    assert index.lease_holders() == set()
    assert [e.leases for e in index.entries()] == [(), (), ()]
    assert len(index.entries()) == 3  # ending leases forgets no entry


def test_set_pins_replaces_the_pinned_set(index: Index) -> None:
    for name in ("a", "b", "c"):
        index.record_access(name, "r", now=1.0)
    index.set_pins({("a", "r"), ("c", "r")})
    assert index.pins() == {("a", "r"), ("c", "r")}
    index.set_pins({("b", "r"), ("zz", "absent")})
    assert index.pins() == {("b", "r"), ("zz", "absent")}
    assert len(index.entries()) == 3  # pinning an unknown revision creates no entry
    index.set_pins(set())
    assert index.pins() == set()


def test_pins_survive_an_access(index: Index) -> None:
    index.record_access("a", "r", now=1.0)
    index.set_pins({("a", "r")})
    index.record_access("a", "r", source=SRC, size=5, now=2.0)
    assert index.entries() == [Entry("a", "r", SRC, 5, 2.0, ())]
    assert index.pins() == {("a", "r")}


def test_forget(index: Index) -> None:
    index.record_access("a", "r", now=1.0)
    index.record_access("b", "r", now=1.0)
    index.forget("a", "r")
    assert [e.name for e in index.entries()] == ["b"]


def test_state_persists_across_connections(tmp_path: Path) -> None:
    first = Index(tmp_path / "state.db")
    first.record_access("m", "r", source=SRC, size=7, pod_uid="uid", now=9.0)
    first.set_pins({("m", "r")})
    second = Index(tmp_path / "state.db")
    assert second.entries() == [Entry("m", "r", SRC, 7, 9.0, ("uid",))]
    assert second.pins() == {("m", "r")}
    second.end_leases({"uid"})
    assert first.entries()[0].leases == ()
    assert Index(tmp_path / "state.db").entries()[0].leases == ()


def test_lease_ages_are_the_latest_per_pod(index: Index) -> None:
    index.record_access("m", "r", pod_uid="uid-a", now=10.0)
    index.record_access("n", "r", pod_uid="uid-a", now=30.0)
    index.record_access("m", "r", pod_uid="uid-b", now=20.0)
    assert sorted(index.lease_ages()) == [("uid-a", 30.0), ("uid-b", 20.0)]


def test_record_access_never_fails_the_caller(tmp_path: Path) -> None:
    broken = Index(tmp_path)  # a directory: sqlite cannot open it
    broken.record_access("m", "r", size=1, pod_uid="uid", now=1.0)  # logs, does not raise
    with pytest.raises(sqlite3.Error):
        broken.entries()


def test_set_pins_is_atomic_for_a_concurrent_reader(tmp_path: Path) -> None:
    writer = Index(tmp_path / "state.db")
    reader = Index(tmp_path / "state.db")  # another process, e.g. `weightcache ls`
    writer.record_access("m", "r", now=1.0)
    writer.set_pins({("m", "r")})
    seen: list[bool] = []

    def between_statements(sql: str) -> None:
        # Runs as the writer starts each statement: look from another connection.
        if sql.startswith("INSERT INTO pins"):
            seen.append(("m", "r") in reader.pins())

    writer.db.set_trace_callback(between_statements)
    writer.set_pins({("m", "r")})  # the pinned set does not change
    assert seen == [True]


def test_a_pin_set_before_its_revision_exists_applies_when_it_appears(index: Index) -> None:
    index.set_pins({("m", "r")})  # the daemon reads the models file before any fetch
    index.record_access("m", "r", size=1, now=1.0)
    assert [e.name for e in index.entries()] == ["m"] and index.pins() == {("m", "r")}


def test_a_lease_limit_bounds_the_revisions_one_pod_holds(index: Index) -> None:
    for name in "abcd":
        index.record_access(name, "r", size=1, now=1.0)
    assert index.lease("a", "r", "uid-a", limit=2) and index.lease("b", "r", "uid-a", limit=2)
    assert not index.lease("c", "r", "uid-a", limit=2)  # a third revision: refused
    assert index.lease("a", "r", "uid-a", limit=2), "one it holds is renewed"
    assert index.lease("c", "r", "uid-b", limit=2), "another Pod has its own bound"
    assert index.lease("d", "r", "uid-a"), "no limit: a fetch's own lease"
    leases = {(e.name, uid) for e in index.entries() for uid in e.leases}
    assert leases == {("a", "uid-a"), ("b", "uid-a"), ("c", "uid-b"), ("d", "uid-a")}


def test_remove_unless_protected_checks_leases_and_pins_in_the_transaction(
    index: Index,
) -> None:
    removed: list[str] = []
    for name in ("free", "leased", "pinned"):
        index.record_access(name, "r", size=1, now=1.0)
    index.lease("leased", "r", "uid-a")
    index.set_pins({("pinned", "r")})
    results = {
        name: index.remove_unless_protected(name, "r", functools.partial(removed.append, name))
        for name in ("free", "leased", "pinned")
    }
    assert results == {"free": True, "leased": False, "pinned": False}
    assert removed == ["free"]
    assert [e.name for e in index.entries()] == ["leased", "pinned"]


def test_remove_unless_protected_rolls_back_when_the_removal_fails(index: Index) -> None:
    index.record_access("m", "r", size=1, now=1.0)

    def fail() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError):
        index.remove_unless_protected("m", "r", fail)
    assert [e.name for e in index.entries()] == ["m"]


def test_a_lease_taken_through_another_connection_is_seen(tmp_path: Path) -> None:
    evictor, fetch = Index(tmp_path / "state.db"), Index(tmp_path / "state.db")
    evictor.record_access("m", "r", now=1.0)
    assert evictor.entries()[0].leases == ()  # the evictor's plan: not leased
    fetch.lease("m", "r", "uid-a")
    assert not evictor.remove_unless_protected("m", "r", lambda: pytest.fail("removed"))


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_database_replaced_or_deleted_is_reopened_with_its_leases(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "state.db"
    daemon = Index(path)
    daemon.lease("old", "r", "uid-old")
    generation = daemon.generation
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    if how == "replaced":
        other = tmp_path / "other.db"  # another valid database (made by another process)
        with contextlib.closing(sqlite3.connect(other)) as db:
            db.execute("CREATE TABLE unrelated (x)")
            db.commit()
        os.replace(other, path)
    Index(path).lease("new", "r", "uid-new")  # a fetch, through the file on disk
    # The daemon sees the lease taken through the new file, and keeps its own.
    assert daemon.lease_holders() == {"uid-old", "uid-new"}
    assert not daemon.remove_unless_protected("new", "r", lambda: pytest.fail("removed"))
    assert daemon.generation > generation
    assert Index(path).lease_holders() == {"uid-old", "uid-new"}  # carried into the file


def _rebuilt() -> list[tuple[str, str, str, int, float]]:
    return [("m", "r", SRC, 42, 7.0)]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_database_is_moved_aside_and_rebuilt(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    seed = Index(path)
    for i in range(300):  # several pages, so that a cut lands inside the tables
        seed.record_access(f"m{i}", "r", source=SRC * 3, size=i, pod_uid=f"uid-{i}", now=1.0)
    seed.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    if damage == "garbage":
        path.write_bytes(os.urandom(64 * 1024))
    else:
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)
    original = path.read_bytes()
    index = Index(path, rebuild=_rebuilt)
    assert index.entries() == [Entry("m", "r", SRC, 42, 7.0, ())]
    aside = list(tmp_path.glob("state.db.corrupt-*"))
    assert [p.name for p in aside if not p.name.endswith(("-wal", "-shm"))] != []
    assert any(p.read_bytes() == original for p in aside), "the corrupt file was not kept"
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "corrupt" in r.message]
    assert len(warnings) == 1, caplog.text
    # Another process finding the new file healthy does not move it aside again.
    assert Index(path, rebuild=_rebuilt).entries() == index.entries()
    assert len(list(tmp_path.glob("state.db.corrupt-*"))) == len(aside)


def test_leases_it_cannot_record_are_counted_until_one_is(
    index: Index, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's /healthz reads the count: a state.db that keeps refusing (seen:
    "database is locked" for good after the file was truncated in place) means leases
    are not kept, and a Pod's revision could be evicted under it."""

    def locked() -> None:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(index, "_transaction", locked)
    for _ in range(3):
        index.lease("m", "r", "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94")  # never raises
    assert (index.unrecorded, index.unrecorded_error) == (3, "database is locked")
    monkeypatch.undo()
    index.lease("m", "r", "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94")
    assert index.unrecorded == 0 and index.lease_holders() == {
        "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
    }
