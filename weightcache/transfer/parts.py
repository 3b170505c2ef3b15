"""Range arithmetic and the resumable part state of one partial blob (pure, no network).

A partial blob `<hex>.part` is preallocated to its full size; parts are written at their
offsets in any order, each from its start onwards. `<hex>.part.json` records, per part,
how many bytes at its start are written (a complete part: all of them). The downloader
updates that count after each write returns and rewrites the file by rename at most every
SAVE_INTERVAL (partial.py) and when a download stops short, so the file only ever
under-reports: a process killed at any instant (kill -9 of a fetch or the daemon) loses
at most the bytes in flight plus those written in the last SAVE_INTERVAL, and the resumed
download re-fetches each part from its recorded offset, not from its start. Written bytes
survive a process kill in the page cache; a machine crash or power loss can leave the
file claiming bytes that never reached the disk, which the whole-blob sha256 checked
before publishing catches (design §4, Resume).

Format (version 2): `{"version": 2, "size": N, "part_size": P, "written": [n0, n1, ...]}`,
one count per part, each within its part. Version 1 (no "version" key) listed the indices
of complete parts under "done"; it is still read: those parts are complete, the others
start over. A state of another part size is read in this one (`in_parts_of`). Anything
else (unknown version, wrong types, a count outside its part, another size) is untrusted
and reads as a fresh state.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightcache.smallfile import read_small, replace_atomically

#: The version `save` writes.
VERSION = 2
#: The most of a state file that is read back (`read_small`): the state of a 5 TB blob in
#: 16 MiB parts, or of 1.2 TB in the swarm's 4 MiB pieces, is ~3 MiB. A larger file reads
#: as a fresh state: its download starts over, as after any state not written by `save`.
MAX_STATE_BYTES = 8 << 20


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `size` bytes; one empty part for an empty object."""
    if size == 0:
        return [(0, 0)]
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


@dataclass
class PartState:
    """Which bytes of a partial blob are on disk, and the hash frontier.

    `done[i]` marks a complete part; `written[i]` counts the bytes at the start of an
    incomplete part that are written (ignored once the part is done)."""

    size: int
    part_size: int
    parts: list[tuple[int, int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    written: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = plan_parts(self.size, self.part_size)
        if not self.done:
            self.done = [False] * len(self.parts)
        if not self.written:
            self.written = [0] * len(self.parts)

    def filled(self, index: int) -> int:
        """Bytes written at the start of part `index` (its length once it is done)."""
        start, end = self.parts[index]
        return end - start if self.done[index] else self.written[index]

    def resume_at(self, index: int) -> int:
        """The offset in the blob where fetching part `index` goes on."""
        return self.parts[index][0] + self.filled(index)

    def note_written(self, index: int, upto: int) -> None:
        """Record that part `index` is written up to blob offset `upto` (never backwards)."""
        start, end = self.parts[index]
        self.written[index] = max(self.written[index], min(upto, end) - start)

    def contiguous_end(self) -> int:
        """End of the longest written prefix of the blob: every complete part from the
        start, then the written start of the first incomplete one. How far hashing may
        advance, and how much of a partial a peer may serve."""
        for index, (start, _) in enumerate(self.parts):
            if not self.done[index]:
                return start + self.written[index]
        return self.size

    def pending(self) -> list[int]:
        return [i for i, complete in enumerate(self.done) if not complete]

    def bytes_done(self) -> int:
        """Bytes written, complete parts and the written starts of the others."""
        return sum(self.filled(i) for i in range(len(self.parts)))

    def snapshot(self) -> list[int]:
        """The written count of every part, as `save` takes it."""
        return [self.filled(i) for i in range(len(self.parts))]

    # -- persistence next to the partial file -------------------------------------------------

    def save(self, path: Path, written: list[int] | None = None) -> None:
        """Write the state (or a `snapshot()` of it) atomically; safe from any thread: a
        stale snapshot renamed last only under-reports."""
        data = {
            "version": VERSION,
            "size": self.size,
            "part_size": self.part_size,
            "written": self.snapshot() if written is None else written,
        }
        replace_atomically(path, json.dumps(data).encode())

    @classmethod
    def load(cls, path: Path, size: int, part_size: int) -> PartState:
        """The saved state if it is well formed and of this size, else a fresh one (never
        raises on what the file holds). A state saved with another part size (a download
        resumed with another --part-size) keeps its written bytes, in this part size."""
        state = cls(size, part_size)
        try:
            data = json.loads(read_small(path, MAX_STATE_BYTES))
        except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply
            return state
        saved = _saved_part_size(data, size) if isinstance(data, dict) else None
        if saved is None:
            return state
        if saved != part_size:
            old = cls(size, saved)
            return old.in_parts_of(part_size) if old.restore(data) else state
        return state if state.restore(data) else cls(size, part_size)

    def in_parts_of(self, part_size: int) -> PartState:
        """The same written bytes in parts of `part_size`: each new part is written up to
        the end of the written run its start begins (a new part resumes from its start)."""
        runs: list[list[int]] = []  # [start, end) of the written runs, merged, in order
        for i, (start, _) in enumerate(self.parts):
            end = start + self.filled(i)
            if end == start:
                continue
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        state = PartState(self.size, part_size)
        starts = [run[0] for run in runs]
        for i, (start, end) in enumerate(state.parts):
            k = bisect.bisect_right(starts, start) - 1
            if k >= 0 and runs[k][1] > start:
                state.note_written(i, min(runs[k][1], end))
                state.done[i] = runs[k][1] >= end and end > start
        return state

    def restore(self, data: dict[str, Any]) -> bool:
        """Take the per-part progress from a parsed file of either version; False (and
        possibly half-restored: discard it) when the file is not well formed."""
        version = data.get("version", 1)
        if version == 1:
            return self._restore_done(data.get("done"))
        if version == VERSION:
            return self._restore_written(data.get("written"))
        return False

    def _restore_done(self, indices: object) -> bool:
        if not isinstance(indices, list):
            return False
        for i in indices:
            if not _is_int(i) or not 0 <= i < len(self.parts):
                return False
            self.done[i] = True
        return True

    def _restore_written(self, counts: object) -> bool:
        if not isinstance(counts, list) or len(counts) != len(self.parts):
            return False
        for i, ((start, end), n) in enumerate(zip(self.parts, counts, strict=True)):
            if not _is_int(n) or not 0 <= n <= end - start:
                return False
            self.done[i], self.written[i] = n == end - start, n
        return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _saved_part_size(data: dict[str, Any], size: int) -> int | None:
    """The part size of a state file for a blob of `size` bytes (`true` is not 1 here);
    None when it is for another size, or its part count could not fit in a state file."""
    saved, part_size = data.get("size"), data.get("part_size")
    if not (_is_int(saved) and isinstance(part_size, int) and _is_int(part_size)):
        return None
    if saved != size or part_size <= 0 or -(-size // part_size) > MAX_STATE_BYTES // 2:
        return None  # the last: each count of the file takes 2 bytes or more
    return part_size
