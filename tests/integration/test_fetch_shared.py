"""One Fetcher shared by concurrent fetches, as in the daemon: each
FetchResult counts its own bytes from the origin, not what other fetches downloaded
meanwhile on the same downloader."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Published
from tests.support.faultproxy import FaultProxy
from weightcache.cache.layout import Layout
from weightcache.config import OriginSettings
from weightcache.fetch import Fetcher, FetchResult
from weightcache.sourceurl import Source

MiB = 1 << 20


@pytest.mark.timeout(120)
def test_concurrent_fetches_on_one_fetcher_each_count_their_own_bytes(
    store: Any,
    publish: Callable[..., Published],
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    big = publish([3 * MiB], name="big", rev="r1", seed="big")
    small = publish([1 * MiB], name="small", rev="r1", seed="small")
    # 2 MiB/s for both together: the two downloads overlap for a second or more.
    proxy.configure(scope="data", rate_limit=2 * MiB)
    fetcher = Fetcher(
        Layout.open(tmp_path / "cache"),
        OriginSettings(endpoint_url=proxy.url, part_size=1 * MiB, max_concurrency=4, timeout=60),
    )
    results: dict[str, FetchResult] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def fetch(pub: Published) -> None:
        try:
            start.wait()
            results[pub.name] = fetcher.fetch(Source.parse(pub.source))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=fetch, args=(p,)) for p in (big, small)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert not results["big"].hit and not results["small"].hit, results
    assert results["big"].bytes_from_origin == big.model.total_size, results
    assert results["small"].bytes_from_origin == small.model.total_size, results
    assert proxy.stats().body_bytes >= big.model.total_size + small.model.total_size
