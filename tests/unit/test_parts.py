"""parts: range planning and the resumable part state of a partial blob."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from weightcache.transfer.parts import MAX_STATE_BYTES, PartState, plan_parts


@pytest.mark.parametrize(
    ("size", "part_size", "expected"),
    [
        (0, 4, [(0, 0)]),
        (1, 4, [(0, 1)]),
        (3, 4, [(0, 3)]),
        (4, 4, [(0, 4)]),
        (8, 4, [(0, 4), (4, 8)]),
        (10, 4, [(0, 4), (4, 8), (8, 10)]),
        (9, 4, [(0, 4), (4, 8), (8, 9)]),
        (5, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_plan_parts_literal(size: int, part_size: int, expected: list[tuple[int, int]]) -> None:
    assert plan_parts(size, part_size) == expected


@pytest.mark.parametrize("part_size", [1, 3, 7, 16, 4096])
@pytest.mark.parametrize("size", [1, 2, 15, 16, 17, 1000, 4095, 4097, 3 * 4096])
def test_plan_parts_covers_exactly(size: int, part_size: int) -> None:
    parts = plan_parts(size, part_size)
    assert parts[0][0] == 0
    assert parts[-1][1] == size
    for (_, end), (start, _) in itertools.pairwise(parts):
        assert end == start  # contiguous, no gap, no overlap
    assert all(end - start == part_size for start, end in parts[:-1])
    assert 0 < parts[-1][1] - parts[-1][0] <= part_size  # only the last part may be short
    assert len(parts) == -(-size // part_size)


def test_plan_parts_of_a_large_shard() -> None:
    size = 5 * (1 << 30) + 123  # a 5 GiB safetensors shard and change
    parts = plan_parts(size, 16 << 20)
    assert len(parts) == 321
    assert parts[-1] == (320 * (16 << 20), size)
    assert sum(end - start for start, end in parts) == size


def _state(size: int, part_size: int, done: set[int]) -> PartState:
    state = PartState(size, part_size)
    for i in done:
        state.done[i] = True
    return state


def test_part_state_fresh() -> None:
    state = PartState(10, 4)
    assert state.parts == [(0, 4), (4, 8), (8, 10)]
    assert state.done == [False, False, False]
    assert state.pending() == [0, 1, 2]
    assert state.contiguous_end() == 0
    assert state.bytes_done() == 0


@pytest.mark.parametrize(
    ("done", "contiguous_end", "pending", "bytes_done"),
    [
        ({0}, 4, [1, 2], 4),
        ({1}, 0, [0, 2], 4),
        ({2}, 0, [0, 1], 2),
        ({0, 2}, 4, [1], 6),
        ({0, 1}, 8, [2], 8),
        ({1, 2}, 0, [0], 6),
        ({0, 1, 2}, 10, [], 10),
    ],
)
def test_part_state_progress(
    done: set[int], contiguous_end: int, pending: list[int], bytes_done: int
) -> None:
    state = _state(10, 4, done)
    assert state.contiguous_end() == contiguous_end
    assert state.pending() == pending
    assert state.bytes_done() == bytes_done


def test_part_state_empty_object() -> None:
    state = PartState(0, 4)
    assert state.parts == [(0, 0)]
    assert state.pending() == [0]
    assert (state.contiguous_end(), state.bytes_done()) == (0, 0)
    state.done[0] = True
    assert state.pending() == []
    assert (state.contiguous_end(), state.bytes_done()) == (0, 0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    state = _state(10, 4, {0, 2})
    state.save(path)
    assert json.loads(path.read_text()) == {
        "version": 2,
        "size": 10,
        "part_size": 4,
        "written": [4, 0, 2],
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.part.json"]  # no temp left
    loaded = PartState.load(path, 10, 4)
    assert loaded.parts == state.parts
    assert loaded.done == [True, False, True]
    assert loaded.bytes_done() == 6

    _state(10, 4, {0, 1, 2}).save(path)  # overwrite
    assert PartState.load(path, 10, 4).pending() == []


def test_load_missing_file_is_fresh(tmp_path: Path) -> None:
    state = PartState.load(tmp_path / "absent.json", 10, 4)
    assert state.done == [False, False, False]


@pytest.mark.parametrize("size", [11, 9])
def test_load_another_size_is_fresh(tmp_path: Path, size: int) -> None:
    path = tmp_path / "x.part.json"
    _state(10, 4, {0, 1}).save(path)
    state = PartState.load(path, size, 4)
    assert state.parts == plan_parts(size, 4)
    assert state.done == [False] * len(state.parts)


@pytest.mark.parametrize(
    ("part_size", "written"),
    [
        (5, [5, 3]),  # [0, 8) written: part 0 whole, part 1 up to 8
        (2, [2, 2, 2, 2, 0]),
        (3, [3, 3, 2, 0]),  # part 2 is [6, 9): 6 and 7 written
        (10, [8]),
        (16, [8]),
    ],
)
def test_a_state_saved_with_another_part_size_keeps_its_bytes(
    tmp_path: Path, part_size: int, written: list[int]
) -> None:
    # A fetch resumed with another --part-size: the bytes on disk are the same bytes.
    path = tmp_path / "x.part.json"
    _state(10, 4, {0, 1}).save(path)  # [0, 8) written
    state = PartState.load(path, 10, part_size)
    assert state.parts == plan_parts(10, part_size)
    assert state.snapshot() == written
    assert state.bytes_done() == sum(written)
    assert state.contiguous_end() == 8


def test_another_part_size_keeps_only_the_written_start_of_each_new_part(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    old = PartState(12, 4)
    old.note_written(0, 2)  # [0, 2)
    old.done[1] = True  # [4, 8)
    old.note_written(2, 10)  # [8, 10)
    old.save(path)
    # parts of 6: [0, 6) holds [0, 2) at its start (4 and 5 cannot count: 2 and 3 are
    # missing before them); [6, 12) holds [6, 10), the rest of the run [4, 10)
    assert PartState.load(path, 12, 6).snapshot() == [2, 4]
    # parts of 3: [0,3) 2, [3,6) 0 (4 and 5 are written, 3 is not), [6,9) 3, [9,12) 1
    assert PartState.load(path, 12, 3).snapshot() == [2, 0, 3, 1]


@pytest.mark.parametrize(
    "content",
    [
        '{"version": 2, "size": 10, "part_size": 0, "written": [4, 0, 0]}',
        '{"version": 2, "size": 10, "part_size": -4, "written": [4, 0, 0]}',
        '{"version": 2, "size": 10, "part_size": 1, "written": [1]}',  # not its part count
        '{"version": 2, "size": 10, "part_size": 5, "written": [5, 6]}',  # past its part
    ],
)
def test_a_malformed_state_of_another_part_size_is_fresh(tmp_path: Path, content: str) -> None:
    path = tmp_path / "x.part.json"
    path.write_text(content)
    assert PartState.load(path, 10, 4).snapshot() == [0, 0, 0]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        pytest.param(b"[" * 100_000, id="nested"),  # RecursionError in json.loads
        b'{"size": 10, "part_size": 4, "done": [0, 1',  # torn write
        b"\xff\xfe\x00garbage",
        b"[]",
        b"null",
        b"42",
        b"{}",
        b'{"size": 10, "part_size": 4}',
        b'{"size": 10, "part_size": 4, "done": [0, 99]}',  # out of range, after a valid one
        b'{"size": 10, "part_size": 4, "done": [0, 3]}',  # just past the last of 3 parts
        b'{"size": 10, "part_size": 4, "done": [0, "x"]}',
        b'{"size": 10, "part_size": 4, "done": [0, null]}',
        b'{"size": 10, "part_size": 4, "done": 3}',
    ],
)
def test_load_garbage_is_fresh(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.part.json"
    path.write_bytes(content)
    state = PartState.load(path, 10, 4)
    assert state.parts == [(0, 4), (4, 8), (8, 10)]
    assert state.done == [False, False, False]


def test_load_negative_index_is_fresh(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    path.write_text('{"size": 10, "part_size": 4, "done": [-1]}')
    assert PartState.load(path, 10, 4).done == [False, False, False]


def test_a_part_written_in_part_round_trips_and_resumes_at_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    state = _state(10, 4, {0})
    state.note_written(1, 7)  # part 1 is [4, 8): 3 bytes written
    state.note_written(2, 9)
    state.note_written(1, 5)  # a stale report never moves it back
    state.save(path)
    assert json.loads(path.read_text())["written"] == [4, 3, 1]
    loaded = PartState.load(path, 10, 4)
    assert loaded.done == [True, False, False]
    assert loaded.pending() == [1, 2]
    assert [loaded.resume_at(i) for i in (1, 2)] == [7, 9]
    assert loaded.bytes_done() == 4 + 3 + 1
    assert loaded.contiguous_end() == 7  # part 0 complete, then part 1's written start


def test_a_part_written_to_its_end_loads_as_done(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    path.write_text('{"version": 2, "size": 10, "part_size": 4, "written": [4, 4, 2]}')
    loaded = PartState.load(path, 10, 4)
    assert loaded.done == [True, True, True]
    assert loaded.pending() == []
    assert loaded.contiguous_end() == 10


@pytest.mark.parametrize(
    ("done", "written", "contiguous_end"),
    [
        (set(), {0: 3}, 3),  # the first part's written start alone
        ({0}, {1: 0}, 4),
        ({0}, {1: 2, 2: 1}, 6),  # part 2's bytes do not join: part 1 has a gap
        ({0, 1}, {2: 1}, 9),
        (set(), {1: 4}, 0),  # written to its end but not marked done: still a gap at 0
        ({1, 2}, {0: 2}, 2),
    ],
)
def test_contiguous_end_includes_the_written_start_of_the_first_incomplete_part(
    done: set[int], written: dict[int, int], contiguous_end: int
) -> None:
    state = _state(10, 4, done)
    for i, n in written.items():
        state.note_written(i, state.parts[i][0] + n)
    assert state.contiguous_end() == contiguous_end


def test_a_version_1_state_resumes_its_done_parts_and_restarts_the_others(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.part.json"
    path.write_text('{"size": 10, "part_size": 4, "done": [0, 2]}')  # before per-byte resume
    loaded = PartState.load(path, 10, 4)
    assert loaded.done == [True, False, True]
    assert loaded.written == [0, 0, 0]
    assert loaded.resume_at(1) == 4
    assert loaded.contiguous_end() == 4


@pytest.mark.parametrize(
    "content",
    [
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, 5, 0]}',  # past its part
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, -1, 0]}',
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, 0]}',  # a part missing
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, 0, 0, 0]}',
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, 1.5, 0]}',
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, "2", 0]}',
        '{"version": 2, "size": 10, "part_size": 4, "written": [true, 0, 0]}',
        '{"version": 2, "size": 10, "part_size": 4, "written": [4, null, 0]}',
        '{"version": 2, "size": 10, "part_size": 4, "written": {"0": 4}}',
        '{"version": 2, "size": 10, "part_size": 4, "written": 4}',
        '{"version": 2, "size": 10, "part_size": 4, "done": [0]}',  # v2 without its counts
        '{"version": 3, "size": 10, "part_size": 4, "written": [4, 0, 0]}',  # from the future
        '{"version": "2", "size": 10, "part_size": 4, "written": [4, 0, 0]}',
        '{"version": 2, "size": 10.0, "part_size": 4, "written": [4, 0, 0]}',
        '{"version": 2, "size": 10, "part_size": 4.0, "written": [4, 0, 0]}',
        '{"size": 10, "part_size": 4, "done": [true]}',  # v1: true is not index 1
        '{"size": 10, "part_size": 4, "done": [0, 2.0]}',
    ],
)
def test_load_malformed_progress_is_fresh(tmp_path: Path, content: str) -> None:
    path = tmp_path / "x.part.json"
    path.write_text(content)
    state = PartState.load(path, 10, 4)
    assert state.done == [False, False, False]
    assert state.written == [0, 0, 0]
    assert state.contiguous_end() == 0


def test_load_geometry_given_as_booleans_is_fresh(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    path.write_text('{"version": 2, "size": true, "part_size": true, "written": [1]}')
    assert PartState.load(path, 1, 1).done == [False]


@pytest.mark.timeout(10)
def test_load_a_state_planted_as_no_regular_file_or_too_large_is_fresh(tmp_path: Path) -> None:
    path = tmp_path / "x.part.json"
    os.mkfifo(path)
    assert PartState.load(path, 10, 4).done == [False, False, False]
    path.unlink()
    path.symlink_to("/dev/zero")
    assert PartState.load(path, 10, 4).done == [False, False, False]
    path.unlink()
    complete = '{"version": 2, "size": 10, "part_size": 4, "written": [4, 4, 2]}'
    path.write_text(complete)
    assert PartState.load(path, 10, 4).done == [True, True, True]
    path.write_text(complete + " " * MAX_STATE_BYTES)  # well formed, but not from save()
    assert PartState.load(path, 10, 4).done == [False, False, False]


def test_a_state_claiming_more_parts_than_its_file_could_hold_is_fresh(tmp_path: Path) -> None:
    # Its part size alone would plan ten billion parts before its counts were read.
    path = tmp_path / "x.part.json"
    path.write_text('{"version": 2, "size": 10000000000, "part_size": 1, "written": [1]}')
    assert PartState.load(path, 10**10, 10**9).snapshot() == [0] * 10
