"""pieces: a blob's piece ranges and the bitmaps peers advertise (pure)."""

from __future__ import annotations

import random

import pytest

from weightcache.swarm.pieces import Bitmap, BitmapError, piece_count, piece_ranges


@pytest.mark.parametrize(
    ("size", "piece", "expected"),
    [
        (0, 4, []),
        (1, 4, [(0, 1)]),
        (4, 4, [(0, 4)]),
        (5, 4, [(0, 4), (4, 5)]),
        (12, 4, [(0, 4), (4, 8), (8, 12)]),
        (3, 1, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_piece_ranges(size: int, piece: int, expected: list[tuple[int, int]]) -> None:
    assert piece_ranges(size, piece) == expected
    assert piece_count(size, piece) == len(expected)


@pytest.mark.parametrize(("size", "piece"), [(-1, 4), (4, 0), (4, -1)])
def test_piece_ranges_refuses_nonsense(size: int, piece: int) -> None:
    with pytest.raises(ValueError):
        piece_ranges(size, piece)


@pytest.mark.parametrize(
    ("count", "pieces", "text"),
    [
        (0, [], ""),
        (1, [0], "AQ=="),
        (8, [0, 7], "gQ=="),
        (10, [0, 9], "AQI="),
        (16, range(16), "//8="),
    ],
)
def test_bitmap_encoding_literal(count: int, pieces: list[int], text: str) -> None:
    bitmap = Bitmap.of(count, pieces)
    assert bitmap.encode() == text
    assert Bitmap.decode(count, text) == bitmap
    assert list(bitmap) == sorted(pieces)
    assert len(bitmap) == len(list(pieces))


def test_bitmap_roundtrip_random() -> None:
    rng = random.Random(7)
    for _ in range(200):
        count = rng.randrange(0, 300)
        bitmap = Bitmap(count, rng.getrandbits(count) if count else 0)
        assert Bitmap.decode(count, bitmap.encode()) == bitmap


@pytest.mark.parametrize(
    ("count", "text", "says"),
    [
        (10, "AQ==", "has 1 bytes, a blob of 10 pieces needs 2"),  # too short
        (8, "AQI=", "has 2 bytes, a blob of 8 pieces needs 1"),  # too long
        (0, "AA==", "has 1 bytes, a blob of 0 pieces needs 0"),
        (10, "AQQ=", "does not fit 10 pieces"),  # bit 10 set: past the last piece
        (10, "AQL=", "not canonical"),  # stray bits in the padding
        (10, "AQ I=", "not base64"),
        (10, "A*I=", "not base64"),
        (10, "AQI", "not base64"),
        (10, "AQÏ=", "not base64"),
    ],
)
def test_bitmap_decode_refuses_untrusted_input(count: int, text: str, says: str) -> None:
    with pytest.raises(BitmapError, match=says):
        Bitmap.decode(count, text)


def test_bitmap_contents() -> None:
    assert Bitmap.full(5).complete and list(Bitmap.full(5)) == [0, 1, 2, 3, 4]
    assert not Bitmap.of(5, [0, 1]).complete
    assert Bitmap(0).complete
    assert 3 in Bitmap.of(5, [3]) and 4 not in Bitmap.of(5, [3]) and 9 not in Bitmap.full(5)
    with pytest.raises(BitmapError):
        Bitmap.of(5, [5])
    with pytest.raises(BitmapError):
        Bitmap(3, 0b1000)
