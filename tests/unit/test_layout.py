"""layout: path segments, the cache tree, and the refusal to resolve outside DIR (§3 inv. 5)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from weightcache.cache.layout import MARKER, Layout, check_segment
from weightcache.errors import UsageError

HEX = hashlib.sha256(b"blob").hexdigest()


@pytest.mark.parametrize(
    "value",
    [
        "qwen3-70b",
        "2026-10-01",
        "v1.0+cu121",
        "a@b=c",
        "A_b",
        "7",
        "x" * 255,
        "a..b",
        "main.",
        "abc-",
    ],
)
def test_check_segment_accepts(value: str) -> None:
    assert check_segment(value, "model name") == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        ".",
        "..",
        MARKER,
        ".hidden",
        "-x",
        "_x",
        "+x",
        "a/b",
        "a\\b",
        "a b",
        "a\nb",
        "a\n",
        "x" * 256,
        "é",
        "a:b",
        "a*b",
        "a%2f",
    ],
)
def test_check_segment_rejects(value: str) -> None:
    with pytest.raises(UsageError) as info:
        check_segment(value, "revision")
    assert str(info.value).startswith(f"invalid revision {value!r}")


def test_open_creates_the_internal_tree(tmp_path: Path) -> None:
    layout = Layout.open(tmp_path / "cache")
    root = (tmp_path / "cache").resolve()
    assert layout.root == root
    assert layout.internal == root / ".weightcache"
    assert layout.blobs == root / ".weightcache" / "blobs" / "sha256"
    assert layout.tmp == root / ".weightcache" / "tmp"
    assert layout.locks == root / ".weightcache" / "locks"
    assert layout.state_db == root / ".weightcache" / "state.db"
    assert layout.socket == root / ".weightcache" / "daemon.sock"
    for d in (layout.blobs, layout.tmp, layout.locks):
        assert d.is_dir()
    assert Layout.open(tmp_path / "cache") == layout  # idempotent


def test_open_resolves_a_symlinked_cache_dir(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    layout = Layout.open(tmp_path / "link")
    assert layout.root == (tmp_path / "real").resolve()
    assert layout.revision_dir("m", "r") == layout.root / "m" / "r"


def test_open_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        Layout.open(tmp_path / "f")


def test_paths_of_a_revision(layout: Layout) -> None:
    rev = layout.revision_dir("qwen3-70b", "2026-10-01")
    assert rev == layout.root / "qwen3-70b" / "2026-10-01"
    assert layout.marker("m", "r") == layout.root / "m" / "r" / MARKER
    assert layout.revision_lock("m", "r") == layout.locks / "rev-m@r.lock"
    assert layout.blob_lock(HEX) == layout.locks / f"blob-{HEX}.lock"
    assert layout.partial(HEX) == layout.tmp / f"{HEX}.part"


@pytest.mark.parametrize(
    ("name", "revision"), [("..", "r"), ("m", ".."), ("a/b", "r"), ("m", "/etc"), (MARKER, "blobs")]
)
def test_revision_dir_rejects_bad_segments(layout: Layout, name: str, revision: str) -> None:
    with pytest.raises(UsageError):
        layout.revision_dir(name, revision)


def test_revision_dir_refuses_a_name_symlinked_outside(layout: Layout, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (layout.root / "evil").symlink_to(outside)
    with pytest.raises(UsageError) as info:
        layout.revision_dir("evil", "r")
    assert "outside the cache directory" in str(info.value)
    assert str(outside) in str(info.value)
    with pytest.raises(UsageError):
        layout.marker("evil", "r")
    assert list(outside.iterdir()) == []


def test_revision_dir_refuses_a_revision_symlinked_outside(layout: Layout, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (layout.root / "m").mkdir()
    (layout.root / "m" / "r").symlink_to(outside)
    with pytest.raises(UsageError, match="outside the cache directory"):
        layout.revision_dir("m", "r")


def test_revision_dir_refuses_a_dangling_symlink_outside(layout: Layout, tmp_path: Path) -> None:
    (layout.root / "m").symlink_to(tmp_path / "does-not-exist-yet")
    with pytest.raises(UsageError):
        layout.revision_dir("m", "r")


def test_revision_dir_allows_a_symlink_that_stays_inside(layout: Layout) -> None:
    (layout.root / "real").mkdir()
    (layout.root / "alias").symlink_to(layout.root / "real")
    assert layout.revision_dir("alias", "r") == layout.root / "alias" / "r"


def test_check_inside(layout: Layout, tmp_path: Path) -> None:
    layout.check_inside(layout.root)
    layout.check_inside(layout.root / "m" / "r" / "x")
    with pytest.raises(UsageError):
        layout.check_inside(layout.root / ".." / "elsewhere")
    with pytest.raises(UsageError):
        layout.check_inside(tmp_path)


def test_blob_path(layout: Layout) -> None:
    assert layout.blob(HEX) == layout.blobs / HEX


@pytest.mark.parametrize(
    "value",
    [
        HEX.upper(),
        HEX[:63],
        HEX + "0",
        "g" * 64,
        "",
        "../" + HEX[3:],
        HEX[:63] + "\n",
        " " + HEX[1:],
        f"sha256:{HEX}",
    ],
)
def test_blob_rejects_non_hex(layout: Layout, value: str) -> None:
    with pytest.raises(ValueError, match="not a sha256 hex digest"):
        layout.blob(value)


def test_revisions_lists_real_directories_only(layout: Layout, tmp_path: Path) -> None:
    (layout.root / "b" / "r2").mkdir(parents=True)
    (layout.root / "b" / "r1").mkdir()
    (layout.root / "a" / "r").mkdir(parents=True)
    (layout.root / "a" / "file").write_text("x")
    (layout.root / "a" / "link").symlink_to(layout.root / "b" / "r1")
    (layout.root / "linked").symlink_to(layout.root / "b")
    (layout.root / "stray").write_text("x")
    assert layout.revisions() == [("a", "r"), ("b", "r1"), ("b", "r2")]


def test_every_name_under_tmp_comes_from_the_layout(layout: Layout) -> None:
    digest = "ab" * 32
    shared, private = layout.partial(digest), layout.partial(digest, private=True)
    assert Layout.part_state(shared) == layout.tmp / f"{digest}.part.json"
    assert Layout.part_state(private).name == f"{private.name}.json"
    assert not Layout.is_private_partial(shared.name)
    assert not Layout.is_private_partial(Layout.part_state(shared).name)
    assert Layout.is_private_partial(private.name)
    assert Layout.is_private_partial(Layout.part_state(private).name)
    trash = layout.trash()
    assert trash.parent == layout.tmp and trash.name.startswith("trash-")
    assert trash != layout.trash()  # fresh every time
    staging = layout.staging("m", "r")
    assert staging.parent == layout.tmp and not Layout.is_private_partial(staging.name)


def test_the_cache_and_the_downloader_name_a_part_state_alike(tmp_path: Path) -> None:
    from weightcache.transfer.partial import state_path

    partial = tmp_path / ("ab" * 32 + ".part")
    assert Layout.part_state(partial) == state_path(partial)
