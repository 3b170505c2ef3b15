"""The swarm (design §8, Swarm) with peers that do not keep their word: a hostile peer
(tests/support/hostilepeer.py) claiming every piece and sending none, one advertising every
piece and failing every request, and an honest node whose own link to the store trickles.
A node never waits on them while the store could serve it: it finishes from the store,
asks the bad peer a bounded number of times, and keeps its store window open.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from weightcache.swarm.choice import RequestLimits

#: GETs a bad peer may get: a round of requests before each leave (SHUN_SECONDS, doubling)
#: over a download that, from the store alone, takes a few of them.
BAD_PEER_GETS = 5 * RequestLimits().fill


@pytest.mark.timeout(150)
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "fetching"])
def test_a_peer_claiming_every_piece_and_sending_none_is_left_for_the_store(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, streaming: bool,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """The one peer advertises that it holds nothing but fetches every piece (and, with
    `streaming`, passes each on as the store sends it), and refuses every piece asked of
    it. Its claims expire, the store is asked, and the peer is not asked again at once
    after each refusal: the fetch ends well within --timeout with the right bytes."""
    pub = one_blob(publish, 8 * MiB, f"claimed-{streaming}")
    (cold,) = make_nodes(tmp_path, 1)
    with HostilePeer(pub.model.total_size, "claims", streaming=streaming) as claimer:
        start(daemons, cold, tmp_path, proxy.url, [claimer.addr], "--timeout", "30s")

        fetch_all(wc, pub, [cold], proxy.url)

        gets = claimer.gets
    assert_node_ok(cold, pub)
    print(f"claimed ({streaming=}): {gets} piece requests to the claimer")
    assert gets <= BAD_PEER_GETS, f"{gets} piece requests to a peer refusing every one"
    if not streaming:
        assert gets == 0, "a peer offering nothing was asked for pieces"


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
    assert window > RequestLimits().per_origin // 2, f"the store window closed to {window}"


@pytest.mark.timeout(200)
def test_a_node_whose_store_link_trickles_does_not_hold_back_its_peer(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Two nodes swarm a blob of 1 MiB pieces; node A's own link to the store trickles
    (2 kB/s a request), node B's is healthy. A claims the first pieces of its stripe and
    passes them on as they come: B takes the piece A has in flight from its own store
    once A's claim expires, instead of waiting for it (at 2 kB/s, until a piece's floor
    gives it up: 128 s); then A gets it from B."""
    pub = one_blob(publish, 32 * MiB, "trickle-link")
    (label,) = [f.relpath for f in pub.model.files]
    a, b = make_nodes(tmp_path, 2)
    with FaultProxy(store.endpoint_url, seed="trickle-link") as slow:
        slow.configure(scope="ranged", trickle_rate=2000)
        start(daemons, a, tmp_path, slow.url, [a.peer_addr, b.peer_addr])
        start(daemons, b, tmp_path, proxy.url, [a.peer_addr, b.peer_addr])
        running = wc.fetch_popen(pub.source, a.cache_dir, "--json", endpoint=slow.url)

        fetch_all(wc, pub, [b], proxy.url)

        result = running.finish(timeout=90)
    assert result.returncode == 0, f"{result.stderr}\n{a.d.log()}"
    for n in (a, b):
        assert_node_ok(n, pub)
        print(n.name, summary(n, label))
    assert summary(b, label)["store"] >= summary(b, label)["pieces"] // 2
