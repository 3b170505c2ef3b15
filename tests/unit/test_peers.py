"""peers: settings, Range parsing, token check, source ranking, discovery, the avoid list
and the served prefix of a partial, with literal values and a fake clock (no network)."""

from __future__ import annotations

import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pytest

from weightcache import cli
from weightcache.config import PeerSettings, format_hostport, parse_hostport
from weightcache.daemon.metrics import BAD_PEER_REASONS
from weightcache.errors import UsageError
from weightcache.options import env, peer_settings
from weightcache.swarm.client import BAD_PEER_SECONDS
from weightcache.swarm.discovery import Discovery
from weightcache.swarm.entry import NodeSwarm
from weightcache.swarm.peerpieces import (
    Pieces,
    encode_pieces,
    parse_pieces,
    partial_pieces,
    partial_prefix,
)
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.server import parse_range, refusal
from weightcache.swarm.wire import (
    BLOB_PATH,
    FETCHING,
    LOAD,
    PIECE_SIZE,
    PIECES,
    STREAMING,
    parse_view,
    peer_url,
    regrid,
)
from weightcache.transfer.parts import PartState

if TYPE_CHECKING:
    from tests.unit.conftest import FakeClock

TOKEN = "0123456789abcdef-token"
HEX = "ab" * 32


def settings(**kw: Any) -> PeerSettings:
    kw.setdefault("listen", ("127.0.0.1", 9401))
    kw.setdefault("token", TOKEN)
    return PeerSettings(**kw)


# -- settings ---------------------------------------------------------------------------------


def from_options(*args: str, token: str | None = TOKEN) -> PeerSettings | None:
    """The peer settings of `weightcache daemon ARGS`, parsed as the command line does."""
    base = ["--cache-dir", "/tmp/c", "--models", "/tmp/m.yaml", "--capacity", "1G"]
    if token is not None:
        base += ["--peer-token", token]
    with cli.daemon.make_context("daemon", [*base, *args]) as ctx:
        return peer_settings(dict(ctx.params))


@pytest.fixture(autouse=True)
def _no_peer_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in ("peer-addr", "peer-token", "peer-upload-limit", "peers", "peer-service"):
        monkeypatch.delenv(env(option), raising=False)


def test_from_options_builds_the_settings() -> None:
    s = from_options("--peer-addr", "0.0.0.0:9401", "--peer-upload-limit", "2G",
                     "--peers", "10.0.0.1:9401, [fd00::2]:9401", token=f" {TOKEN}\n")  # fmt: skip
    assert s is not None
    assert s.listen == ("0.0.0.0", 9401)
    assert s.token == TOKEN  # a trailing newline from a Secret file is not part of it
    assert s.upload_limit == 2 << 30
    assert s.static == (("10.0.0.1", 9401), ("fd00::2", 9401))
    assert TOKEN not in repr(s)
    s = from_options("--peer-addr", "[::]:9401", "--peer-service", "weightcache.ns.svc:9401")
    assert s is not None and s.service == ("weightcache.ns.svc", 9401)
    assert s.listen == ("::", 9401) and s.upload_limit == 1 << 30


def test_peers_are_off_without_an_address() -> None:
    assert from_options() is None
    with pytest.raises(UsageError, match="need --peer-addr"):
        from_options("--peers", "10.0.0.1:9401")


@pytest.mark.parametrize(
    ("token", "match"),
    [
        (None, "needs --peer-token"),
        ("", "needs --peer-token"),
        ("short", "at least 16"),
        ("sixteen chars but spaces", "without spaces"),
        ("x" * 15 + "\x00", "printable"),
    ],
)
def test_a_missing_or_weak_token_is_refused(token: str | None, match: str) -> None:
    # A weak one where it enters (click: the error names WEIGHTCACHE_PEER_TOKEN when it
    # came from there), a missing one with the other peer options.
    with pytest.raises((UsageError, click.BadParameter), match=match):
        from_options("--peer-addr", "0.0.0.0:9401", token=token)


@pytest.mark.parametrize(
    "text",
    ["9401", "host:", "host:port", "host:70000", ":9401", "h:0", "[::1]", "[::1]:", "::1:9401",
     "fd00::1", "[::1]9401", "[host]:9401", "[::1]:x"],
)  # fmt: skip
def test_bad_host_port_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="HOST:PORT"):
        parse_hostport(text, "--peers entry")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.7:9401", ("10.0.0.7", 9401)), ("node-a.svc:1", ("node-a.svc", 1)),
     ("[fd00::7]:9401", ("fd00::7", 9401)), ("[::1]:65535", ("::1", 65535)),
     (" [fe80::1%eth0]:9401 ", ("fe80::1%eth0", 9401))],
)  # fmt: skip
def test_host_port_with_and_without_ipv6(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text, "--peers entry") == expected
    assert parse_hostport(format_hostport(*expected), "again") == expected


def test_listen_may_use_port_zero_and_v6() -> None:
    assert parse_hostport("127.0.0.1:0", "--peer-addr", listen=True) == ("127.0.0.1", 0)
    assert parse_hostport("[::]:9401", "--peer-addr") == ("::", 9401)
    assert parse_hostport(":0", "--peer-addr", listen=True) == ("", 0)


def test_static_list_and_service_together_are_refused() -> None:
    with pytest.raises(UsageError, match="not both"):
        settings(static=(("10.0.0.1", 9401),), service=("svc", 9401))
    with pytest.raises(UsageError, match="more than zero"):
        settings(upload_limit=0)


# -- the server's pure checks -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 100, None),
        ("bytes=0-99", 100, (0, 100)),
        ("bytes=10-19", 100, (10, 20)),
        ("bytes=10-", 100, (10, 100)),
        ("bytes=90-500", 100, (90, 100)),  # clamped to the blob, as RFC 9110 says
        ("bytes=-30", 100, (70, 100)),
        ("bytes=-300", 100, (0, 100)),
    ],
)
def test_parse_range(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == expected


@pytest.mark.parametrize(
    "header",
    ["bytes=100-", "bytes=5-4", "bytes=-", "bytes=0-1,5-6", "items=0-1", "bytes=a-b", "0-1"],
)
def test_parse_range_refuses_what_it_cannot_serve(header: str) -> None:
    with pytest.raises(ValueError):
        parse_range(header, 100)


def test_refusal_wants_exactly_the_bearer_token() -> None:
    assert refusal(f"Bearer {TOKEN}", TOKEN) is None
    assert refusal(f"bearer  {TOKEN} ", TOKEN) is None
    assert refusal(None, TOKEN) == "no_token"
    assert refusal("", TOKEN) == "no_token"
    for wrong in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN,
                  "Bearer", f"Bearer {TOKEN.upper()}", "Bearer é"):  # fmt: skip
        assert refusal(wrong, TOKEN) == "bad_token", wrong


@pytest.mark.parametrize(
    "path",
    [
        f"/blobs/sha256/{HEX}/",
        f"/blobs/sha256/{HEX.upper()}",
        f"/blobs/sha256/{HEX}?x=1",
        f"/blobs/sha256/{HEX[:-1]}",
        f"/blobs/sha256/../../{HEX}",
        "/blobs/sha256/%2e%2e%2fstate.db",
        f"/blobs/sha256/{HEX}/../../state.db",
        f"//blobs/sha256/{HEX}",
        f"http://peer/blobs/sha256/{HEX}",
        "/.weightcache/state.db",
        "/metrics",
    ],
)
def test_only_the_blob_path_matches(path: str) -> None:
    assert BLOB_PATH.fullmatch(f"/blobs/sha256/{HEX}")
    assert BLOB_PATH.fullmatch(path) is None


def test_partial_prefix_is_the_contiguous_written_parts(tmp_path: Path) -> None:
    state = tmp_path / f"{HEX}.part.json"
    assert partial_prefix(state, 100_000) == 0  # no state yet
    parts = PartState(100_000, 16384)
    parts.done[0] = parts.done[1] = parts.done[3] = True
    parts.save(state)
    assert partial_prefix(state, 100_000) == 2 * 16384  # part 2 missing: the prefix stops
    parts.done[2] = True
    parts.save(state)
    assert partial_prefix(state, 100_000) == 4 * 16384
    assert partial_prefix(state, 99_999) == 0  # a state for another size is not trusted
    state.write_text('{"size": 100000, "part_size": 1, "done": [0]}')
    assert partial_prefix(state, 100_000) == 0
    state.write_text("not json")
    assert partial_prefix(state, 100_000) == 0


def test_pieces_bitmap_round_trips_lsb_first() -> None:
    held = [True, False, False, True, False, False, False, False, False, True]
    text = encode_pieces(held)
    assert text == "CQI="  # byte 0: bits 0 and 3; byte 1: bit 1 (piece 9)
    assert parse_pieces(text, 10) == held
    assert parse_pieces("all", 3) == [True] * 3
    assert encode_pieces([]) == "" and parse_pieces("", 0) == []
    for n in (1, 7, 8, 9, 64, 333):
        every = [i % 3 == 0 for i in range(n)]
        assert parse_pieces(encode_pieces(every), n) == every


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("CQI=", 9),  # bit 9 is past the last of 9 pieces
        ("CQI=", 17),  # 2 bytes for 17 pieces (3 needed)
        ("CQ==", 10),  # 1 byte for 10 pieces
        ("CQI", 10),  # no padding
        ("CQI=\n", 10),
        (" CQI=", 10),
        ("CQJ=", 10),  # non-canonical: the unused bits of the last base64 digit are set
        ("C-I=", 10),
        ("ALL", 10),
        ("all ", 10),
        ("é", 10),
    ],
)
def test_pieces_parsing_is_strict(text: str, count: int) -> None:
    with pytest.raises(ValueError):
        parse_pieces(text, count)


def test_pieces_runs_and_cover() -> None:
    p = Pieces(100, 30, (True, False, True, True))  # [0,30) [30,60) [60,90) [90,100)
    assert [p.run_end(x) for x in (0, 29, 30, 59, 60, 95)] == [30, 30, 30, 59, 100, 100]
    assert p.covers(0, 30) and p.covers(60, 100) and p.covers(65, 70)
    assert not p.covers(0, 31) and not p.covers(29, 61) and not p.covers(59, 60)
    assert p.covers(10, 10)  # nothing asked, nothing missing
    complete = Pieces(100)
    assert complete.header() == "all" and complete.run_end(42) == 100 and complete.covers(0, 100)
    assert p.header() == encode_pieces([True, False, True, True])


def test_partial_pieces_are_the_done_parts(tmp_path: Path) -> None:
    state = tmp_path / f"{HEX}.part.json"
    assert partial_pieces(state, 100_000).held == (False,)  # no state: nothing held
    parts = PartState(100_000, 16384)
    parts.done[1] = parts.done[6] = True
    parts.save(state)
    p = partial_pieces(state, 100_000)
    assert p.piece_size == 16384 and p.size == 100_000
    assert p.held == (False, True, False, False, False, False, True)
    assert p.covers(16384, 2 * 16384) and p.covers(6 * 16384, 100_000)
    assert not p.covers(0, 1)


@pytest.mark.timeout(10)
def test_partial_pieces_of_a_state_planted_as_a_fifo_are_none(tmp_path: Path) -> None:
    state = tmp_path / f"{HEX}.part.json"
    os.mkfifo(state)  # a peer's HEAD must not hang the peer server's thread on it
    assert partial_pieces(state, 100_000).held == (False,)
    for content in ('{"part_size": 1e400}', "[" * 100_000):  # OverflowError, RecursionError
        state.unlink()
        state.write_text(content)
        assert partial_pieces(state, 100_000).held == (False,)


def test_a_token_with_bytes_outside_ascii_is_refused_as_a_bad_token() -> None:
    assert refusal("Bearer s\udcffcret", "secret") == "bad_token"
    assert refusal("Bearer secret", "secret") is None


# -- choosing sources -------------------------------------------------------------------------


# -- discovery --------------------------------------------------------------------------------


def test_static_peers_skip_this_node() -> None:
    s = settings(
        listen=("127.0.0.1", 9401),
        static=(("127.0.0.1", 9401), ("127.0.0.1", 9402), ("10.0.0.9", 9401), ("fd00::1", 9)),
    )
    found = Discovery(s, own={"10.0.0.9"}).peers()
    assert found == ["http://127.0.0.1:9402", "http://[fd00::1]:9"]


def test_dns_discovery_refreshes_and_skips_own_addresses(clock: FakeClock) -> None:
    answers = [["10.0.0.2", "10.0.0.1", "10.0.0.2"], ["10.0.0.3"]]
    calls: list[tuple[str, int]] = []

    def resolve(name: str, port: int) -> list[tuple[Any, ...]]:
        calls.append((name, port))
        if not answers:
            raise socket.gaierror("no such name")
        stream = (socket.AF_INET, socket.SOCK_STREAM, 6, "")
        return [(*stream, (ip, port)) for ip in answers.pop(0)]

    s = settings(listen=("0.0.0.0", 9401), service=("weightcache.ns.svc", 9401))
    discovery = Discovery(s, resolve=resolve, clock=clock, own={"10.0.0.1"})
    assert discovery.peers() == ["http://10.0.0.2:9401"]
    assert discovery.peers() == ["http://10.0.0.2:9401"]  # cached
    clock.advance(10)
    assert discovery.peers() == ["http://10.0.0.3:9401"]
    clock.advance(10)
    assert discovery.peers() == ["http://10.0.0.3:9401"]  # lookup failed: keep the last
    assert calls == [("weightcache.ns.svc", 9401)] * 3


def test_a_peer_naming_itself_is_checked_without_a_lookup(clock: FakeClock) -> None:
    """`asked_by` runs on the peer server's event loop: it checks the asker against the
    swarm's last lookup, never resolves the Service itself (a slow DNS would stall every
    upload of the node), and is told of a listed asker only."""
    calls: list[str] = []

    def resolve(name: str, port: int) -> list[tuple[Any, ...]]:
        calls.append(name)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", port))]

    s = settings(listen=("10.0.0.1", 9401), service=("weightcache.ns.svc", 9401))
    peers = NodeSwarm(s, discovery=Discovery(s, resolve=resolve, clock=clock, own={"10.0.0.1"}))
    joined: list[str] = []

    class Download:
        def pieces(self) -> tuple[int, Bitmap, Bitmap, Bitmap]:
            return 1 << 20, Bitmap(1), Bitmap(1), Bitmap(1)

        def streamed(self, piece: int, offset: int, limit: int, at_least: int) -> bytes | None:
            return None

        def joined(self, peer: str) -> None:
            joined.append(peer)

    try:
        peers.advertise(HEX, Download())
        assert peers.discovery.peers() == ["http://10.0.0.2:9401"]  # the swarm's round
        clock.advance(60)  # the lookup is stale now
        peers.asked_by(HEX, "http://10.0.0.2:9401")
        peers.asked_by(HEX, "http://10.0.0.7:9401")
        assert calls == ["weightcache.ns.svc"] and joined == ["http://10.0.0.2:9401"]
    finally:
        peers.close()


def test_peer_url_brackets_v6() -> None:
    assert peer_url("10.0.0.1", 9401) == "http://10.0.0.1:9401"
    assert peer_url("fd00::1", 9401) == "http://[fd00::1]:9401"


# -- the avoid list and claims ----------------------------------------------------------------


class _NoDiscovery(Discovery):
    def __init__(self, peers: list[str]) -> None:
        self._peers = peers

    def peers(self) -> list[str]:
        return self._peers


def test_a_bad_peer_is_avoided_for_a_while(clock: FakeClock) -> None:
    peers = NodeSwarm(settings(), discovery=_NoDiscovery(["http://a", "http://b"]), clock=clock)
    try:
        peers.mark_bad("http://a", "it served wrong bytes")
        assert peers._skipped("http://a") and not peers._skipped("http://b")
        clock.advance(BAD_PEER_SECONDS - 1)
        assert peers._skipped("http://a")
        clock.advance(2)
        assert not peers._skipped("http://a")
    finally:
        peers.close()


def test_every_peer_avoided_is_told_with_its_reason(clock: FakeClock) -> None:
    reasons: list[str] = []
    peers = NodeSwarm(settings(), discovery=_NoDiscovery(["http://a"]), clock=clock,
                  on_bad=reasons.append)  # fmt: skip
    try:
        peers.mark_bad("http://a", "it served wrong bytes")
        peers.failed("http://a")
        assert reasons == ["wrong_bytes", "unreachable"]
        assert set(reasons) <= set(BAD_PEER_REASONS)  # the metric refuses anything else
    finally:
        peers.close()


def test_claims_are_released_only_by_their_owner(tmp_path: Path) -> None:
    peers = NodeSwarm(settings(), discovery=_NoDiscovery([]))
    try:
        first = peers.claim(HEX, tmp_path / "p", 10)
        second = peers.claim(HEX, tmp_path / "p", 10)
        assert first != second
        peers.release(HEX, first)  # a stale owner does not end the newer download
        d = peers.downloading(HEX)
        assert d is not None and d.claim == second and d.size == 10
        peers.release(HEX, second)
        assert peers.downloading(HEX) is None
        assert peers.probe_all(HEX) == {}  # nobody to ask
    finally:
        peers.close()


# -- the swarm's advertisements ---------------------------------------------------------------


def test_piece_size_gives_enough_pieces_within_bounds() -> None:
    from weightcache.swarm.pieces import piece_size_for

    assert piece_size_for(512 << 20) == 4 << 20  # 128 pieces
    assert piece_size_for(256 << 20) == 4 << 20  # 64 pieces
    assert piece_size_for(64 << 20) == 1 << 20  # 64 pieces
    assert piece_size_for(48 << 20) == 1 << 20  # 48 pieces: not below 1 MiB for 64
    assert piece_size_for(16 << 20) == 512 << 10  # 32 pieces
    assert piece_size_for(1000) == 256 << 10  # one piece, never below the minimum
    assert piece_size_for(140 << 30) == 4 << 20  # never above the maximum
    assert piece_size_for(10_000_000) % (64 << 10) == 0


def test_a_view_in_another_piece_size_counts_only_whole_pieces() -> None:
    # theirs: 4 pieces of 100 bytes of a 350-byte blob, 0 and 1 and 3 held; ours: 50 bytes
    theirs = Bitmap.of(4, [0, 1, 3])
    ours = regrid(theirs, 100, 50, 350)
    assert list(ours) == [0, 1, 2, 3, 6]
    assert list(regrid(theirs, 100, 200, 350)) == [0]  # ours 1 = theirs 2 + 3: not whole


def test_parse_view_reads_held_fetching_and_load() -> None:
    held, fetching = Bitmap.of(10, [1, 2]), Bitmap.of(10, [5, 6])
    headers = {PIECES: held.encode(), PIECE_SIZE: "4096", FETCHING: fetching.encode(),
               LOAD: "3"}  # fmt: skip
    view = parse_view("http://a", headers, 10 * 4096 - 1, 4096)
    assert (view.have, view.fetching, view.load, view.streaming) == (held, fetching, 3, None)
    streamed = {**headers, STREAMING: Bitmap.of(10, [6]).encode()}
    assert (
        parse_view("http://a", streamed, 10 * 4096 - 1, 4096).offers() == 0b1000110
    )  # 1, 2 held; 6 streamed
    # in another piece size, what is streamed is not offered (nor what is in flight)
    assert parse_view("http://a", streamed, 10 * 4096 - 1, 8192).streaming is None
    complete = parse_view("http://a", {PIECES: "all"}, 10 * 4096, 4096)
    assert complete.have.complete and not complete.fetching
    assert not parse_view("http://a", {}, 10 * 4096, 4096).have  # a 404 advertises nothing
    with pytest.raises(ValueError):
        parse_view("http://a", {PIECES: "!!", PIECE_SIZE: "4096"}, 10 * 4096, 4096)


@pytest.mark.parametrize("bad", [{LOAD: "-1"}, {LOAD: "x"}, {LOAD: "9" * 5000},
                                 {PIECE_SIZE: "1"}, {PIECE_SIZE: "4k"}, {STREAMING: "AQ"},
                                 {STREAMING: Bitmap.of(11, [10]).encode()}])  # fmt: skip
def test_parse_view_refuses_a_hostile_advertisement(bad: dict[str, str]) -> None:
    """Every field of a peer's advertisement is checked: a negative or absurd load, a
    piece size that is not a number or too small is a bad answer (ValueError), never a
    view the choice would act on."""
    headers = {PIECES: Bitmap.of(10, [1]).encode(), PIECE_SIZE: "4096", **bad}
    with pytest.raises(ValueError):
        parse_view("http://a", headers, 10 * 4096, 4096)


# -- probes keep one connection per peer -------------------------------------------------------


class _CountingServer(http.server.ThreadingHTTPServer):
    """An HTTP/1.1 server that answers every HEAD 404 and counts its connections."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Head404)
        self.connections: list[socket.socket] = []

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.append(request)
        super().process_request(request, client_address)


class _Head404(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def head_server() -> Iterator[_CountingServer]:
    server = _CountingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_probes_reuse_one_connection_per_peer(head_server: _CountingServer) -> None:
    peer = peer_url(*head_server.server_address[:2])  # type: ignore[misc]
    peers = NodeSwarm(settings(), discovery=_NoDiscovery([peer]))
    try:
        for _ in range(3):
            answer = peers.probe_all("ab" * 32)[peer]
            assert answer is not None and answer[0] == 404
        assert len(head_server.connections) == 1
        # The peer closes the idle connection (its idle timeout): the next probe still
        # answers, on a new connection.
        head_server.connections[0].shutdown(socket.SHUT_RDWR)
        assert peers.probe(peer, "ab" * 32) is not None
        assert len(head_server.connections) == 2
    finally:
        peers.close()


def test_a_probe_round_within_a_view_asks_only_those_peers(head_server: _CountingServer) -> None:
    peer = peer_url(*head_server.server_address[:2])  # type: ignore[misc]
    other = peer_url("127.0.0.1", 9)  # discovered, not in the view: never asked
    peers = NodeSwarm(settings(), discovery=_NoDiscovery([peer, other]))
    try:
        answers = peers.probe_all("ab" * 32, within=frozenset([peer]))
        assert list(answers) == [peer] and answers[peer] is not None
    finally:
        peers.close()
