"""When a peer's piece is too slow (weightcache/swarm/pace.py), and the rates behind it."""

from __future__ import annotations

import pytest

from weightcache.swarm import pace
from weightcache.swarm.pace import (
    CLAIM_FACTOR,
    CLAIM_GRACE,
    PEER_MIN_RATE,
    PEER_TIMEOUT,
    TRICKLE_RATE,
    Rates,
    claim_wait,
)


def test_rates_count_the_last_window_only(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(pace.time, "monotonic", lambda: now[0])
    rates = Rates()
    now[0] += 2 * pace.RATE_WINDOW
    rates.note(1000)
    now[0] += pace.RATE_WINDOW / 2
    rates.note(3000)
    assert rates.rate() == 4000 / pace.RATE_WINDOW
    now[0] += pace.RATE_WINDOW * 0.75  # the first note is now out of the window
    assert rates.rate() == 3000 / pace.RATE_WINDOW
    assert rates.best == 4000 / pace.RATE_WINDOW


def test_the_floor_is_a_quarter_of_the_link_s_share_between_a_trickle_and_the_fixed_rate() -> None:
    floor = pace.slow_floor
    assert floor(8 << 20, 4, None, streamed=False) == PEER_MIN_RATE  # a fast link
    assert floor(1_600_000, 16, None, streamed=False) == pytest.approx(25_000)
    assert floor(100_000, 0, None, streamed=False) == pytest.approx(25_000)  # none in flight: 1
    assert floor(0, 4, None, streamed=False) == TRICKLE_RATE  # nothing arrives from anyone
    # a streamed piece comes at the store's pace per request, once that is measured
    assert floor(1_600_000, 16, None, streamed=True) == pytest.approx(25_000)
    assert floor(1_600_000, 16, 40_000, streamed=True) == pytest.approx(10_000)
    assert floor(1_600_000, 16, 400_000, streamed=True) == pytest.approx(25_000)
    assert floor(1_600_000, 16, 40_000, streamed=False) == pytest.approx(25_000)


def test_a_piece_is_too_slow_after_the_timeout_and_past_its_size_at_the_floor() -> None:
    size = 2 << 20
    assert not pace.too_slow(PEER_TIMEOUT, 1, 1e9)  # the timeout, at least
    assert pace.too_slow(PEER_TIMEOUT + 0.1, 1, 1e9)
    at_floor = size / 25_000  # 84 s for 2 MiB at 25 kB/s
    assert not pace.too_slow(at_floor, size, 25_000)
    assert pace.too_slow(at_floor + 0.1, size, 25_000)


def test_a_claim_lasts_a_few_store_pieces_times_and_a_grace_at_least() -> None:
    mib = 1 << 20
    assert claim_wait(mib, None, 0.0) == CLAIM_GRACE  # nothing asked of the store yet
    assert claim_wait(mib, 100 * mib, 0.0) == CLAIM_GRACE  # a fast store: 10 ms a piece
    assert claim_wait(mib, mib / 10, 0.0) == CLAIM_FACTOR * 10  # a crowded store: 10 s
    # a request to the store in flight for 20 s: its pieces take that long at least
    assert claim_wait(mib, None, 20.0) == CLAIM_FACTOR * 20
    assert claim_wait(mib, mib / 10, 20.0) == CLAIM_FACTOR * 20
