"""StoreGate: the store's window, room, pause and give-up as a swarm download sees them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from weightcache.errors import SourceError, TransientError
from weightcache.swarm import storegate
from weightcache.swarm.choice import RequestLimits
from weightcache.swarm.storegate import StoreGate
from weightcache.transfer.sources import RetryRange

MiB = 1 << 20
LIMITS = RequestLimits(per_origin=8, claims=1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(storegate.time, "monotonic", c)
    return c


def gate(attempts: int = 3, delay: float = 2.0) -> tuple[StoreGate, list[str]]:
    seen: list[str] = []
    downloader: Any = SimpleNamespace(
        backoff=SimpleNamespace(delay=lambda attempt: delay * attempt),
        settings=SimpleNamespace(max_attempts=attempts),
        observer=SimpleNamespace(throttled=lambda: seen.append("throttled")),
    )
    return StoreGate(LIMITS, downloader, "s3://b/m", "model.bin", 2 * MiB, 1.0), seen


def room_window(g: StoreGate) -> tuple[bool, int]:
    view = g.view()
    return view.room, view.window


def test_the_window_grows_only_while_the_store_outpaces_a_peer(clock: Clock) -> None:
    g, _ = gate()
    assert room_window(g) == (False, 1)
    g.measured("origin", 50e6, alone=False)  # no peer measured yet, not alone: no room
    assert room_window(g) == (False, 1)
    g.measured("peer", 10e6, alone=False)
    g.measured("origin", 50e6, alone=False)  # ROOM_FACTOR x a peer's: room
    assert room_window(g) == (True, 2)
    g.measured("origin", 50e6, alone=False)
    assert room_window(g) == (True, 3)
    g.measured("origin", 20e6, alone=False)  # only 2x a peer's: the peers are not the limit
    assert room_window(g) == (False, 1)


def test_alone_grows_the_window_only_after_the_grace(clock: Clock) -> None:
    g, _ = gate()
    g.measured("origin", 1e6, alone=True)
    assert room_window(g) == (False, 1)
    clock.now += storegate.ALONE_GRACE
    g.measured("origin", 1e6, alone=True)
    assert room_window(g) == (True, 2)


def test_a_throttle_halves_the_window_and_denies_room_for_a_while(clock: Clock) -> None:
    g, seen = gate()
    g.measured("peer", 1e6, alone=False)
    for _ in range(5):
        g.measured("origin", 50e6, alone=False)
    assert room_window(g) == (True, 6)
    assert g.failed(RetryRange("503 SlowDown", throttle=True)) is None
    assert room_window(g) == (False, 3) and seen == ["throttled"]
    assert g.paused()
    clock.now += storegate.THROTTLE_MEMORY - 0.1
    g.measured("origin", 50e6, alone=False)  # fast, but too soon after the throttle
    assert room_window(g) == (False, 1)
    clock.now += 0.1
    g.measured("origin", 50e6, alone=False)
    assert room_window(g) == (True, 2)


def test_a_peer_piece_given_up_as_too_slow_gives_a_fast_store_room_at_once(
    clock: Clock,
) -> None:
    """A node whose pieces are all with a trickling peer has no request to the store in
    flight to show its room: the give-up itself must, or the peer is asked again."""
    g, _ = gate()
    g.measured("peer", 20e6, alone=False)
    g.peer_failed(2e3)  # the peers' pace 14.0e6; the store unmeasured: nothing known of its room
    assert room_window(g) == (False, 1)
    g.measured("origin", 40e6, alone=False)  # under ROOM_FACTOR x 14.0e6: no room
    assert room_window(g) == (False, 1)
    g.peer_failed(2e3)  # 9.8e6: still no room
    assert room_window(g) == (False, 1)
    g.peer_failed(2e3)  # 6.9e6: room, at once (the window moves only as store pieces land)
    assert room_window(g) == (True, 1)
    g.failed(RetryRange("503 SlowDown", throttle=True))
    g.measured("origin", 40e6, alone=False)
    g.peer_failed(2e3)  # right after a throttle: no room
    assert room_window(g)[0] is False


def test_a_peer_failing_every_piece_leaves_the_store_its_room_and_window(clock: Clock) -> None:
    """A peer that advertises every piece and fails each (416, 503, a cut body): no piece
    from any peer is ever measured, the node is not alone; its failures count as pieces
    that delivered nothing, so the store has room and its window grows."""
    g, _ = gate()
    g.peer_failed(0.0)  # before any piece from the store: nothing known of its room
    assert room_window(g) == (False, 1)
    for window in range(2, 6):
        g.measured("origin", 5e6, alone=False)
        assert room_window(g) == (True, window)
    g.measured("peer", 10e6, alone=False)  # a peer delivering again: the store at 1/2 of it
    g.measured("origin", 5e6, alone=False)
    assert room_window(g)[0] is False


def test_failures_pause_then_give_up_unless_bytes_arrive_between(clock: Clock) -> None:
    g, seen = gate(attempts=3, delay=2.0)
    assert g.failed(OSError("reset")) is None
    assert g.paused() and seen == []
    clock.now += 2.0
    assert not g.paused()
    assert g.failed(RetryRange("timeout")) is None
    g.received(4 << 20)  # a piece landed: the failures in a row start again
    assert g.bytes == 4 << 20
    assert g.failed(RetryRange("timeout")) is None
    assert g.failed(RetryRange("timeout")) is None
    fatal = g.failed(RetryRange("timeout"))
    assert isinstance(fatal, TransientError)
    assert "after 3 failed requests" in str(fatal) and "s3://b/m" in str(fatal)


def test_a_refusal_ends_the_download_at_once(clock: Clock) -> None:
    g, _ = gate()
    refusal = SourceError("403 Forbidden")
    assert g.failed(refusal) is refusal
    assert not g.paused()


def test_ahead_is_the_pieces_a_node_takes_from_the_store_while_a_view_of_it_lags(
    clock: Clock,
) -> None:
    g, _ = gate()
    assert g.view().ahead is None  # unmeasured: no laggard's piece is taken
    g.measured("peer", 1.0 * MiB, alone=False)
    g.measured("origin", 0.75 * MiB, alone=False)  # no room: a window of one
    assert (g.view().window, g.view().ahead) == (1, 1)  # 0.75 MiB in the lag's 1 s: one piece
    for _ in range(3):
        g.measured("origin", 6 * MiB, alone=False)  # room: the window grows to 4
    assert g.view().window == 4
    # the rate's EWMA: 0.75 + 0.3 x 5.25 = 2.325, then 3.43, then 4.20 MiB/s x 4 x 1 s / 2 MiB
    assert g.view().ahead == 9
