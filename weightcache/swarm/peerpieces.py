"""Which pieces of a blob this node holds, as its peer server advertises them (design §8):
every byte of a complete blob (`all`), or the pieces of a partial that its downloader
recorded as written, with those in flight and streamed when a swarm download says. The
client side reads them back with `wire.parse_view`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from weightcache.smallfile import read_small
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.wire import FETCHING, PIECE_SIZE, PIECES, STREAMING
from weightcache.transfer.parts import MAX_STATE_BYTES, PartState

ALL = "all"  # the pieces header of a complete blob


def encode_pieces(held: list[bool]) -> str:
    """The pieces header for a bitmap (`swarm.Bitmap.encode`: base64 of ceil(n / 8) bytes,
    piece i in bit i % 8 of byte i // 8)."""
    return Bitmap.of(len(held), (i for i, h in enumerate(held) if h)).encode()


def parse_pieces(text: str, count: int) -> list[bool]:
    """The pieces held, from a pieces header for a blob of `count` pieces (`all`, or what
    `encode_pieces` writes). Raises ValueError (`BitmapError`) for anything else."""
    if text == ALL:
        return [True] * count
    held = Bitmap.decode(count, text)
    return [i in held for i in range(count)]


@dataclass(frozen=True)
class Pieces:
    """Which pieces of a blob this node holds: every byte (`held` None: a complete blob),
    or the pieces of `piece_size` bytes (the last one shorter) marked in `held`."""

    size: int
    piece_size: int = 0
    held: tuple[bool, ...] | None = None
    fetching: Bitmap | None = None  # in flight, when a running swarm download says
    streaming: Bitmap | None = None  # of those, the ones it passes on as they arrive

    def streamed_piece(self, start: int, end: int) -> int | None:
        """The piece that [start, end) lies in, if that piece is streamed (not held)."""
        if self.streaming is None or not self.piece_size or end <= start:
            return None
        piece = start // self.piece_size
        last = (end - 1) // self.piece_size
        return piece if piece == last and piece in self.streaming else None

    def header(self) -> str:
        return ALL if self.held is None else encode_pieces(list(self.held))

    def run_end(self, pos: int) -> int:
        """End of the run of held bytes from `pos` (`pos` itself: its piece is not held)."""
        if self.held is None:
            return self.size
        i = pos // self.piece_size
        while i < len(self.held) and self.held[i]:
            i += 1
        return max(pos, min(self.size, i * self.piece_size))

    def covers(self, start: int, end: int) -> bool:
        """Whether every byte of [start, end) is in a held piece."""
        pos = start
        while pos < end:
            run = self.run_end(pos)
            if run == pos:
                return False
            pos = run
        return True


def partial_pieces(state_path: Path, size: int) -> Pieces:
    """The pieces of a partial blob its downloader recorded as written: the parts of its
    part state (weightcache/transfer/parts.py), a part held once done. The one place that
    reads a part state here."""
    try:
        part_size = int(json.loads(read_small(state_path, MAX_STATE_BYTES))["part_size"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return Pieces(size, max(size, 1), (False,))
    if part_size < 4096:  # not what the downloader writes; never plan millions of parts
        return Pieces(size, max(size, 1), (False,))
    return Pieces(size, part_size, tuple(PartState.load(state_path, size, part_size).done))


def partial_prefix(state_path: Path, size: int) -> int:
    """Bytes at the start of a partial blob that its downloader recorded as written."""
    return partial_pieces(state_path, size).run_end(0)


def advertise(pieces: Pieces) -> dict[str, str]:
    """The response headers that say which pieces this node holds."""
    if pieces.held is None:
        return {PIECES: ALL}
    headers = {PIECES: pieces.header(), PIECE_SIZE: str(pieces.piece_size)}
    if pieces.fetching is not None:
        headers[FETCHING] = pieces.fetching.encode()
    if pieces.streaming is not None:
        headers[STREAMING] = pieces.streaming.encode()
    return headers
