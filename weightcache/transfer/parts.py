"""Range arithmetic and the resumable part state of one partial blob (pure, no network).

A partial blob `<hex>.part` is preallocated to its full size; parts are written at their
offsets in any order. `<hex>.part.json` records which parts are complete, rewritten by
rename at most every SAVE_INTERVAL (partial.py) and when a download stops short, so a
process killed at any instant leaves a state that only ever under-reports: a resumed
download refetches at most the parts in flight or finished in that last interval when it
died. The final sha256 check catches anything else (design §4, Resume).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `size` bytes; one empty part for an empty object."""
    if size == 0:
        return [(0, 0)]
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


@dataclass
class PartState:
    """Which parts of a partial blob are on disk, and the hash frontier."""

    size: int
    part_size: int
    parts: list[tuple[int, int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = plan_parts(self.size, self.part_size)
        if not self.done:
            self.done = [False] * len(self.parts)

    def contiguous_end(self) -> int:
        """End of the longest prefix of completed parts: how far hashing may advance."""
        end = 0
        for (_, part_end), complete in zip(self.parts, self.done, strict=True):
            if not complete:
                break
            end = part_end
        return end

    def pending(self) -> list[int]:
        return [i for i, complete in enumerate(self.done) if not complete]

    def bytes_done(self) -> int:
        return sum(e - s for (s, e), d in zip(self.parts, self.done, strict=True) if d)

    # -- persistence next to the partial file -------------------------------------------------

    def save(self, path: Path, done: list[bool] | None = None) -> None:
        """Write the state (or a snapshot `done` of it) atomically; safe from any thread:
        a stale snapshot renamed last only under-reports."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        data = {
            "size": self.size,
            "part_size": self.part_size,
            "done": [i for i, d in enumerate(self.done if done is None else done) if d],
        }
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, size: int, part_size: int) -> PartState:
        """The saved state if it matches this size and part size, else a fresh one."""
        fresh = cls(size, part_size)
        try:
            data = json.loads(path.read_text())
            if data["size"] != size or data["part_size"] != part_size:
                return fresh
            for i in data["done"]:
                if not 0 <= int(i) < len(fresh.done):
                    return cls(size, part_size)
                fresh.done[int(i)] = True
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return cls(size, part_size)
        return fresh
