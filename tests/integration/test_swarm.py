"""The swarm's data plane (design §8, Swarm) with real daemons on loopback: one blob from
several peers and the store at once, a peer dying mid-piece, a lying peer, a node joining
mid-swarm, kill -9 resume, and a model's blobs two at once. Each node logs one summary
line per blob it swarmed:
`swarm: <file> in N pieces: S from the store, P from K peers (C streamed), R resumed; ...`.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    wait_for,
)
from tests.integration.test_peers import (
    ORIGIN_BYTES,
    PEER_BYTES,
    PIECES,
    UPLOADED,
    VERIFY_FAILURES,
    Node,
    assert_node_ok,
    fetch_all,
    make_nodes,
    peer_get,
    prewarm,
    start,
)
from tests.support.faultproxy import FaultProxy
from tests.support.hostilepeer import HostilePeer
from weightcache.cache.layout import Layout
from weightcache.swarm.choice import RequestLimits
from weightcache.swarm.pieces import Bitmap, piece_size_for
from weightcache.swarm.wire import STREAMING

STREAMED = "weightcache_peer_streamed_bytes_total"
SUMMARY = re.compile(
    r"swarm: (\S+) in (\d+) pieces: (\d+) from the store, (\d+) from (\d+) peers "
    r"\((\d+) streamed\), (\d+) resumed"
)


def summary(node: Node, label: str) -> dict[str, int]:
    """The node's last swarm summary for the file `label`."""
    found = [m for m in SUMMARY.finditer(node.d.log()) if m.group(1) == label]
    assert found, f"{node.name} logged no swarm summary for {label}:\n{node.d.log()}"
    _, pieces, store, peer_pieces, peers, streamed, resumed = found[-1].groups()
    return {"pieces": int(pieces), "store": int(store), "peer_pieces": int(peer_pieces),
            "peers": int(peers), "streamed": int(streamed), "resumed": int(resumed)}  # fmt: skip


def one_blob(publish: Callable[..., Published], size: int, name: str) -> Published:
    return publish([size], name=name, rev="r1", seed=name, small_files=False)


@pytest.mark.timeout(150)
def test_one_blob_comes_from_several_peers_and_the_store_at_once(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Three cold nodes, one blob, a slow store: each node takes a share from the store
    and the rest from both other nodes, piece by piece, while they are still downloading,
    some of them passed on while they arrive from the store (cut-through)."""
    pub = one_blob(publish, 12 * MiB, "several")
    (label,) = [f.relpath for f in pub.model.files]
    nodes = make_nodes(tmp_path, 3)
    for n in nodes:
        start(daemons, n, tmp_path, proxy.url, [m.peer_addr for m in nodes])
    proxy.reset_stats()
    proxy.configure(rate_limit=6 * MiB)  # 2 s for the blob: the nodes overlap

    fetch_all(wc, pub, nodes, proxy.url)

    origin = proxy.stats().body_bytes
    print(f"several: origin {origin} bytes for a {pub.model.total_size}-byte blob")
    assert origin <= 1.1 * pub.model.total_size
    streamed = passed_on = 0
    for n in nodes:
        assert_node_ok(n, pub)
        s = summary(n, label)
        print(n.name, s)
        assert s["store"] >= 1 and s["peers"] == 2, (n.name, s)
        streamed += s["streamed"]
        m = n.d.metrics()
        assert m[ORIGIN_BYTES] > 0 and m[PEER_BYTES] > 0 and m[UPLOADED] > 0, (n.name, m)
        passed_on += m[STREAMED]
    assert streamed > 0, "no piece was passed on while it came from the store"
    assert passed_on > 0, "the peer servers counted no bytes passed on from the store"


@pytest.mark.timeout(150)
def test_a_node_killed_while_it_streams_a_piece_to_the_others_costs_them_that_piece_only(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Three cold nodes, a slow store: node0 is killed (-9) while it passes a piece from
    the store on to the others (cut-through). Their streams are cut; they take what node0
    would have sent from the store or each other and publish verified blobs."""
    pub = one_blob(publish, 12 * MiB, "streamer")
    nodes = make_nodes(tmp_path, 3)
    for n in nodes:
        start(daemons, n, tmp_path, proxy.url, [m.peer_addr for m in nodes])
    proxy.configure(rate_limit=MiB + MiB // 2)  # a 384 KiB piece in 0.75 s, 3 at once
    running = [wc.fetch_popen(pub.source, n.cache_dir, "--json", endpoint=proxy.url)
               for n in nodes]  # fmt: skip
    blob = f"/blobs/sha256/{pub.model.files[0].sha256}"

    passed_on = [0.0]

    def streaming_to_peers() -> bool:
        """node0 is passing bytes on from the store right now: its count of them grew
        since the last look (50 ms), and it still advertises pieces streamed."""
        before, passed_on[0] = passed_on[0], nodes[0].d.metrics()[STREAMED]
        _, _, headers = peer_get(nodes[0].peer_port, blob, method="HEAD")
        return passed_on[0] > before > 0 and bool(headers.get(STREAMING, "").strip("A="))

    wait_for("node0 streaming to its peers", streaming_to_peers, timeout=30, every=0.05)
    nodes[0].d.kill9()
    (label,) = [f.relpath for f in pub.model.files]
    cut = f"peer http://{nodes[0].peer_addr} failed a piece of {label} it streams from the store"
    cuts = 0
    for n, r in zip(nodes[1:], running[1:], strict=True):
        result = r.finish(timeout=90)
        assert result.returncode == 0, f"{n.name}: {result.stderr}\n{n.d.log()}"
        assert_node_ok(n, pub)
        assert n.d.metrics()[VERIFY_FAILURES] == 0
        cuts += n.d.log().count(cut)
    assert cuts, "no stream from node0 was cut: the kill came between its pieces"
    running[0].finish(timeout=90)  # its daemon gone: whatever it did, nothing to check


@pytest.mark.timeout(150)
def test_a_peer_dying_mid_piece_leaves_its_pieces_to_the_others(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Two seeds serve one cold node at once; one is killed with pieces in flight. The
    cold node re-chooses those pieces from the other seed: nothing from the store."""
    pub = one_blob(publish, 16 * MiB, "dying")
    w1, w2, cold = make_nodes(tmp_path, 3)
    for seed in (w1, w2):
        prewarm(wc, pub, seed, store)
        start(daemons, seed, tmp_path, store.endpoint_url, [], "--peer-upload-limit", "3M")
    start(daemons, cold, tmp_path, proxy.url, [w1.peer_addr, w2.peer_addr])
    proxy.reset_stats()

    running = wc.fetch_popen(pub.source, cold.cache_dir, "--json", endpoint=proxy.url)
    wait_for("4 MiB from the seeds", lambda: cold.d.metrics()[PEER_BYTES] >= 4 * MiB,
             timeout=30, every=0.05)  # fmt: skip
    both = [seed.d.metrics()[UPLOADED] for seed in (w1, w2)]
    w1.d.kill9()  # mid-piece: 3 MiB/s over 256 KiB pieces, several in flight
    result = running.finish(timeout=90)

    assert result.returncode == 0, f"{result.stderr}\n{cold.d.log()}"
    print("uploaded before the kill:", both)
    assert all(b > 0 for b in both), f"the seeds did not both serve: {both}"
    assert_node_ok(cold, pub)
    (label,) = [f.relpath for f in pub.model.files]
    assert proxy.stats().bytes_for(label) == 0, "the dead seed's pieces came from the store"
    assert cold.d.metrics()[VERIFY_FAILURES] == 0


@pytest.mark.timeout(150)
def test_a_lying_peer_is_found_by_its_pieces_avoided_and_nothing_bad_is_published(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """An honest seed and a lying one (every body it sends has a flipped byte) serve a cold
    node together. The assembled blob does not verify; the pieces peers sent are fetched
    once more from the store and compared: the liar is marked bad, the honest seed is not,
    and the store sends at most one copy."""
    pub = one_blob(publish, 8 * MiB, "liar")
    size = pub.model.total_size
    honest, lying, cold = make_nodes(tmp_path, 3)
    for seed in (honest, lying):
        prewarm(wc, pub, seed, store)
        start(daemons, seed, tmp_path, store.endpoint_url, [], "--peer-upload-limit", "4M")
    with FaultProxy(f"http://{lying.peer_addr}", seed="swarm-liar") as liar:
        liar.configure(scope="all", corrupt_rate=1.0)
        liar_url = liar.url.removeprefix("http://")
        start(daemons, cold, tmp_path, proxy.url, [honest.peer_addr, liar_url])
        proxy.reset_stats()

        result = fetch_all(wc, pub, [cold], proxy.url)[0]

        assert liar.stats().faults.get("corrupt", 0) >= 1, "the liar was never asked"
        assert honest.d.metrics()[UPLOADED] > 0, "the honest seed was never asked"
        assert_node_ok(cold, pub)
        log = cold.d.log()
        assert f"avoiding peer {liar.url}" in log, log
        assert f"avoiding peer http://{honest.peer_addr}" not in log, log
        m = cold.d.metrics()
        assert m[VERIFY_FAILURES] == 1, m  # the assembled copy, once
        origin = proxy.stats().body_bytes
        print(f"liar: origin {origin} bytes for a {size}-byte blob", result)
        assert 0 < origin <= size * 1.01, "the re-check is bounded by one copy"

        # The liar is not asked again, although it holds the next revision too.
        pub2 = publish([2 * MiB], name="liar", rev="r2", seed="liar2", small_files=False)
        prewarm(wc, pub2, lying, store)
        asked = liar.stats().requests
        fetch_all(wc, pub2, [cold], proxy.url)
        assert liar.stats().requests == asked, "the lying peer was asked again"
        assert_node_ok(cold, pub2)


@pytest.mark.timeout(150)
def test_a_node_joining_mid_swarm_is_found_and_both_serves_and_fetches(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = one_blob(publish, 12 * MiB, "joining")
    (label,) = [f.relpath for f in pub.model.files]
    seed, early, late = nodes = make_nodes(tmp_path, 3)
    everyone = [n.peer_addr for n in nodes]
    prewarm(wc, pub, seed, store)
    start(daemons, seed, tmp_path, store.endpoint_url, [], "--peer-upload-limit", "2M")
    start(daemons, early, tmp_path, proxy.url, everyone)  # `late` is not up yet
    running = wc.fetch_popen(pub.source, early.cache_dir, "--json", endpoint=proxy.url)
    wait_for("3 MiB at the early node", lambda: early.d.metrics()[PEER_BYTES] >= 3 * MiB,
             timeout=30, every=0.05)  # fmt: skip

    start(daemons, late, tmp_path, proxy.url, everyone)
    fetch_all(wc, pub, [late], proxy.url)
    result = running.finish(timeout=90)

    assert result.returncode == 0, f"{result.stderr}\n{early.d.log()}"
    for n in (early, late):
        assert_node_ok(n, pub)
    assert late.d.metrics()[UPLOADED] > 0, "the node that joined served nothing"
    assert late.d.metrics()[PEER_BYTES] > 0
    assert summary(early, label)["peers"] == 2, "the early node did not fetch from the late one"


@pytest.mark.timeout(150)
def test_kill_9_mid_swarm_loses_only_the_pieces_in_flight(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Every piece is recorded as it lands: with the store hung (requests in flight cut),
    the partial's state on disk lists exactly the pieces the node advertises as held, and
    after kill -9 and a restart the store sends only the pieces not recorded."""
    pub = one_blob(publish, 24 * MiB, "resume")
    (entry,) = pub.model.files
    size, piece = entry.size, piece_size_for(entry.size)
    (node,) = make_nodes(tmp_path, 1)
    nowhere = make_nodes(tmp_path, 1)[0].peer_addr  # a peer that never answers
    start(daemons, node, tmp_path, proxy.url, [nowhere])
    proxy.reset_stats()
    proxy.configure(rate_limit=8 * MiB)

    running = wc.fetch_popen(pub.source, node.cache_dir, "--json", endpoint=proxy.url)
    wait_for("8 MiB from the store", lambda: node.d.metrics()[ORIGIN_BYTES] >= 8 * MiB,
             timeout=30, every=0.05)  # fmt: skip
    proxy.set_down("hang")  # requests in flight are cut, new ones hang
    time.sleep(1.0)
    blob = f"/blobs/sha256/{entry.sha256}"
    status, _, headers = peer_get(node.peer_port, blob, method="HEAD")
    assert status == 200, headers
    count = -(-size // piece)
    held = Bitmap.decode(count, headers[PIECES])
    layout = Layout.open(node.cache_dir)
    written = json.loads(layout.part_state(layout.partial(entry.sha256)).read_text())["written"]
    recorded = Bitmap.of(count, (i for i, n in enumerate(written) if n == piece))
    node.d.kill9()
    running.kill9()

    assert len(held) >= 8 * MiB // piece - 8, (len(held), count)
    assert recorded == held, f"on disk {len(recorded)} pieces, held {len(held)}"

    proxy.set_down(None)
    proxy.reset_stats()
    start(daemons, node, tmp_path, proxy.url, [nowhere])
    fetch_all(wc, pub, [node], proxy.url)
    assert_node_ok(node, pub)
    again = proxy.stats().bytes_for(entry.relpath)
    print(f"resume: {len(held)} of {count} pieces kept, the store sent {again} bytes again")
    assert again == size - len(held) * piece, (again, size, len(held))
    assert summary(node, entry.relpath)["resumed"] == len(held)


def first_seen(paths: dict[str, Path], stop: threading.Event) -> dict[str, int]:
    """Poll `paths` (by name) every 5 ms in a thread until `stop`: the round in which
    each first existed (a stalled poller sees two in one round, never in the wrong order)."""
    seen: dict[str, int] = {}

    def poll() -> None:
        for round_ in itertools.count():
            if stop.is_set():
                return
            for name, path in paths.items():
                if name not in seen and path.exists():
                    seen[name] = round_
            time.sleep(0.005)

    threading.Thread(target=poll, daemon=True).start()
    return seen


@pytest.mark.timeout(150)
def test_the_next_blob_starts_before_the_one_before_is_published(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Two blobs, a slow store: the second blob's swarm download (its partial) starts
    while the first's last pieces are in flight, before the first is published; both
    verify, and the store sends each once."""
    pub = publish([8 * MiB, 8 * MiB], name="pipelined", rev="r1", seed="pipelined",
                  small_files=False)  # fmt: skip
    (node,) = make_nodes(tmp_path, 1)
    nowhere = make_nodes(tmp_path, 1)[0].peer_addr  # peers on, but none answers
    start(daemons, node, tmp_path, proxy.url, [nowhere])
    proxy.reset_stats()
    proxy.configure(rate_limit=4 * MiB)  # 2 s a blob, the last pieces' for a few tenths
    layout = Layout.open(node.cache_dir)
    paths = {f"{kind} {f.relpath}": getattr(layout, kind)(f.sha256)
             for f in pub.model.files for kind in ("partial", "blob")}  # fmt: skip
    stop = threading.Event()
    seen = first_seen(paths, stop)
    try:
        fetch_all(wc, pub, [node], proxy.url)
    finally:
        stop.set()

    assert_node_ok(node, pub)
    first, second = sorted(pub.model.files, key=lambda f: seen[f"blob {f.relpath}"])
    assert seen[f"partial {second.relpath}"] < seen[f"blob {first.relpath}"], seen
    stats = proxy.stats()
    assert all(stats.bytes_for(f.relpath) == f.size for f in pub.model.files), stats


@pytest.mark.timeout(150)
def test_nodes_watching_one_peer_each_all_get_the_blob_despite_dead_members(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """Four cold nodes whose static list also names two addresses nobody answers (members
    that never came up), each watching one peer (--peer-view 1): the stripes are cut over
    all six, the dead members' stripes are found orphaned (or late) and fetched from the
    store, and every node is ready with the right bytes."""
    pub = one_blob(publish, 12 * MiB, "narrow")
    (label,) = [f.relpath for f in pub.model.files]
    nodes = make_nodes(tmp_path, 4)
    dead = [n.peer_addr for n in make_nodes(tmp_path, 2)]
    everyone = [n.peer_addr for n in nodes] + dead
    for n in nodes:
        start(daemons, n, tmp_path, proxy.url, everyone, "--peer-view", "1")
    proxy.reset_stats()
    proxy.configure(rate_limit=6 * MiB)  # 2 s for the blob: the nodes overlap

    fetch_all(wc, pub, nodes, proxy.url)

    origin = proxy.stats().body_bytes
    print(f"narrow: origin {origin} bytes for a {pub.model.total_size}-byte blob")
    for n in nodes:
        assert_node_ok(n, pub)
        watching = re.findall(r"watching (\d+) of (\d+) peers", n.d.log())
        assert watching and watching[-1] == ("1", "5"), (n.name, watching)
        print(n.name, summary(n, label))
    # a node whose one watched peer is dead sees nobody until it is replaced (MEMBER_TTL)
    # and takes what it can from the store: never more than each node alone would
    assert origin <= len(nodes) * pub.model.total_size


@pytest.mark.timeout(150)
def test_peers_cutting_or_trickling_every_piece_are_left_for_the_store(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """The only peers holding the blob answer HEADs but fail every piece: one cuts each
    short (a bad disk, a broken link), one trickles it (2 kB/s). Their bytes keep
    arriving, so the download never stalls, but no piece lands from them; the node must
    still finish, from the store, rather than ask them for ever."""
    pub = one_blob(publish, 2 * MiB, "failing")
    (label,) = [f.relpath for f in pub.model.files]
    cutting, trickling, cold = make_nodes(tmp_path, 3)
    for seed in (cutting, trickling):
        prewarm(wc, pub, seed, store)
        start(daemons, seed, tmp_path, store.endpoint_url, [])
    with (
        FaultProxy(f"http://{cutting.peer_addr}", seed="swarm-cut") as cuts,
        FaultProxy(f"http://{trickling.peer_addr}", seed="swarm-trickle") as trickles,
    ):
        cuts.configure(scope="ranged", truncate_rate=1.0)
        trickles.configure(scope="ranged", trickle_rate=2000)
        bad = [p.url.removeprefix("http://") for p in (cuts, trickles)]
        start(daemons, cold, tmp_path, proxy.url, bad)
        proxy.reset_stats()

        started = time.monotonic()
        fetch_all(wc, pub, [cold], proxy.url)

        took = time.monotonic() - started
        assert cuts.stats().faults.get("truncate", 0) >= 1, "the cutting peer was never asked"
        assert trickles.stats().requests >= 2, "the trickling peer was never asked"
        # Once its pieces are given up, their pace shows that the store (fast here) has room,
        # and the store takes what is left. On a loaded host the store may have no piece
        # measured by then, and a first failure's leave ends at the peer's next answer (a
        # busy host's timeout, views.py): one more round. A second failure's leave
        # is not ended by answers and doubles; asked for ever, the trickler would get a
        # round every PEER_TIMEOUT.
        trickled = trickles.stats().ranged_gets
        assert trickled <= 2 * RequestLimits().per_peer, f"{trickled} pieces asked of the trickler"
    assert_node_ok(cold, pub)
    print(f"failing peers: {took:.1f}s, store {proxy.stats().bytes_for(label)} bytes, "
          f"{trickled} pieces asked of the trickler")  # fmt: skip
    assert proxy.stats().bytes_for(label) >= pub.model.total_size


@pytest.mark.timeout(150)
def test_a_peer_refusing_the_pieces_it_advertises_is_left_for_the_store(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """The one peer advertises every piece, and still does in the 416 it answers each piece
    request with: it is left out as for a failure (not asked again at once, for ever, with
    the store never asked), and the node finishes from the store."""
    pub = one_blob(publish, 2 * MiB, "refused")
    (cold,) = make_nodes(tmp_path, 1)
    with HostilePeer(pub.model.total_size, "fails", failures=("416",)) as refuser:
        start(daemons, cold, tmp_path, proxy.url, [refuser.addr])

        fetch_all(wc, pub, [cold], proxy.url)

        gets = refuser.gets
    assert_node_ok(cold, pub)
    print(f"refused: {gets} piece requests to the refusing peer")
    assert 1 <= gets <= 100, gets
