"""Sets of piece indices as Python ints (bit i = piece i), for the swarm's choice (choice.py).

Whole-integer operations, so that a choice over thousands of pieces and dozens of peers
costs a few hundred of them whatever the piece count (the simulator in benchmarks/ calls
`choice.choose` for a thousand nodes).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator


def iter_bits(bits: int) -> Iterator[int]:
    """The indices of the set bits of `bits`, lowest first."""
    while bits:
        low = bits & -bits
        yield low.bit_length() - 1
        bits ^= low


def counts(bitmaps: Iterable[int]) -> list[int]:
    """Per-piece counts of set bits, bit-sliced: bit i of counts[k] is bit k of piece i's count.

    Adding a bitmap is a ripple-carry addition on whole integers, so counting D bitmaps costs
    about D * log2(D) integer operations whatever the piece count.
    """
    counts: list[int] = []
    for bits in bitmaps:
        carry = bits
        for k, level in enumerate(counts):
            counts[k], carry = level ^ carry, level & carry
            if not carry:
                break
        if carry:
            counts.append(carry)
    return counts


def rarest(candidates: int, counts: list[int]) -> int:
    """The candidates with the lowest count (compare counts from the most significant bit)."""
    for level in reversed(counts):
        fewer = candidates & ~level
        if fewer:
            candidates = fewer
    return candidates


def pick(bits: int, rng: random.Random) -> int:
    """A uniformly random set bit of `bits` (non-zero), by bisection on bit counts."""
    n = rng.randrange(bits.bit_count())
    low, width = 0, bits.bit_length()
    while width > 1:
        half = width // 2
        below = (bits >> low & ((1 << half) - 1)).bit_count()
        if n < below:
            width = half
        else:
            n, low, width = n - below, low + half, width - half
    return low


def descending(bits: int) -> Iterator[int]:
    """The indices of the set bits of `bits`, highest first."""
    while bits:
        top = bits.bit_length() - 1
        yield top
        bits ^= 1 << top


def ring(bits: int, start_mask: int) -> Iterator[int]:
    """Set bits from the first bit of `start_mask` upward, then the lower ones (a ring)."""
    start = (start_mask & -start_mask).bit_length() - 1 if start_mask else 0
    yield from iter_bits(bits >> start << start)
    yield from iter_bits(bits & ((1 << start) - 1))
