"""N concurrent fetches of one revision on one node make one origin download (SPEC §3 inv. 4)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.support.checks import (
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024
SLACK = 64 * 1024


@pytest.mark.timeout(180)
def test_eight_concurrent_fetches_download_once(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([4 * MiB] * 4, name="herd", rev="r1")
    size = pub.model.total_size
    # Slow the store down (not the client) so the download outlasts eight Python starts
    # on two cores: ~16 MiB at 6 MiB/s is ~2.7 s.
    proxy.configure(rate_limit=6 * MiB)

    # Half print the path, half print JSON (which also reports bytes from the origin).
    procs = [
        wc.fetch_popen(pub.source, cache_dir, *(["--json"] if i % 2 else []),
                       "--part-size", "1M", endpoint=proxy.url)
        for i in range(8)
    ]  # fmt: skip
    # The test means something only if all eight started before the revision was ready.
    assert markers(cache_dir) == [], "the first fetch finished before the last one started"
    results = [p.finish(timeout=150) for p in procs]

    expected = pub.local_path(cache_dir)
    docs = []
    for i, r in enumerate(results):
        if i % 2:
            assert r.returncode == 0 and r.stdout.count("\n") == 1, describe(r)
            docs.append(json.loads(r.stdout))
            assert Path(docs[-1]["path"]).resolve() == expected.resolve(), describe(r)
        else:
            assert_ok_path(r, expected)

    s = proxy.stats()
    assert size <= s.body_bytes <= size + SLACK, (
        f"{s.body_bytes} bytes from the store for a {size}-byte model fetched by 8 processes"
    )
    # Each process reports what it took from the origin; together that is one model.
    assert sum(d["bytes_from_origin"] for d in docs) <= size + SLACK, docs
    assert markers(cache_dir) == [pub.local_path(cache_dir) / ".weightcache"]
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
    assert_linked_to_blobs(cache_dir, pub.name, pub.rev, pub.model)
