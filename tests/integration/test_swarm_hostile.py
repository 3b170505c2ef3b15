"""The swarm (design §8, Swarm) with peers that do not keep their word
(tests/support/hostilepeer.py): one advertising every piece and failing every request. A
node never waits on it while the store could serve it: it finishes from the store, asks
the bad peer a bounded number of times, and keeps its store window open.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
)
from tests.integration.test_peers import assert_node_ok, fetch_all, make_nodes, start
from tests.integration.test_swarm import one_blob, summary
from tests.support.faultproxy import FaultProxy
from tests.support.hostilepeer import HostilePeer
from weightcache.node.swarm import Limits

#: GETs a bad peer may get: a round of requests before each leave (SHUN_SECONDS, doubling)
#: over a download that, from the store alone, takes a few of them.
BAD_PEER_GETS = 5 * Limits().fill


@pytest.mark.timeout(150)
def test_a_peer_failing_every_piece_it_advertises_does_not_close_the_store_window(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """The one peer advertises every piece and fails each request in turn: 416, 503, a
    reset mid-body, a wrong Content-Range (a failing disk). It is left out as a dead peer
    is, a bounded number of requests; the store serves the blob with its window open, not
    one piece at a time."""
    pub = one_blob(publish, 16 * MiB, "failing-disk")
    (label,) = [f.relpath for f in pub.model.files]
    (cold,) = make_nodes(tmp_path, 1)
    with HostilePeer(pub.model.total_size, "fails") as failing:
        start(daemons, cold, tmp_path, proxy.url, [failing.addr])

        fetch_all(wc, pub, [cold], proxy.url)

        gets = failing.gets
    assert_node_ok(cold, pub)
    s = summary(cold, label)
    window = int(re.findall(r"store window (\d+)", cold.d.log())[-1])
    print(f"failing disk: {gets} piece requests to the peer, store window {window}, {s}")
    assert 1 <= gets <= BAD_PEER_GETS, gets
    assert s["store"] == s["pieces"], s
    assert window > Limits().per_origin // 2, f"the store window closed to {window}"
