"""Fixtures for the unit tier: a fake clock, and a cache directory under tmp_path."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache


class FakeClock:
    """A monotonic clock that only moves when told to; `sleep` advances it and is recorded."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, f"negative sleep {seconds}"
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout.open(tmp_path / "cache")


@pytest.fixture
def store(layout: Layout) -> Cache:
    return Cache(layout)


@pytest.fixture
def put_blob(layout: Layout) -> Callable[[bytes], str]:
    """Write bytes into the blob store under their real sha256; return the hex digest."""

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        layout.blob(digest).write_bytes(data)
        return digest

    return put
