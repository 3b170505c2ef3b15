"""store: markers, revision assembly, readiness, removal, blob GC and the file lock."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from weightcache.cache import manifest
from weightcache.cache.layout import MARKER, Layout
from weightcache.cache.locks import FileLock
from weightcache.cache.manifest import Manifest
from weightcache.cache.marker import Marker
from weightcache.cache.store import MARKER_MAX_BYTES, Cache, _link_or_copy
from weightcache.errors import IntegrityError

PutBlob = Callable[[bytes], str]


def _revision(
    put_blob: PutBlob, files: dict[str, bytes], name: str = "m", revision: str = "r"
) -> tuple[Marker, Manifest]:
    """Put the files' blobs in the store; return the marker and manifest of a revision."""
    hashes = {path: put_blob(data) for path, data in files.items()}
    data = manifest.render([(h, p) for p, h in hashes.items()])
    m = manifest.parse(data, "test").with_sizes({p: len(d) for p, d in files.items()})
    marker = Marker(
        name=name, revision=revision, source=f"s3://models/{name}/{revision}",
        manifest_sha256=m.digest,
        files={p: (hashes[p], len(d)) for p, d in files.items()},
        created=1_700_000_000.5,
    )  # fmt: skip
    return marker, m


FILES = {
    "model-00001-of-00002.safetensors": b"A" * 1000,
    "model-00002-of-00002.safetensors": b"B" * 777,
    "tokenizer/tokenizer.json": b'{"v": 1}',
    "empty.txt": b"",
}


# -- Marker ------------------------------------------------------------------------------------


def test_marker_json_round_trip() -> None:
    marker = Marker(
        "qwen3-70b",
        "2026-10-01",
        "s3://models/qwen3-70b/2026-10-01",
        "d" * 64,
        {"b.bin": ("1" * 64, 20), "a/x.bin": ("2" * 64, 0)},
        1_700_000_000.25,
    )
    text = marker.to_json()
    assert Marker.from_json(text) == marker
    d = json.loads(text)
    assert d["version"] == 1
    assert list(d["files"]) == ["a/x.bin", "b.bin"]  # sorted, stable on disk
    assert d["files"]["b.bin"] == {"sha256": "1" * 64, "size": 20, "verified": "sha256sums"}
    assert marker.size == 20


@pytest.mark.parametrize("key", ["name", "revision", "source", "manifest_sha256"])
def test_a_marker_whose_strings_are_not_strings_is_refused(key: str) -> None:
    """Shown by `ls` and in log lines: {"a": 1} as a source is no source."""
    d = json.loads(Marker("m", "r", "s3://b/m/r", "0" * 64, {}, 0.0).to_json())
    d[key] = {"a": 1}
    with pytest.raises(ValueError, match=f"the marker's {key} is"):
        Marker.from_json(json.dumps(d))


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_marker_unknown_version(version: object) -> None:
    d = json.loads(Marker("m", "r", "s", "d", {}, 0.0).to_json())
    d["version"] = version
    with pytest.raises(ValueError, match="unknown marker version"):
        Marker.from_json(json.dumps(d))


def _marker_without(key: str) -> str:
    d = json.loads(Marker("m", "r", "s", "d" * 64, {"ok.bin": ("1" * 64, 1)}, 0.0).to_json())
    del d[key]
    return json.dumps(d)


@pytest.mark.parametrize(
    "content",
    ["[]", "null", '{"version": 1}', _marker_without("files"), _marker_without("created")],
)
def test_a_malformed_marker_raises_value_error_saying_so(content: str) -> None:
    """Not None: `verify` then reports a marker it cannot trust, not a missing one."""
    with pytest.raises(ValueError, match="malformed marker"):
        Marker.from_json(content)


@pytest.mark.parametrize(
    ("path", "sha256", "size"),
    [
        ("../../../etc/passwd", "1" * 64, 1),
        ("/etc/passwd", "1" * 64, 1),
        ("a/../../x", "1" * 64, 1),
        ("ok.bin", "../../blobs", 1),
        ("ok.bin", "1" * 64, -1),
    ],
)
def test_marker_with_an_unsafe_entry_is_refused(path: str, sha256: str, size: int) -> None:
    d = json.loads(Marker("m", "r", "s", "d" * 64, {"ok.bin": ("1" * 64, 1)}, 0.0).to_json())
    d["files"][path] = {"sha256": sha256, "size": size}
    with pytest.raises(ValueError):
        Marker.from_json(json.dumps(d))


def test_read_marker_ignores_an_unsafe_marker_and_load_marker_says_why(
    store: Cache, layout: Layout
) -> None:
    d = json.loads(Marker("m", "r", "s", "d" * 64, {}, 0.0).to_json())
    d["files"]["../../../x"] = {"sha256": "1" * 64, "size": 1}
    (layout.root / "m" / "r").mkdir(parents=True)
    (layout.root / "m" / "r" / MARKER).write_text(json.dumps(d))
    assert store.read_marker("m", "r") is None
    with pytest.raises(ValueError, match="unsafe path"):
        store.load_marker("m", "r")


def test_an_unreadable_marker_is_warned_about_once_not_at_every_read(
    store: Cache, layout: Layout, caplog: pytest.LogCaptureFixture
) -> None:
    (layout.root / "m" / "r").mkdir(parents=True)
    (layout.root / "m" / "r" / MARKER).write_text("{junk")
    with caplog.at_level("WARNING"):
        for _ in range(5):
            assert store.read_marker("m", "r") is None
    assert len(caplog.records) == 1 and "m/r" in caplog.text


# -- assemble / ready --------------------------------------------------------------------------


def test_assemble_refuses_a_blob_not_of_its_size_and_quarantines_it(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"a.bin": b"A" * 100, "b.bin": b"B" * 50})
    damaged = layout.blob(marker.files["a.bin"][0])
    os.truncate(damaged, 10)
    assert not store.has_blob(marker.files["a.bin"][0], 100)
    assert store.has_blob(marker.files["b.bin"][0], 50)
    with pytest.raises(FileNotFoundError):
        store.assemble(marker, m)
    assert not damaged.exists(), "the damaged blob was kept"
    assert not layout.revision_dir("m", "r").exists()
    assert list(layout.tmp.iterdir()) == []


def test_repair_unmarks_and_quarantines_only_damaged_files(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"a.bin": b"A" * 100, "b.bin": b"B" * 50})
    target = store.assemble(marker, m)
    assert store.repair(marker) == []
    assert store.ready("m", "r") == marker
    os.truncate(target / "a.bin", 3)
    assert store.repair(marker) == ["a.bin"]
    assert store.read_marker("m", "r") is None
    assert not (target / "a.bin").exists()
    assert not layout.blob(marker.files["a.bin"][0]).exists()
    assert (target / "b.bin").read_bytes() == b"B" * 50
    assert layout.blob(marker.files["b.bin"][0]).exists()


def test_assemble_links_blobs_and_writes_the_marker(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, FILES)
    target = store.assemble(marker, m)
    assert target == layout.root / "m" / "r"
    on_disk = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert on_disk == sorted([*FILES, MARKER])
    for path, data in FILES.items():
        file = target / path
        assert file.read_bytes() == data
        blob = layout.blob(hashlib.sha256(data).hexdigest())
        assert file.stat().st_ino == blob.stat().st_ino  # a hard link, not a copy
        assert blob.stat().st_nlink == 2
    assert Marker.from_json((target / MARKER).read_text()) == marker
    assert list(layout.tmp.iterdir()) == []  # staging renamed away, nothing left behind
    assert store.ready("m", "r") == marker


def test_two_revisions_share_a_blob(store: Cache, layout: Layout, put_blob: PutBlob) -> None:
    shared = b"S" * 100
    m1, man1 = _revision(put_blob, {"a.bin": shared, "b.bin": b"one"}, revision="r1")
    m2, man2 = _revision(put_blob, {"a.bin": shared, "b.bin": b"two"}, revision="r2")
    store.assemble(m1, man1)
    store.assemble(m2, man2)
    assert layout.blob(hashlib.sha256(shared).hexdigest()).stat().st_nlink == 3
    assert len(list(layout.blobs.iterdir())) == 3
    assert store.ready("m", "r1") == m1
    assert store.ready("m", "r2") == m2


def test_assemble_replaces_an_existing_revision(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    old, old_m = _revision(put_blob, {"a.bin": b"old", "stale.bin": b"gone"})
    store.assemble(old, old_m)
    new, new_m = _revision(put_blob, {"a.bin": b"new"})
    store.assemble(new, new_m)
    target = layout.root / "m" / "r"
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "a.bin"]
    assert (target / "a.bin").read_bytes() == b"new"
    assert store.ready("m", "r") == new
    assert list(layout.tmp.iterdir()) == []


def test_assemble_with_a_missing_blob_leaves_nothing(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"a.bin": b"here", "b.bin": b"evicted"})
    layout.blob(hashlib.sha256(b"evicted").hexdigest()).unlink()
    with pytest.raises(FileNotFoundError):
        store.assemble(marker, m)
    assert not (layout.root / "m" / "r").exists()
    assert list(layout.tmp.iterdir()) == []
    assert store.ready("m", "r") is None


def test_ready_none_without_a_marker(store: Cache, layout: Layout) -> None:
    assert store.ready("m", "r") is None
    (layout.root / "m" / "r").mkdir(parents=True)
    (layout.root / "m" / "r" / "a.bin").write_bytes(b"x")
    assert store.ready("m", "r") is None


@pytest.mark.parametrize("change", ["append", "truncate", "delete", "replace_by_dir"])
def test_ready_none_when_a_file_changed(
    store: Cache, layout: Layout, put_blob: PutBlob, change: str
) -> None:
    marker, m = _revision(put_blob, FILES)
    target = store.assemble(marker, m)
    assert store.ready("m", "r") == marker
    victim = target / "model-00002-of-00002.safetensors"
    if change == "append":
        with open(victim, "ab") as fh:
            fh.write(b"!")
    elif change == "truncate":
        os.truncate(victim, 776)
    elif change == "delete":
        victim.unlink()
    else:
        victim.unlink()
        victim.mkdir()
    assert store.ready("m", "r") is None


def test_ready_none_when_the_marker_names_another_revision(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"a.bin": b"x"})
    target = store.assemble(marker, m)
    copy = layout.root / "m" / "copy"
    copy.mkdir()
    os.link(target / "a.bin", copy / "a.bin")
    (copy / MARKER).write_text((target / MARKER).read_text())
    assert store.ready("m", "copy") is None
    assert store.ready("m", "r") == marker


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        '{"version": 1}',
        '{"version": 2, "files": {}}',
        '{"version": 1, "name": "m", "revision": "r", "source": "", '
        '"manifest_sha256": "", "created": 0, "files": {"a.bin": {"size": "x"}}}',
        pytest.param(
            '{"version": 1, "name": "m", "revision": "r", "source": "", "manifest_sha256": "", '
            f'"created": 0, "files": {{"a.bin": {{"sha256": "{"0" * 64}", "size": 1e400}}}}}}',
            id="size-inf",  # OverflowError in int()
        ),
        pytest.param("[" * 100_000, id="nested"),  # RecursionError in json.loads
    ],
)
def test_ready_none_for_an_unreadable_marker(store: Cache, layout: Layout, content: str) -> None:
    (layout.root / "m" / "r").mkdir(parents=True)
    (layout.root / "m" / "r" / MARKER).write_text(content)
    assert store.read_marker("m", "r") is None
    assert store.ready("m", "r") is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize("planted", ["fifo", "symlink to /dev/zero", "too large"])
def test_ready_none_for_a_marker_planted_as_no_regular_file(
    store: Cache, layout: Layout, planted: str
) -> None:
    """Anyone who can write the cache can plant these: a FIFO would hang every reader of
    markers (the daemon, `ls`) and /dev/zero fill its memory."""
    marker = layout.root / "m" / "r" / MARKER
    marker.parent.mkdir(parents=True)
    if planted == "fifo":
        os.mkfifo(marker)
    elif planted == "too large":
        with open(marker, "wb") as fh:
            fh.truncate(MARKER_MAX_BYTES + 1)  # sparse: no disk, only its size
    else:
        marker.symlink_to("/dev/zero")
    assert store.read_marker("m", "r") is None
    with pytest.raises(ValueError, match=r"regular file|symbolic link|more than"):
        store.load_marker("m", "r")


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "null",
        "1",
        '{"version": 1, "name": "m", "revision": "r", '
        '"source": "", "manifest_sha256": "", "created": 0, "files": []}',
    ],
)
def test_ready_none_for_a_marker_that_is_not_an_object(
    store: Cache, layout: Layout, content: str
) -> None:
    (layout.root / "m" / "r").mkdir(parents=True)
    (layout.root / "m" / "r" / MARKER).write_text(content)
    assert store.ready("m", "r") is None


# -- remove / GC -------------------------------------------------------------------------------


def test_remove_revision(store: Cache, layout: Layout, put_blob: PutBlob) -> None:
    m1, man1 = _revision(put_blob, {"a.bin": b"1"}, revision="r1")
    m2, man2 = _revision(put_blob, {"a.bin": b"2"}, revision="r2")
    store.assemble(m1, man1)
    store.assemble(m2, man2)
    store.remove_revision("m", "r1")
    assert not (layout.root / "m" / "r1").exists()
    assert store.ready("m", "r1") is None
    assert store.ready("m", "r2") == m2
    assert (layout.root / "m").is_dir()  # still holds r2
    assert layout.blob(hashlib.sha256(b"1").hexdigest()).stat().st_nlink == 1
    assert list(layout.tmp.iterdir()) == []  # the trash is gone too
    store.remove_revision("m", "r2")
    assert not (layout.root / "m").exists()  # the empty name directory goes with it
    store.remove_revision("m", "r2")  # removing what is absent is fine
    store.remove_revision("other", "r")


def test_unreferenced_blobs_are_those_with_one_link(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"kept.bin": b"K" * 50})
    store.assemble(marker, m)
    orphan_a = put_blob(b"orphan" * 10)
    orphan_b = put_blob(b"")
    assert sorted(p.name for p in store.unreferenced_blobs()) == sorted([orphan_a, orphan_b])
    # Just-published orphans may be about to be linked by a running fetch: spared by age.
    assert store.unreferenced_blobs(min_age=3600) == []


def test_delete_blobs_if_unreferenced(store: Cache, layout: Layout, put_blob: PutBlob) -> None:
    marker, m = _revision(put_blob, {"kept.bin": b"K" * 50})
    store.assemble(marker, m)
    kept = hashlib.sha256(b"K" * 50).hexdigest()
    orphan_a = put_blob(b"orphan" * 10)
    orphan_b = put_blob(b"")
    never_stored = hashlib.sha256(b"never stored").hexdigest()

    assert store.delete_blobs_if_unreferenced([kept, orphan_a, orphan_b, never_stored]) == 60
    assert sorted(p.name for p in layout.blobs.iterdir()) == [kept]  # the linked one stays
    assert store.ready("m", "r") == marker
    assert store.delete_blobs_if_unreferenced([kept]) == 0

    store.remove_revision("m", "r")
    assert store.delete_blobs_if_unreferenced([kept]) == 50
    assert list(layout.blobs.iterdir()) == []


def test_usage_counts_blobs_and_partials(store: Cache, layout: Layout, put_blob: PutBlob) -> None:
    assert store.usage() == 0
    marker, m = _revision(put_blob, {"a.bin": b"a" * 100, "b.bin": b"b" * 20})
    store.assemble(marker, m)  # links add no bytes
    layout.partial("0" * 64).write_bytes(b"p" * 7)
    assert store.usage() == 127


def test_has_blob_and_partials(store: Cache, layout: Layout, put_blob: PutBlob) -> None:
    digest = put_blob(b"data")
    assert store.has_blob(digest)
    missing = hashlib.sha256(b"missing").hexdigest()
    assert not store.has_blob(missing)
    assert store.partial_bytes(missing) == 0
    partial = layout.partial(missing)
    partial.write_bytes(b"\0" * 8192)
    partial.with_name(partial.name + ".json").write_text("{}")
    assert store.partial_bytes(missing) >= 8192
    store.discard_partial(partial)
    assert list(layout.tmp.iterdir()) == []
    store.discard_partial(partial)  # idempotent


def test_publish_blob(store: Cache, layout: Layout) -> None:
    data = b"published"
    digest = hashlib.sha256(data).hexdigest()
    partial = layout.partial(digest)
    partial.write_bytes(data)
    partial.with_name(partial.name + ".json").write_text("{}")
    blob = store.publish_blob(partial, digest)
    assert blob == layout.blob(digest)
    assert blob.read_bytes() == data
    assert blob.stat().st_mode & 0o777 == 0o444
    assert list(layout.tmp.iterdir()) == []


def test_publish_blob_refuses_a_partial_replaced_by_a_symlink_and_changes_nothing(
    store: Cache, layout: Layout, tmp_path: Path
) -> None:
    """A symlink put in place of a verified partial (by whoever can write the cache) is
    neither published nor followed: its target keeps its mode."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"published")
    victim.chmod(0o600)
    digest = hashlib.sha256(b"published").hexdigest()
    partial = layout.partial(digest)
    partial.symlink_to(victim)
    with pytest.raises(IntegrityError, match="not a regular file"):
        store.publish_blob(partial, digest)
    assert not layout.blob(digest).exists()
    assert victim.stat().st_mode & 0o777 == 0o600


# -- FileLock ----------------------------------------------------------------------------------


def test_file_lock_is_exclusive_between_lock_objects(tmp_path: Path) -> None:
    path = tmp_path / "rev-m@r.lock"
    first, second = FileLock(path, "m/r"), FileLock(path, "m/r")
    try:
        assert first.try_acquire() is True
        assert second.try_acquire() is False  # flock is per open file description
        assert second.try_acquire() is False
        first.release()
        assert second.try_acquire() is True
        assert first.try_acquire() is False
    finally:
        first.release()
        second.release()
    assert path.exists()


def test_file_lock_acquire_gives_up_while_held(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    holder, waiter = FileLock(path, "x"), FileLock(path, "x")
    try:
        assert holder.acquire() is True
        assert waiter.acquire(give_up=lambda: True) is False  # a stalled holder: give up
        holder.release()
        holder.release()  # releasing twice is harmless
        assert waiter.acquire(give_up=lambda: True) is True  # free: no waiting, no giving up
        assert holder.try_acquire() is False
    finally:
        holder.release()
        waiter.release()


def test_orphans_spare_the_blobs_a_running_fetch_noted_in_its_lock(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"kept.bin": b"K" * 50})
    store.assemble(marker, m)
    wanted, stray = put_blob(b"about to be linked"), put_blob(b"left by a failed fetch")
    running = FileLock(layout.revision_lock("n", "r"), "n/r")
    assert running.try_acquire()
    running.note(f"{wanted}\n{hashlib.sha256(b'not here').hexdigest()}\n")
    # A lock nobody holds tells nothing, whatever it says.
    idle = FileLock(layout.revision_lock("o", "r"), "o/r")
    assert idle.try_acquire()
    idle.note(f"{stray}\n")
    idle.release()
    assert store.wanted_by_running_fetches() >= {wanted}
    assert [(p.name, size) for p, size in store.orphans()] == [(stray, 22)]
    assert store.collect_orphans() == 22
    assert sorted(p.name for p in layout.blobs.iterdir()) == sorted(
        [hashlib.sha256(b"K" * 50).hexdigest(), wanted]
    )
    running.release()  # the fetch ended without linking it: now it is an orphan
    assert store.collect_orphans() == len(b"about to be linked")
    assert store.ready("m", "r") == marker


@pytest.mark.timeout(10)
def test_a_held_revision_lock_planted_as_a_fifo_is_ignored_not_waited_on(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    wanted = put_blob(b"about to be linked")
    running = FileLock(layout.revision_lock("m", "r"), "m@r")
    assert running.try_acquire()
    running.note(f"{wanted}\n")
    planted = layout.locks / "rev-evil@r.lock"
    os.mkfifo(planted)
    holder = FileLock(planted, "evil")  # held, and open for writing: a read would block
    try:
        assert holder.try_acquire()
        assert store.wanted_by_running_fetches() == {wanted}
    finally:
        holder.release()
        running.release()


def test_retire_revision_renames_it_away_for_the_caller_to_delete(
    store: Cache, layout: Layout, put_blob: PutBlob
) -> None:
    marker, m = _revision(put_blob, {"a.bin": b"A"})
    store.assemble(marker, m)
    trash = store.retire_revision("m", "r")
    assert trash is not None and trash.parent == layout.tmp and (trash / "a.bin").is_file()
    assert store.ready("m", "r") is None and not (layout.root / "m").exists()
    assert store.retire_revision("m", "r") is None


def test_a_copy_past_the_link_limit_is_never_written_through_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past EMLINK a blob is copied: into a new file, never into what a symlink planted at
    the name leads to."""
    blob, victim, dest = tmp_path / "blob", tmp_path / "victim", tmp_path / "dest"
    blob.write_bytes(b"blob bytes")
    victim.write_bytes(b"not the cache's")
    dest.symlink_to(victim)

    def emlink(src: object, dst: object) -> None:
        raise OSError(errno.EMLINK, "Too many links")

    monkeypatch.setattr(os, "link", emlink)
    with pytest.raises(FileExistsError):
        _link_or_copy(blob, dest)
    assert victim.read_bytes() == b"not the cache's"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    dest.unlink()
    assert _link_or_copy(blob, dest) is True
    assert dest.read_bytes() == b"blob bytes"
    assert stat.S_IMODE(dest.lstat().st_mode) == 0o444


def test_clean_tmp_removes_a_symlink_to_a_directory_not_what_it_leads_to(tmp_path: Path) -> None:
    layout = Layout.open(tmp_path / "cache")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the cache's")
    link = layout.tmp / "trash-0123456789abcdef"
    link.symlink_to(outside)
    os.utime(link, (0, 0), follow_symlinks=False)  # long stale
    Cache(layout).clean_tmp(older_than=60, partials_older_than=60)
    assert not link.is_symlink()
    assert (outside / "keep").read_text() == "not the cache's"
