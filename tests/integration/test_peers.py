"""Peer-to-peer between node daemons (design §8): several real `weightcache daemon`
processes on loopback, each with its own cache dir, fetch port and peer port.

Origin bytes are counted by a fault proxy between the cold nodes and the store. A warm node
is filled with `fetch --no-daemon` straight from the store, so its bytes are not counted.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    DaemonProc,
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    wait_for,
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy
from weightcache.cache.layout import Layout
from weightcache.config import PeerSettings
from weightcache.listeners.admission import ConnectionLimits
from weightcache.listeners.http import LoopThread
from weightcache.ops.devstore import free_port
from weightcache.swarm import server as peerserver
from weightcache.swarm.client import Peers
from weightcache.swarm.entry import NodeSwarm
from weightcache.swarm.peerpieces import encode_pieces
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.server import PeerServer
from weightcache.swarm.wire import HELD_ONLY, PIECE_SIZE, PIECES, STREAMING
from weightcache.transfer.parts import PartState

TOKEN = "peer-token-for-tests-0123456789"
PEER_BYTES = 'weightcache_bytes_total{source="peer"}'
ORIGIN_BYTES = 'weightcache_bytes_total{source="origin"}'
UPLOADED = "weightcache_peer_upload_bytes_total"
VERIFY_FAILURES = "weightcache_verify_failures_total"
STORE_ARGS = ("--part-size", "1M", "--max-concurrency", "4")


def refused(reason: str) -> str:
    return f'weightcache_peer_requests_refused_total{{reason="{reason}"}}'


@dataclass
class Node:
    """One simulated node: its cache dir, its peer port and (once started) its daemon."""

    name: str
    cache_dir: Path
    peer_port: int
    daemon: DaemonProc | None = None

    @property
    def peer_addr(self) -> str:
        return f"127.0.0.1:{self.peer_port}"

    @property
    def d(self) -> DaemonProc:
        assert self.daemon is not None, f"{self.name} has no daemon"
        return self.daemon


def make_nodes(tmp_path: Path, count: int) -> list[Node]:
    return [Node(f"node{i}", tmp_path / f"node{i}" / "cache", free_port()) for i in range(count)]


def start(
    daemons: Daemons,  # noqa: F811
    node: Node,
    tmp_path: Path,
    endpoint: str,
    peers: Sequence[str],
    *extra: str,
    token_env: bool = True,
) -> DaemonProc:
    """Start the node's daemon with peers on; the token comes from WEIGHTCACHE_PEER_TOKEN
    as in the DaemonSet (or not at all, with `token_env=False`)."""
    models = write_models(tmp_path / f"{node.name}-models.yaml", [])
    args = ["--peer-addr", node.peer_addr, "--peers", ",".join(peers), *STORE_ARGS, *extra]
    env = {"WEIGHTCACHE_PEER_TOKEN": TOKEN} if token_env else {}
    node.daemon = daemons.start(node.cache_dir, models, endpoint=endpoint, extra=args, env=env,
                                pods_dir=tmp_path / f"{node.name}-pods")  # fmt: skip
    wait_for(f"{node.name}'s peer port", lambda: _listening(node.peer_port), timeout=15)
    return node.daemon


def _listening(port: int) -> bool:
    """A TCP connect only: an HTTP probe would count as a refused request."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def prewarm(wc: CLI, pub: Published, node: Node, store: Any) -> None:
    """Fill a node's cache straight from the store (not through the counting proxy)."""
    proc = wc.fetch(pub.source, node.cache_dir, "--no-daemon", endpoint=store.endpoint_url)
    assert_ok_path(proc, pub.local_path(node.cache_dir))


def peer_get(
    port: int, path: str, token: str | None = TOKEN, method: str = "GET",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:  # fmt: skip
    """(status, body, headers) of one raw request to a peer port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    all_headers = dict(headers or {})
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in all_headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def fetch_all(wc: CLI, pub: Published, nodes: Sequence[Node], endpoint: str) -> list[Any]:
    """One `fetch --json` per node, all started at once; their parsed results."""
    procs = [wc.fetch_popen(pub.source, n.cache_dir, "--json", endpoint=endpoint) for n in nodes]
    results = [p.finish(timeout=90) for p in procs]
    for node, r in zip(nodes, results, strict=True):
        assert r.returncode == 0, f"{node.name}: {describe(r)}\n{node.d.log()}"
    return [json.loads(r.stdout) for r in results]


def assert_node_ok(node: Node, pub: Published) -> None:
    assert_revision_ok(node.cache_dir, pub.name, pub.rev, pub.model)
    assert_blobs_valid(node.cache_dir)


# -- scale-out ------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_one_warm_and_four_cold_nodes_take_one_copy_from_the_store(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([6 * MiB] * 4, name="scale", rev="r1", seed="scale")
    size = pub.model.total_size
    warm, *cold = nodes = make_nodes(tmp_path, 5)
    everyone = [n.peer_addr for n in nodes]  # the same list on every node, self included
    prewarm(wc, pub, warm, store)
    for n in nodes:
        start(daemons, n, tmp_path, proxy.url, everyone)
    proxy.reset_stats()

    results = fetch_all(wc, pub, cold, proxy.url)

    origin = proxy.stats().body_bytes
    print(f"origin bytes {origin} for 4 cold nodes, model {size} bytes "
          f"({origin / size:.3f} x model size)")  # fmt: skip
    assert origin <= 1.1 * size, f"{origin} bytes left the store for a {size}-byte model"
    for node, result in zip(cold, results, strict=True):
        assert not result["hit"] and result["bytes_from_origin"] == 0, result
        assert_node_ok(node, pub)
        m = node.d.metrics()
        assert m[PEER_BYTES] >= size and m[ORIGIN_BYTES] == 0, (node.name, m)
    # Every peer byte was uploaded by some node: the warm one, or a cold one passing on
    # pieces it holds. (Uploads may exceed what arrived: a piece's second source in the
    # endgame is cut off when the first lands, with bytes in flight.)
    uploaded = [n.d.metrics()[UPLOADED] for n in nodes]
    print("uploaded by node:", uploaded)
    assert sum(uploaded) >= sum(n.d.metrics()[PEER_BYTES] for n in cold) >= 4 * size
    assert uploaded[0] > 0
    assert all(n.d.alive() for n in nodes)


@pytest.mark.timeout(150)
def test_a_burst_of_cold_nodes_streams_from_the_first_one(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """No warm node: the first node to claim each blob downloads it from the store; the
    others stream it from that node's partial while it is still arriving."""
    pub = publish([6 * MiB] * 3, name="burst", rev="r1", seed="burst")
    size = pub.model.total_size
    nodes = make_nodes(tmp_path, 4)
    for n in nodes:
        start(daemons, n, tmp_path, proxy.url, [m.peer_addr for m in nodes])
    proxy.reset_stats()
    proxy.configure(rate_limit=8 * MiB)  # ~2.5 s for the model: the burst overlaps it

    results = fetch_all(wc, pub, nodes, proxy.url)

    origin = proxy.stats().body_bytes
    print(f"burst: origin bytes {origin}, model {size} ({origin / size:.3f} x)",
          [r["bytes_from_origin"] for r in results])  # fmt: skip
    assert origin <= 1.1 * size, f"{origin} bytes left the store for a {size}-byte model"
    for node in nodes:
        assert_node_ok(node, pub)
    assert sum(n.d.metrics()[PEER_BYTES] for n in nodes) >= 3 * size * 0.9


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_a_corrupting_peer_is_caught_never_published_and_avoided(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([4 * MiB], name="lie", rev="r1", seed="lie", small_files=False)
    size = pub.model.total_size
    warm, cold = make_nodes(tmp_path, 2)
    prewarm(wc, pub, warm, store)
    start(daemons, warm, tmp_path, store.endpoint_url, [])
    with FaultProxy(f"http://{warm.peer_addr}", seed="lying-peer") as liar:
        liar.configure(scope="all", corrupt_rate=1.0)  # one flipped byte in every body
        start(daemons, cold, tmp_path, proxy.url, [liar.url.removeprefix("http://")])
        # The store corrupts the first download too: with the peer's mismatch that makes
        # two, but only one from the origin, so the fetch must still succeed (exit 4 is
        # for an origin that disagrees with its manifest twice).
        proxy.configure(scope="data", script=("corrupt",))

        result = fetch_all(wc, pub, [cold], proxy.url)[0]

        assert liar.stats().faults.get("corrupt", 0) >= 1, "the peer was never asked"
        assert_node_ok(cold, pub)
        m = cold.d.metrics()
        assert m[VERIFY_FAILURES] == 2, m  # the peer's copy, then the store's first one
        assert m[PEER_BYTES] >= size and result["bytes_from_origin"] >= 2 * size
        assert markers(cold.cache_dir) == [pub.local_path(cold.cache_dir) / ".weightcache"]

        # Afterwards the peer is not even asked, although it holds the next revision.
        pub2 = publish([2 * MiB], name="lie", rev="r2", seed="lie2", small_files=False)
        prewarm(wc, pub2, warm, store)
        asked = liar.stats().requests
        fetch_all(wc, pub2, [cold], proxy.url)
        assert liar.stats().requests == asked, "the corrupting peer was asked again"
        assert_node_ok(cold, pub2)
        assert cold.d.metrics()[PEER_BYTES] == m[PEER_BYTES]


@pytest.mark.timeout(150)
def test_a_peer_that_dies_mid_transfer_leaves_the_rest_to_the_store(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    # One 24 MiB blob, so that what the peer delivers before it dies is in the partial the
    # store must resume (the peer is asked blob by blob: a blob it finished is published).
    pub = publish([24 * MiB], name="dies", rev="r1", seed="dies")
    size = pub.model.total_size
    warm, cold = make_nodes(tmp_path, 2)
    prewarm(wc, pub, warm, store)
    start(daemons, warm, tmp_path, store.endpoint_url, [], "--peer-upload-limit", "4M")
    start(daemons, cold, tmp_path, proxy.url, [warm.peer_addr])
    proxy.reset_stats()

    running = wc.fetch_popen(pub.source, cold.cache_dir, "--json", endpoint=proxy.url)
    wait_for("12 MiB from the peer", lambda: cold.d.metrics()[PEER_BYTES] >= 12 * MiB,
             timeout=30, every=0.05)  # fmt: skip
    warm.d.kill9()
    result = running.finish(timeout=90)

    assert result.returncode == 0, f"{describe(result)}\n{cold.d.log()}"
    assert_node_ok(cold, pub)
    m = cold.d.metrics()
    origin = proxy.stats().body_bytes
    print(f"peer bytes {m[PEER_BYTES]:.0f}, origin bytes {origin}, model {size}")
    # What the peer delivered before it died is kept: the store sends only the rest, plus
    # what may be fetched again: the parts in flight (max-concurrency 4 x part size 1 MiB)
    # and the parts finished since the partial's state was last saved (0.25 s at 4 MiB/s).
    # That margin (5 MiB) is well below what the peer delivered (>= 12 MiB), so a cold node
    # that threw those bytes away (the store sending the whole blob) fails here.
    margin = 5 * MiB + 64 * 1024
    assert m[PEER_BYTES] > margin + 2 * MiB, m[PEER_BYTES]
    assert origin <= size - m[PEER_BYTES] + margin, (
        f"the store sent {origin} bytes of a {size}-byte blob of which the dead peer had "
        f"delivered {m[PEER_BYTES]:.0f}: the peer's bytes were not kept"
    )
    assert m[VERIFY_FAILURES] == 0


# -- what a peer port serves, and to whom -----------------------------------------------------


@pytest.mark.timeout(120)
def test_the_peer_port_serves_blobs_only_and_only_with_the_token(
    wc: CLI, publish: Callable[..., Published], store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB], name="guard", rev="r1", seed="guard")
    (node,) = make_nodes(tmp_path, 1)
    prewarm(wc, pub, node, store)
    start(daemons, node, tmp_path, store.endpoint_url, [])
    shard = pub.model.file(pub.model.shard_names()[0])
    blob = f"/blobs/sha256/{shard.sha256}"
    data = (node.cache_dir / pub.name / pub.rev / shard.relpath).read_bytes()

    # With the token: the blob, whole or in ranges.
    status, body, headers = peer_get(node.peer_port, blob)
    assert (status, body) == (200, data)
    status, body, headers = peer_get(node.peer_port, blob, headers={"Range": "bytes=100-199"})
    assert (status, body) == (206, data[100:200])
    assert headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    status, _, headers = peer_get(node.peer_port, blob, method="HEAD")
    assert status == 200 and headers[PIECES] == "all" and PIECE_SIZE not in headers

    # Somewhere to lure a path to: a secret outside the blob store, and a symlink to it
    # planted in the blob store under a valid-looking name.
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"TOP SECRET " * 100)
    planted = "cd" * 32
    os.symlink(secret, blobs_dir(node.cache_dir) / planted)
    unpublished = "ef" * 32  # a partial that no download of this daemon owns
    (node.cache_dir / ".weightcache" / "tmp" / f"{unpublished}.part").write_bytes(b"x" * 100)

    cases: list[tuple[str, dict[str, Any], int, str]] = [
        (blob, {"token": None}, 401, "no_token"),
        (blob, {"token": "wrong-token-0123456789abcdef"}, 403, "bad_token"),
        (blob, {"token": TOKEN[:-1]}, 403, "bad_token"),
        (blob, {"token": None, "headers": {"Authorization": f"Basic {TOKEN}"}}, 403, "bad_token"),
        (f"/blobs/sha256/{'0' * 64}", {}, 404, "not_found"),
        (f"/blobs/sha256/{planted}", {}, 404, "not_found"),
        (f"/blobs/sha256/{unpublished}", {}, 404, "not_found"),
        ("/blobs/sha256/../../state.db", {}, 404, "bad_path"),
        ("/blobs/sha256/%2e%2e%2f%2e%2e%2fstate.db", {}, 404, "bad_path"),
        (f"{blob}/../../state.db", {}, 404, "bad_path"),
        (f"/blobs/sha256/{shard.sha256.upper()}", {}, 404, "bad_path"),
        (f"{blob}?download=1", {}, 404, "bad_path"),
        (f"/{pub.name}/{pub.rev}/{shard.relpath}", {}, 404, "bad_path"),
        ("/.weightcache/state.db", {}, 404, "bad_path"),
        (str(secret), {}, 404, "bad_path"),
        ("/metrics", {}, 404, "bad_path"),
        (blob, {"headers": {"Range": f"bytes={len(data)}-"}}, 416, "bad_range"),
        (blob, {"headers": {"Range": "bytes=0-1,5-6"}}, 416, "bad_range"),
        (blob, {"method": "PUT"}, 405, "method"),
        (blob, {"method": "DELETE"}, 405, "method"),
    ]
    for path, kwargs, code, _ in cases:
        status, body, _ = peer_get(node.peer_port, path, **kwargs)
        assert status == code, (path, kwargs, status, body[:100])
        assert body.startswith(b"refused:") and b"SECRET" not in body, (path, body[:100])
        assert data[:64] not in body
    m = node.d.metrics()
    for reason in {c[3] for c in cases}:
        expected = sum(1 for c in cases if c[3] == reason)
        assert m[refused(reason)] == expected, (reason, m[refused(reason)], expected)
    assert m[UPLOADED] == len(data) + 100

    # Without a token, or with a weak one, the daemon does not start with peers on.
    models = write_models(tmp_path / "m.yaml", [])
    base = ["daemon", "--cache-dir", tmp_path / "other", "--models", models, "--capacity",
            "1G", "--peer-addr", f"127.0.0.1:{free_port()}"]  # fmt: skip
    message = assert_fails(wc.run(*base, timeout=30), 2)
    assert "--peer-token" in message and "WEIGHTCACHE_PEER_TOKEN" in message, message
    message = assert_fails(wc.run(*base, "--peer-token", "short", timeout=30), 2)
    assert "16" in message, message


@pytest.mark.timeout(120)
def test_the_upload_limit_holds_under_load(
    wc: CLI, publish: Callable[..., Published], store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([6 * MiB] * 2, name="paced", rev="r1", seed="paced", small_files=False)
    (node,) = make_nodes(tmp_path, 1)
    prewarm(wc, pub, node, store)
    rate = 4 * MiB
    start(daemons, node, tmp_path, store.endpoint_url, [], "--peer-upload-limit", "4M")
    paths = [f"/blobs/sha256/{f.sha256}" for f in pub.model.files]
    requests = [paths[i % 2] for i in range(4)]  # 4 clients, 24 MiB together
    sizes: list[int] = []

    def client(path: str) -> None:
        status, body, _ = peer_get(node.peer_port, path)
        assert status == 200
        sizes.append(len(body))

    threads = [threading.Thread(target=client, args=(p,)) for p in requests]
    written = written_by(node.d.proc.pid)
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - t0
    total = sum(sizes)
    burst = rate / 4  # the token bucket's: a quarter second of traffic
    print(f"{total} bytes to 4 clients in {elapsed:.2f}s: {total / elapsed / MiB:.2f} MiB/s")
    assert total == 24 * MiB
    assert elapsed >= (total - burst) / rate * 0.97, f"{total / elapsed / MiB:.2f} MiB/s"
    assert elapsed <= total / rate * 1.5 + 2, f"only {total / elapsed / MiB:.2f} MiB/s"
    assert node.d.metrics()[UPLOADED] == total
    assert written_by(node.d.proc.pid) - written >= total, "not sent with sendfile(2)"


def written_by(pid: int) -> int:
    """Bytes a process wrote through the VFS so far (/proc/PID/io `wchar`): sendfile(2)
    counts there, a send(2) on a socket does not. A sendfile upload of N bytes adds >= N."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["wchar"])


@pytest.mark.timeout(120)
def test_complete_blobs_go_out_with_sendfile_on_kept_alive_connections(
    wc: CLI, publish: Callable[..., Published], store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([24 * MiB + 12345], name="sendfile", rev="r1", seed="sendfile",
                  small_files=False)  # fmt: skip
    (node,) = make_nodes(tmp_path, 1)
    prewarm(wc, pub, node, store)
    start(daemons, node, tmp_path, store.endpoint_url, [])
    shard = pub.model.files[0]
    data = (node.cache_dir / pub.name / pub.rev / shard.relpath).read_bytes()
    size = len(data)
    ranges = [None, (0, 0), (1, 3 * MiB + 7), (size - 5, size - 1), (5 * MiB, size - 1)]
    conn = http.client.HTTPConnection("127.0.0.1", node.peer_port, timeout=30)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    written, sent, sock = written_by(node.d.proc.pid), 0, None
    try:
        for r in ranges:
            headers = dict(auth) if r is None else {**auth, "Range": f"bytes={r[0]}-{r[1]}"}
            conn.request("GET", f"/blobs/sha256/{shard.sha256}", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            want = data if r is None else data[r[0] : r[1] + 1]
            assert (resp.status, len(body)) == (200 if r is None else 206, len(want)), r
            assert body == want, r
            assert sock is None or conn.sock is sock, "the connection was not kept alive"
            sock, sent = conn.sock, sent + len(body)
    finally:
        conn.close()
    assert written_by(node.d.proc.pid) - written >= sent, "not sent with sendfile(2)"
    assert node.d.metrics()[UPLOADED] == sent


# -- misbehaving clients (design §5, Bounds) ------------------------------------------------


@pytest.mark.timeout(120)
def test_a_peer_client_trickling_its_request_head_is_cut_off(
    wc: CLI, publish: Callable[..., Published], store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB], name="slowloris", rev="r1", seed="slowloris")
    (node,) = make_nodes(tmp_path, 1)
    prewarm(wc, pub, node, store)
    start(daemons, node, tmp_path, store.endpoint_url, [])
    head = f"GET /blobs/sha256/{pub.model.files[0].sha256} HTTP/1.1\r\n".encode()
    with socket.create_connection(("127.0.0.1", node.peer_port), timeout=5) as s:
        started = time.monotonic()
        cut = False
        for i in range(len(head)):  # one byte every 2 s: 60+ s for the request line alone
            if time.monotonic() - started > 40:
                break
            try:
                s.sendall(head[i : i + 1])
                s.settimeout(2.0)
                cut = s.recv(1024) == b""
            except TimeoutError:
                continue
            except OSError:
                cut = True
            if cut:
                break
        elapsed = time.monotonic() - started
    assert cut, f"the connection was still open after {elapsed:.0f}s of trickling"
    assert elapsed < 30, f"cut off only after {elapsed:.0f}s"
    assert node.d.alive(), node.d.log()
    # A well-behaved request still gets the blob.
    assert peer_get(node.peer_port, f"/blobs/sha256/{pub.model.files[0].sha256}")[0] == 200


@pytest.mark.timeout(120)
def test_a_burst_of_heads_is_answered_without_backlog_timeouts(
    wc: CLI, publish: Callable[..., Published], store: Any,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    pub = publish([1 * MiB], name="burst", rev="r1", seed="burst")
    (node,) = make_nodes(tmp_path, 1)
    prewarm(wc, pub, node, store)
    start(daemons, node, tmp_path, store.endpoint_url, [])
    path = f"/blobs/sha256/{pub.model.files[0].sha256}"
    clients = 300
    barrier = threading.Barrier(clients)
    results: list[int | str] = []

    def head() -> None:
        barrier.wait(timeout=60)
        # The timeout the daemons use between themselves (client.HEAD_TIMEOUT is 1 s), with
        # room for a loaded test machine; a SYN dropped by a full backlog costs 1 s, then 3 s.
        conn = http.client.HTTPConnection("127.0.0.1", node.peer_port, timeout=3.0)
        try:
            conn.request("HEAD", path, headers={"Authorization": f"Bearer {TOKEN}"})
            results.append(conn.getresponse().status)
        except OSError as e:
            results.append(repr(e))
        finally:
            conn.close()

    threads = [threading.Thread(target=head) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    failed = [r for r in results if r != 200]
    assert len(results) == clients and not failed, f"{len(failed)} of {clients}: {failed[:5]}"


# -- what a node advertises while downloading (one PeerServer in this process) ------------------

PIECE = 64 << 10


@dataclass
class Counted:
    """The server's observer: what it uploaded and refused."""

    uploaded: int = 0
    streamed: int = 0
    refused: list[str] = field(default_factory=list)

    def peer_uploaded(self, nbytes: int) -> None:
        self.uploaded += nbytes

    def peer_streamed(self, nbytes: int) -> None:
        self.streamed += nbytes

    def peer_refused(self, reason: str) -> None:
        self.refused.append(reason)


@dataclass
class Served:
    port: int
    layout: Layout
    peers: Peers
    counted: Counted


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A peer server on loopback with a 1 s idle timeout (the daemon's is a minute)."""
    monkeypatch.setattr(
        peerserver, "PEER_LIMITS", ConnectionLimits(connections=8, idle=1.0, header=1.0)
    )
    settings = PeerSettings(("127.0.0.1", 0), TOKEN, upload_limit=None)
    layout, counted = Layout.open(tmp_path / "cache"), Counted()
    peers = NodeSwarm(settings)
    server = PeerServer(settings, layout, peers, counted)
    loop = LoopThread("peer-test")
    try:
        loop.run(server.start())
        yield Served(server.address[1], layout, peers, counted)
    finally:
        loop.run(server.http.close())
        loop.stop()
        peers.close()


def downloading(served: Served, done: list[bool], size: int) -> tuple[str, bytes, Path]:
    """A partial blob the node is downloading, with the parts `done` written (and the
    others holding junk that must never be served)."""
    data = random.Random(size).randbytes(size)
    sha256 = "5e" * 32
    partial = served.layout.partial(sha256)
    partial.write_bytes(bytes(b ^ 0xFF for b in data))  # every byte wrong until written
    state = PartState(size, PIECE)
    with partial.open("r+b") as f:
        for i, (start, end) in enumerate(state.parts):
            if done[i]:
                f.seek(start)
                f.write(data[start:end])
    state.done = list(done)
    state.save(Layout.part_state(partial))
    served.peers.claim(sha256, partial, size)
    return sha256, data, partial


def test_a_partial_advertises_its_pieces_and_serves_any_it_holds(served: Served) -> None:
    done = [False, True, False, True, False, True]
    size = 5 * PIECE + 100
    sha256, data, partial = downloading(served, done, size)
    blob = f"/blobs/sha256/{sha256}"
    status, _, headers = peer_get(served.port, blob, method="HEAD")
    assert status == 200
    assert (headers[PIECES], headers[PIECE_SIZE]) == (encode_pieces(done), str(PIECE))
    assert headers["X-Weightcache-Available"] == "0"  # the contiguous prefix, as before

    # Inside a held piece that is not in the prefix, and the short last one.
    for start, end in [(PIECE, 2 * PIECE), (PIECE + 10, PIECE + 20), (5 * PIECE, size),
                       (3 * PIECE, 4 * PIECE)]:  # fmt: skip
        for held_only in ({}, {HELD_ONLY: "1"}):
            headers = {"Range": f"bytes={start}-{end - 1}", **held_only}
            status, body, got = peer_get(served.port, blob, headers=headers)
            assert (status, body == data[start:end]) == (206, True), (start, end, held_only)
            assert got[PIECES] == encode_pieces(done)

    # A range touching a piece not held, asked for held pieces only: refused at once.
    for start, end in [(0, 1), (2 * PIECE, 2 * PIECE + 1), (PIECE, 2 * PIECE + 1), (0, size)]:
        t0 = time.monotonic()
        headers = {"Range": f"bytes={start}-{end - 1}", HELD_ONLY: "1"}
        status, body, got = peer_get(served.port, blob, headers=headers)
        assert (status, got["Content-Range"]) == (416, f"bytes */{size}"), (start, end)
        assert got[PIECES] == encode_pieces(done) and body.startswith(b"refused:")
        assert time.monotonic() - t0 < 5
    assert served.counted.refused == ["not_held"] * 4

    # Without held-only (today's client), a GET waits for a missing piece to be written.
    results: list[tuple[int, bytes, dict[str, str]]] = []
    headers = {"Range": f"bytes={2 * PIECE}-{3 * PIECE - 1}"}

    def get() -> None:
        results.append(peer_get(served.port, blob, headers=headers))

    waiter = threading.Thread(target=get)
    waiter.start()
    time.sleep(0.5)
    with partial.open("r+b") as f:
        f.seek(2 * PIECE)
        f.write(data[2 * PIECE : 3 * PIECE])
    state = PartState(size, PIECE, done=[False, True, True, True, False, True])
    state.save(Layout.part_state(partial))
    waiter.join(timeout=30)
    assert results and results[0][0] == 206 and results[0][1] == data[2 * PIECE : 3 * PIECE]


def test_the_token_is_checked_before_the_path_or_the_pieces(served: Served) -> None:
    sha256, _, _ = downloading(served, [False, True], PIECE + 1)
    for path, headers in [(f"/blobs/sha256/{sha256}", {"Range": "bytes=0-0", HELD_ONLY: "1"}),
                          (f"/blobs/sha256/{'0' * 64}", {}), ("/../state.db", {}),
                          (f"/blobs/sha256/{sha256}", {"Range": "bytes=900000-"})]:  # fmt: skip
        status, body, got = peer_get(served.port, path, token="wrong-token-0123456789abcdef",
                                     headers=headers)  # fmt: skip
        assert (status, body) == (403, b"refused: bad_token\n"), path
        assert PIECES not in got
    assert served.counted.refused == ["bad_token"] * 4 and served.counted.uploaded == 0


def test_an_idle_peer_connection_is_closed(served: Served) -> None:
    sha256, data, _ = downloading(served, [True, True], PIECE + 1)
    request = (f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(request)
        received = b""
        t0 = time.monotonic()
        while True:  # the response, then the close once the connection idled past 1 s
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            received += chunk
        elapsed = time.monotonic() - t0
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(data)
    assert elapsed < 8, f"an idle connection stayed open {elapsed:.1f}s"


def test_a_client_leaving_mid_sendfile_does_not_stop_the_server(served: Served) -> None:
    data = random.Random(7).randbytes(48 * MiB + 3)
    sha256 = "7a" * 32
    served.layout.blob(sha256).write_bytes(data)
    request = (f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()  # fmt: skip
    for _ in range(3):  # read a little, then reset the connection
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
            s.sendall(request)
            assert s.recv(1024).startswith(b"HTTP/1.1 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    status, body, headers = peer_get(served.port, f"/blobs/sha256/{sha256}",
                                     headers={"Range": f"bytes={MiB}-"})  # fmt: skip
    assert (status, body == data[MiB:], headers[PIECES]) == (206, True, "all")


def test_a_receiver_that_stops_reading_has_its_response_cut(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that asks for a blob and then reads nothing must not keep its upload slot
    (and the file) for good: the chunk it does not take in time ends the response."""
    monkeypatch.setattr(peerserver, "SEND_GRACE", 1.0)
    monkeypatch.setattr(peerserver, "SEND_MIN_RATE", 1 << 40)  # the grace alone
    size = 64 << 20  # far more than the socket buffers hold
    data = random.Random(7).randbytes(1 << 20) * 64
    sha256 = "6f" * 32
    served.layout.blob(sha256).write_bytes(data)
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    try:
        sock.sendall(f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())  # fmt: skip
        time.sleep(4)  # reading nothing, past the grace
        got = 0
        while chunk := sock.recv(1 << 20):  # what was buffered, then the server's close
            got += len(chunk)
    finally:
        sock.close()
    assert 0 < got < size, f"{got} bytes: the response was not cut"


def test_a_receiver_gone_before_a_chunk_starts_is_not_an_error(
    served: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver that resets its connection between two chunks of a blob is routine (a
    peer that got the piece elsewhere): the response ends, and nothing is logged as an
    error. The connection is checked in the same step as the chunk's sendfile(2) starts;
    checked before, a reset in between made asyncio raise RuntimeError('Transport is
    closing'), logged as an error (seen in a 16-node round)."""
    monkeypatch.setattr(peerserver, "SENDFILE_CHUNK", 1 << 20)
    sending = peerserver.PeerServer._in_time

    async def late(self: PeerServer, chunk: Any, nbytes: int) -> Any:
        await asyncio.sleep(0.3)  # the reset lands between the check and the send
        return await sending(self, chunk, nbytes)

    monkeypatch.setattr(peerserver.PeerServer, "_in_time", late)
    sha256 = "6d" * 32
    served.layout.blob(sha256).write_bytes(random.Random(6).randbytes(1 << 20) * 8)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        sock.settimeout(10)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())  # fmt: skip
        got = 0
        while got < 1 << 20:  # the first chunk's bytes have arrived (with the headers)
            got += len(sock.recv(1 << 20))
    time.sleep(1.0)  # the server finds the connection gone at its next chunk
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def test_receivers_sharing_an_uplink_are_not_cut_for_their_share_of_it(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four receivers each reading at 1.5 MiB/s, below SEND_MIN_RATE (4 MiB/s here) but
    above their share of it (1 MiB/s): honest, as on a crowded uplink, so not cut. The first
    starts alone (its chunk's deadline at 4 MiB/s: 5 s for 16 MiB), the others join it:
    judged again as they come, it is not cut either. At a fixed 256 KiB/s each, a 12.5 mbit
    uplink serving 60 pieces cut every one of them."""
    monkeypatch.setattr(peerserver, "SEND_GRACE", 1.0)
    monkeypatch.setattr(peerserver, "SEND_MIN_RATE", 4 << 20)
    size, pace = 16 << 20, 1.5 * (1 << 20)
    data = random.Random(8).randbytes(1 << 20) * 16
    sha256 = "6e" * 32
    served.layout.blob(sha256).write_bytes(data)
    got: list[int] = []

    def receive() -> None:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # no autotuning
            sock.settimeout(30)
            sock.connect(("127.0.0.1", served.port))
            sock.sendall(f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
                         .encode())  # fmt: skip
            began, total = time.monotonic(), 0
            while chunk := sock.recv(64 << 10):
                total += len(chunk)
                time.sleep(max(0.0, began + total / pace - time.monotonic()))
        got.append(total)

    threads = [threading.Thread(target=receive) for _ in range(4)]
    threads[0].start()
    time.sleep(0.3)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and all(n > size for n in got), got  # headers and the whole body


def test_two_range_headers_are_refused_not_read_as_the_first(served: Served) -> None:
    sha256 = "7a" * 32
    served.layout.blob(sha256).write_bytes(b"0123456789")
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {TOKEN}\r\nRange: bytes=0-1\r\n"
                     "Range: bytes=5-6\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 416 "), answer[:200]
    assert served.counted.refused == ["bad_range"]


class Streaming:
    """A swarm download as the peer server sees it (`client.Live`): piece 1 of 4 arriving
    from the store (`arrive` moves its received bytes on), the others not held; `land`
    writes it to the partial and marks it held, `fail` ends its request unwritten."""

    SIZE, PIECE = 4 * (256 << 10), 256 << 10

    def __init__(self, partial: Path, data: bytes) -> None:
        self.partial, self.data = partial, data
        self.received, self.held, self.streaming = 0, Bitmap(4), Bitmap.of(4, [1])

    def pieces(self) -> tuple[int, Bitmap, Bitmap, Bitmap]:
        return self.PIECE, self.held, self.streaming, self.streaming

    def streamed(self, piece: int, offset: int, limit: int, at_least: int) -> bytes | None:
        if piece not in self.streaming:
            return None
        base = piece * self.PIECE
        end = min(self.received, offset + limit)
        return self.data[base + offset : base + end] if end - offset >= at_least else b""

    def joined(self, peer: str) -> None:
        pass

    def arrive(self, nbytes: int) -> None:
        self.received = min(self.PIECE, self.received + nbytes)

    def land(self) -> None:
        with self.partial.open("r+b") as f:
            f.seek(self.PIECE)
            f.write(self.data[self.PIECE : 2 * self.PIECE])
        self.held, self.streaming = Bitmap.of(4, [1]), Bitmap(4)

    def fail(self) -> None:
        self.streaming = Bitmap(4)


def streaming(served: Served) -> tuple[str, Streaming]:
    data = random.Random(5).randbytes(Streaming.SIZE)
    sha256 = "5f" * 32
    partial = served.layout.partial(sha256)
    partial.write_bytes(bytes(Streaming.SIZE))  # zeros: never to be served as the piece
    live = Streaming(partial, data)
    served.peers.claim(sha256, partial, Streaming.SIZE)
    served.peers.advertise(sha256, live)
    return sha256, live


def open_piece(served: Served, sha256: str, piece: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    start, end = piece * Streaming.PIECE, (piece + 1) * Streaming.PIECE - 1
    headers = {"Authorization": f"Bearer {TOKEN}", "Range": f"bytes={start}-{end}", HELD_ONLY: "1"}
    conn.request("GET", f"/blobs/sha256/{sha256}", headers=headers)
    return conn.getresponse()


def test_a_piece_coming_from_the_store_is_passed_on_as_it_arrives(served: Served) -> None:
    """Cut-through (design §8, Swarm): a piece the node is receiving from the store is
    advertised as streamed and served to a held-only GET while it arrives; its bytes go out
    before the piece is complete, and the rest, once written, from the file."""
    sha256, live = streaming(served)
    status, _, headers = peer_get(served.port, f"/blobs/sha256/{sha256}", method="HEAD")
    assert (status, headers[STREAMING]) == (200, Bitmap.of(4, [1]).encode())
    live.arrive(100 << 10)
    resp = open_piece(served, sha256, 1)
    assert resp.status == 206
    first = resp.read1(1 << 20)
    while len(first) < 100 << 10:
        first += resp.read1(1 << 20)
    assert first == live.data[Streaming.PIECE : Streaming.PIECE + (100 << 10)]
    assert live.received < Streaming.PIECE  # sent before the piece was complete
    live.arrive(100 << 10)
    time.sleep(0.2)
    live.land()  # the last 56 KiB come from the file
    rest = resp.read()
    assert first + rest == live.data[Streaming.PIECE : 2 * Streaming.PIECE]
    # counted as uploads (once the server's last write returned: the client may read first);
    # as passed on from the store, what came from its buffer only
    wait_for("the piece counted", lambda: served.counted.uploaded == Streaming.PIECE, 5)
    assert 200 << 10 <= served.counted.streamed < Streaming.PIECE
    # the piece not streamed nor held, or a range past the streamed piece: refused at once
    for piece_range in ("bytes=0-9", f"bytes={Streaming.PIECE}-{2 * Streaming.PIECE}"):
        live.held, live.streaming = Bitmap(4), Bitmap.of(4, [1])
        status, _, _ = peer_get(served.port, f"/blobs/sha256/{sha256}",
                                headers={"Range": piece_range, HELD_ONLY: "1"})  # fmt: skip
        assert status == 416, piece_range


def test_a_streamed_piece_trickling_in_is_passed_on_within_a_second(served: Served) -> None:
    """Less than STREAM_CHUNK arriving from the store (a crowded link: 10-30 kB/s) still
    goes out once STREAM_FLUSH passed without a write, before the receiver's read timeout
    (5 s): receivers waiting for 64 KiB timed out together and threw their bytes away."""
    sha256, live = streaming(served)
    live.arrive(10 << 10)
    resp = open_piece(served, sha256, 1)
    resp.fp.raw._sock.settimeout(peerserver.STREAM_FLUSH + 2)  # type: ignore[union-attr]
    base, sent = Streaming.PIECE, 0
    for arrived in (10 << 10, 30 << 10):  # the first bytes, then the next trickle
        began = time.monotonic()
        assert resp.read1(1 << 20) == live.data[base + sent : base + arrived]
        assert time.monotonic() - began < peerserver.STREAM_FLUSH + 1
        sent = arrived
        live.arrive(20 << 10)
    live.land()
    assert resp.read() == live.data[base + (30 << 10) : 2 * base]


def test_a_streamed_piece_whose_store_request_fails_is_cut_never_padded(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peerserver, "PARTIAL_WAIT", 1.0)
    sha256, live = streaming(served)
    live.arrive(128 << 10)
    resp = open_piece(served, sha256, 1)
    first = b""
    while len(first) < 128 << 10:
        first += resp.read1(1 << 20)
    assert first == live.data[Streaming.PIECE : Streaming.PIECE + (128 << 10)]
    live.fail()  # nothing more comes, and the zeros of the file are not the piece
    with pytest.raises(http.client.IncompleteRead) as cut:
        resp.read()
    assert cut.value.partial == b""


def test_a_peer_leaving_before_its_answer_is_not_logged_as_an_error(
    served: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A swarm drops requests all the time (a piece landed from another source first, a
    node's blob complete, a peer judged too slow): an answer meeting a connection its client
    reset is routine. It was one ERROR line each, 163 in a 200 s run of 16 nodes."""
    sha256 = "7c" * 32
    served.layout.blob(sha256).write_bytes(b"0123456789")
    asked, answer = threading.Event(), threading.Event()
    locate = PeerServer._locate

    async def slow_locate(self: PeerServer, sha: str) -> Any:
        asked.set()
        while not answer.is_set():
            await asyncio.sleep(0.01)
        return await locate(self, sha)

    monkeypatch.setattr(PeerServer, "_locate", slow_locate)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(f"GET /blobs/sha256/{sha256} HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())  # fmt: skip
        assert asked.wait(5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    time.sleep(0.2)  # the server has seen the reset
    answer.set()
    time.sleep(0.2)
    status, body, _ = peer_get(served.port, f"/blobs/sha256/{sha256}")  # and serves on
    assert (status, body) == (200, b"0123456789")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
