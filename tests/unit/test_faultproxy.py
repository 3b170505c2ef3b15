"""The fault proxy used by the integration tests, against a tiny local HTTP/1.1 origin."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.etree import ElementTree

import pytest

from tests.support.faultproxy import SLOWDOWN_BODY, FaultProxy, Faults

BLOB = bytes(range(256)) * 4096  # 1 MiB, every byte position recognisable
KEY = "/models/m/rev/model-00001-of-00001.safetensors"
MANIFEST_KEY = "/models/m/rev/SHA256SUMS"


class _Origin(BaseHTTPRequestHandler):
    """GET/HEAD with Range for the objects, PUT stores, /echo returns the request."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    objects: dict[str, bytes]
    seen: list[tuple[str, str, list[tuple[str, str]]]]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _record(self) -> None:
        self.seen.append((self.command, self.path, list(self.headers.items())))

    def do_GET(self) -> None:
        self._record()
        if self.path.startswith("/echo"):
            body = json.dumps({"path": self.path, "headers": list(self.headers.items())})
            return self._reply(200, body.encode())
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return None
        data = self.objects.get(self.path.partition("?")[0])
        if data is None:
            return self._reply(404, b"<Error><Code>NoSuchKey</Code></Error>")
        rng = self.headers.get("Range")
        if rng:
            start_s, _, end_s = rng.removeprefix("bytes=").partition("-")
            start, end = int(start_s), min(int(end_s or len(data) - 1), len(data) - 1)
            extra = {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
            return self._reply(206, data[start : end + 1], extra)
        return self._reply(200, data)

    def do_HEAD(self) -> None:
        self._record()
        data = self.objects.get(self.path, b"")
        self.send_response(200 if self.path in self.objects else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()

    def do_PUT(self) -> None:
        self._record()
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = b""
            while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
        else:
            body = self.rfile.read(int(self.headers["Content-Length"]))
        self.objects[self.path] = body
        self._reply(200, b"")

    def _reply(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients hung up on purpose: the proxy injected a fault


@pytest.fixture
def origin() -> Iterator[tuple[str, type[_Origin]]]:
    handler = type("Origin", (_Origin,), {"objects": {KEY: BLOB, MANIFEST_KEY: b"x" * 100},
                                          "seen": []})  # fmt: skip
    server = _QuietServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(origin: tuple[str, type[_Origin]]) -> Iterator[FaultProxy]:
    with FaultProxy(origin[0], seed=1) as p:
        yield p


def _conn(proxy: FaultProxy, timeout: float = 5) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)


def _get(conn: http.client.HTTPConnection, path: str, rng: str | None = None):  # type: ignore[no-untyped-def]
    conn.request("GET", path, headers={"Range": rng} if rng else {})
    return conn.getresponse()


def test_forwards_full_and_ranged_gets_on_one_keepalive_connection(proxy: FaultProxy) -> None:
    conn = _conn(proxy)
    r = _get(conn, KEY)
    assert (r.status, r.read()) == (200, BLOB)
    r = _get(conn, KEY, "bytes=1000-1999")
    assert r.status == 206
    assert r.getheader("Content-Range") == f"bytes 1000-1999/{len(BLOB)}"
    assert r.read() == BLOB[1000:2000]
    sock = conn.sock
    r = _get(conn, "/models/nope")
    assert (r.status, r.read()) == (404, b"<Error><Code>NoSuchKey</Code></Error>")
    assert conn.sock is sock, "keep-alive connection was not reused"
    s = proxy.stats()
    assert (s.requests, s.gets, s.ranged_gets) == (3, 3, 1)
    assert s.body_bytes == len(BLOB) + 1000 + len(b"<Error><Code>NoSuchKey</Code></Error>")
    assert s.bytes_for("safetensors") == len(BLOB) + 1000
    assert s.requests_for("safetensors") == 2
    assert s.faults == {}


def test_forwards_host_and_every_header_unchanged(proxy: FaultProxy) -> None:
    conn = _conn(proxy)
    conn.putrequest("GET", "/echo?x-id=GetObject&a=%2F", skip_host=True,
                    skip_accept_encoding=True)  # fmt: skip
    sent = [
        ("Host", f"127.0.0.1:{proxy.port}"),
        ("X-Amz-Date", "20260101T000000Z"),
        ("authorization", "AWS4-HMAC-SHA256 Credential=x, SignedHeaders=host, Signature=y"),
        ("X-Dup", "1"),
        ("X-Dup", "2"),
    ]
    for k, v in sent:
        conn.putheader(k, v)
    conn.endheaders()
    echoed = json.loads(conn.getresponse().read())
    assert echoed["path"] == "/echo?x-id=GetObject&a=%2F"
    assert [tuple(h) for h in echoed["headers"]] == sent


@pytest.mark.parametrize("chunked", [False, True])
def test_forwards_request_bodies(
    proxy: FaultProxy, origin: tuple[str, type[_Origin]], chunked: bool
) -> None:
    conn = _conn(proxy)
    body = b"payload" * 20000
    if chunked:
        conn.request("PUT", "/models/up", body=iter([body[:1000], body[1000:]]),
                     headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)  # fmt: skip
    else:
        conn.request("PUT", "/models/up", body=body, headers={"Expect": "100-continue"})
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b"")
    assert origin[1].objects["/models/up"] == body
    r = _get(conn, KEY, "bytes=0-9")  # the connection is still usable
    assert r.read() == BLOB[:10]


def test_relays_chunked_responses_and_head(proxy: FaultProxy) -> None:
    conn = _conn(proxy)
    r = _get(conn, "/chunked")
    assert (r.status, r.read()) == (200, b"hello chunked world")
    conn.request("HEAD", KEY)
    r = conn.getresponse()
    assert (r.status, r.getheader("Content-Length"), r.read()) == (200, str(len(BLOB)), b"")
    assert _get(conn, KEY, "bytes=0-3").read() == BLOB[:4]


def test_slowdown_answers_503_without_asking_the_origin(
    proxy: FaultProxy, origin: tuple[str, type[_Origin]]
) -> None:
    proxy.configure(slowdown_rate=1.0)
    conn = _conn(proxy)
    r = _get(conn, KEY, "bytes=0-99")
    assert r.status == 503
    body = r.read()
    assert body == SLOWDOWN_BODY
    # What an S3 client keys its throttling on: the error code in the XML it received.
    assert r.getheader("Content-Type") == "application/xml"
    assert ElementTree.fromstring(body).findtext("Code") == "SlowDown"
    assert origin[1].seen == []
    r = _get(conn, KEY)  # not ranged: outside the default scope
    assert (r.status, len(r.read())) == (200, len(BLOB))
    assert proxy.stats().faults == {"slowdown": 1}


def test_reset_sends_part_then_rst(proxy: FaultProxy) -> None:
    proxy.configure(reset_rate=1.0)
    got = b""
    with pytest.raises((ConnectionResetError, http.client.IncompleteRead)):
        r = _get(_conn(proxy), KEY, "bytes=0-")
        assert r.status == 206
        while chunk := r.read(4096):
            got += chunk
    assert len(got) < len(BLOB)
    assert BLOB.startswith(got)
    assert proxy.stats().faults == {"reset": 1}


def test_truncate_announces_full_length_then_closes(proxy: FaultProxy) -> None:
    proxy.configure(truncate_rate=1.0)
    r = _get(_conn(proxy), KEY, "bytes=0-")
    assert r.getheader("Content-Length") == str(len(BLOB))
    with pytest.raises(http.client.IncompleteRead) as exc:
        r.read()
    assert len(exc.value.partial) < len(BLOB)
    assert BLOB.startswith(exc.value.partial)
    assert proxy.stats().body_bytes == len(exc.value.partial)


def test_corrupt_flips_exactly_one_byte(proxy: FaultProxy) -> None:
    proxy.configure(corrupt_rate=1.0)
    body = _get(_conn(proxy), KEY, "bytes=0-").read()
    assert len(body) == len(BLOB)
    assert sum(a != b for a, b in zip(body, BLOB, strict=True)) == 1


def test_data_scope_spares_manifest_and_listings(proxy: FaultProxy) -> None:
    proxy.configure(corrupt_rate=1.0, scope="data")
    conn = _conn(proxy)
    assert _get(conn, MANIFEST_KEY).read() == b"x" * 100
    assert _get(conn, "/echo?list-type=2&prefix=m/").read().startswith(b"{")
    assert _get(conn, KEY).read() != BLOB
    assert proxy.stats().faults == {"corrupt": 1}


def test_script_runs_first_and_max_consecutive_caps_faults(proxy: FaultProxy) -> None:
    proxy.configure(script=("none", "slowdown", "truncate"), slowdown_rate=1.0,
                    max_consecutive=2)  # fmt: skip
    statuses = []
    for _ in range(6):
        conn = _conn(proxy)
        r = _get(conn, KEY, "bytes=0-99")
        try:
            statuses.append((r.status, len(r.read())))
        except http.client.IncompleteRead:
            statuses.append((r.status, -1))
    # The script as written, then random slowdowns, at most two in a row.
    slow = (503, len(SLOWDOWN_BODY))
    assert statuses == [(206, 100), slow, (206, -1), slow, slow, (206, 100)]


def test_random_decisions_follow_the_rates(proxy: FaultProxy) -> None:
    proxy.configure(slowdown_rate=0.3)
    conn = _conn(proxy)
    n503 = 0
    for _ in range(200):
        r = _get(conn, KEY, "bytes=0-9")
        r.read()
        n503 += r.status == 503
    assert 35 <= n503 <= 85
    assert proxy.stats().faults == {"slowdown": n503}


def test_down_modes_and_recovery_on_the_same_port(proxy: FaultProxy) -> None:
    port = proxy.port
    conn = _conn(proxy)
    assert _get(conn, KEY, "bytes=0-0").read() == BLOB[:1]

    proxy.set_down("refuse")
    with pytest.raises(ConnectionRefusedError):
        _get(_conn(proxy), KEY)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _get(conn, KEY)  # the keep-alive connection was closed too

    proxy.set_down("reset")
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _get(_conn(proxy), KEY)

    proxy.set_down("hang")
    accepted = proxy.stats(settle=0).connections
    with pytest.raises(TimeoutError):
        _get(_conn(proxy, timeout=0.5), KEY)
    assert proxy.stats(settle=0).connections == accepted + 1  # counted though never answered

    proxy.set_down(None)
    assert proxy.port == port
    assert _get(_conn(proxy), KEY, "bytes=5-6").read() == BLOB[5:7]


def test_stall_goes_silent_mid_body(proxy: FaultProxy) -> None:
    proxy.configure(stall_rate=1.0)
    r = _get(_conn(proxy, timeout=0.5), KEY, "bytes=0-")
    assert r.status == 206
    with pytest.raises(TimeoutError):
        r.read()


def test_latency_and_rate_limit(proxy: FaultProxy) -> None:
    proxy.configure(latency=0.3)
    t0 = time.monotonic()
    _get(_conn(proxy), KEY, "bytes=0-0").read()
    assert time.monotonic() - t0 >= 0.3
    proxy.configure(latency=0.0, rate_limit=2 * 1024 * 1024)
    t0 = time.monotonic()
    assert _get(_conn(proxy), KEY).read() == BLOB
    assert 0.4 <= time.monotonic() - t0 <= 3


def test_wait_idle_and_reset_stats(proxy: FaultProxy) -> None:
    proxy.configure(rate_limit=1024 * 1024)
    t = threading.Thread(target=lambda: _get(_conn(proxy), KEY).read())
    t.start()
    time.sleep(0.2)
    assert not proxy.wait_idle(timeout=0.1)
    assert proxy.wait_idle(timeout=5)
    t.join()
    assert proxy.stats().body_bytes == len(BLOB)
    proxy.reset_stats()
    assert proxy.stats().requests == 0


def test_origin_down_looks_like_a_dead_store() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with (
        FaultProxy(f"http://127.0.0.1:{dead}") as p,
        pytest.raises((ConnectionError, http.client.RemoteDisconnected)),
    ):
        _get(_conn(p), KEY)


def test_rejects_bad_configuration(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError):
        proxy.configure(slowdown_rate=0.7, reset_rate=0.4)
    with pytest.raises(ValueError):
        proxy.configure(scope="everything")
    with pytest.raises(ValueError):
        proxy.configure(Faults(script=("explode",)))
    with pytest.raises(ValueError):
        proxy.set_down("sideways")


def test_concurrency_timeline_counts_ranged_gets_in_progress(proxy: FaultProxy) -> None:
    proxy.configure(latency=0.3)

    def one() -> None:
        _get(_conn(proxy), KEY, "bytes=0-9").read()

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _get(_conn(proxy), KEY).read()  # not ranged: not in the timeline
    timeline = proxy.concurrency()
    assert [n for _, n in timeline] == [1, 2, 3, 2, 1, 0]
    assert [t for t, _ in timeline] == sorted(t for t, _ in timeline)
    proxy.reset_stats()
    assert proxy.concurrency() == []


def test_trickle_sends_eligible_bodies_a_piece_at_a_time(proxy: FaultProxy) -> None:
    """10 B/s: one byte every 0.1s, so a 0.5s socket timeout never fires, yet 10 bytes
    take about a second; the manifest (outside the "data" scope) is not slowed."""
    proxy.configure(scope="data", trickle_rate=10)
    r = _get(_conn(proxy, timeout=0.5), KEY, "bytes=0-9")
    t0 = time.monotonic()
    pieces = []
    while piece := r.read1(10):
        pieces.append(piece)
    assert b"".join(pieces) == BLOB[:10]
    assert len(pieces) >= 5, pieces  # arrived in pieces, not as one body
    assert 0.7 <= time.monotonic() - t0 <= 5
    t0 = time.monotonic()
    assert _get(_conn(proxy), MANIFEST_KEY).read() == b"x" * 100
    assert time.monotonic() - t0 < 3  # trickled, its 100 bytes would take 10 s
    with pytest.raises(ValueError):
        proxy.configure(trickle_rate=0)


def test_lifting_the_trickle_sends_the_rest_of_a_body_in_flight_at_once(proxy: FaultProxy) -> None:
    """100 bytes at 10 B/s would take 10 s; lifted after the first bytes, the rest comes
    at once (a test that lets slowed fetches finish need not wait for their bodies)."""
    proxy.configure(scope="data", trickle_rate=10)
    r = _get(_conn(proxy, timeout=5), KEY, "bytes=0-99")
    first = r.read1(100)
    assert 0 < len(first) < 100
    t0 = time.monotonic()
    proxy.configure(trickle_rate=None)
    assert first + r.read() == BLOB[:100]
    assert time.monotonic() - t0 < 3
