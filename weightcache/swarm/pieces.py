"""A blob's pieces as the swarm exchanges them (design §8, Swarm): their size and byte ranges,
which every node computes alike from the blob's size, and `Bitmap`, a set of pieces as
peers advertise it (the held ones, those in flight, those streamed from the store).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from weightcache.swarm.bitsets import iter_bits


class BitmapError(ValueError):
    """An advertised bitmap that does not parse or does not fit the blob's piece count.

    A ValueError, not a WeightcacheError: it comes from a peer, never ends the process; the
    caller treats the peer as one that answered badly.
    """


PIECE_MIN, PIECE_MAX = 256 << 10, 4 << 20  # a piece: a few MiB (design §8, Swarm)
#: Pieces per blob at least, blob size allowing: enough to spread early (32), and more (64)
#: while they stay at least SPLIT_MIN, so that the store's last pieces reach every node
#: sooner without costing more than they spread (design §8, Data plane).
PIECES_WANTED, PIECES_SPLIT, SPLIT_MIN = 32, 64, 1 << 20


def piece_size_for(size: int) -> int:
    """The piece size of a blob shared with peers: PIECES_SPLIT pieces, or fewer of
    SPLIT_MIN, but at least PIECES_WANTED; each PIECE_MIN..PIECE_MAX bytes, a multiple of
    64 KiB (every node computes the same)."""
    split = max(SPLIT_MIN, -(-size // PIECES_SPLIT))
    want = min(split, -(-size // PIECES_WANTED))
    want = -(-want // (64 << 10)) * (64 << 10)
    return max(PIECE_MIN, min(PIECE_MAX, want))


def piece_count(size: int, piece_size: int) -> int:
    """How many pieces cover `size` bytes; 0 for an empty blob (nothing to exchange)."""
    if size < 0 or piece_size <= 0:
        raise ValueError(f"size {size} and piece size {piece_size} must be >= 0 and > 0")
    return -(-size // piece_size)


def piece_ranges(size: int, piece_size: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of the pieces of a `size`-byte blob; none for an empty one."""
    return [
        (start, min(start + piece_size, size))
        for start in range(0, piece_count(size, piece_size) * piece_size, piece_size)
    ]


@dataclass(frozen=True)
class Bitmap:
    """A set of piece indices of a blob of `count` pieces; bit i of `bits` is piece i."""

    count: int
    bits: int = 0

    def __post_init__(self) -> None:
        if self.count < 0 or self.bits < 0 or self.bits >> self.count:
            raise BitmapError(f"bitmap {self.bits:#x} does not fit {self.count} pieces")

    @classmethod
    def full(cls, count: int) -> Bitmap:
        return cls(count, (1 << count) - 1)

    @classmethod
    def of(cls, count: int, pieces: Iterable[int]) -> Bitmap:
        bits = 0
        for piece in pieces:
            if not 0 <= piece < count:
                raise BitmapError(f"piece {piece} out of range for {count} pieces")
            bits |= 1 << piece
        return cls(count, bits)

    def __contains__(self, piece: int) -> bool:
        return 0 <= piece < self.count and bool(self.bits >> piece & 1)

    def __iter__(self) -> Iterator[int]:
        return iter_bits(self.bits)

    def __len__(self) -> int:
        """How many pieces are in the set (not the piece count)."""
        return self.bits.bit_count()

    @property
    def complete(self) -> bool:
        return self.bits == (1 << self.count) - 1

    def encode(self) -> str:
        """Base64 of ceil(count / 8) bytes, piece i in bit i % 8 of byte i // 8 (LSB first)."""
        return base64.b64encode(self.bits.to_bytes((self.count + 7) // 8, "little")).decode()

    @classmethod
    def decode(cls, count: int, text: str) -> Bitmap:
        """Parse `encode`'s output for a blob of `count` pieces; anything else is refused.

        Raises BitmapError for anything but canonical base64 (no whitespace, no stray bits
        in the padding), a length other than ceil(count / 8) bytes, or a bit set past the
        last piece.
        """
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error) as e:
            raise BitmapError(f"bitmap for {count} pieces is not base64: {e}") from e
        if base64.b64encode(raw).decode() != text:
            raise BitmapError(f"bitmap for {count} pieces is not canonical base64: {text[:40]!r}")
        if len(raw) != (count + 7) // 8:
            raise BitmapError(
                f"bitmap has {len(raw)} bytes, a blob of {count} pieces needs {(count + 7) // 8}"
            )
        return cls(count, int.from_bytes(raw, "little"))
