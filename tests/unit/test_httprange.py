"""Reading ranged GETs' bodies (transfer/httprange.py) from a small local server: a body
that trickles in is read in few large reads, not one per packet, and a kept connection's
next response is not held back by the previous body's read size."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from weightcache.transfer.httprange import HttpRanges

SLOW = 1 << 20  # bytes of /slow, sent 2 KiB every 2 ms (about 1 MB/s)
FAST = 200 << 10  # bytes of /fast, sent at once
TAIL = 20_000  # bytes of /tail, sent at once: past what one fill of the reader's buffer holds


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/tiny":
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"tiny\n")
            return
        size = {"/slow": SLOW, "/tail": TAIL}.get(self.path, FAST)
        self.send_response(206)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Range", f"bytes 0-{size - 1}/{size}")
        self.end_headers()
        if self.path != "/slow":
            self.wfile.write(b"x" * size)
            return
        for _ in range(size // 2048):
            self.wfile.write(b"x" * 2048)
            self.wfile.flush()
            time.sleep(0.002)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def read_all(ranges: HttpRanges, url: str, size: int, timeout: float = 10.0) -> int:
    """Read one whole body; return how many reads it took."""
    buf, got, reads = memoryview(bytearray(size)), 0, 0
    with ranges.get(url, {}, 0, size, size, timeout, url) as reader:
        while got < size:
            n = reader.readinto(buf[got:])
            assert n, "the body ended early"
            got, reads = got + n, reads + 1
    return reads


def test_a_trickling_body_is_read_in_few_reads(server: str) -> None:
    # Without the low-water mark every read wakes for the 2 KiB just sent: ~500 reads.
    assert read_all(HttpRanges(), f"{server}/slow", SLOW) < 100


def test_the_next_response_on_a_kept_connection_is_not_held_back(server: str) -> None:
    """The previous body's last reads waited for up to what was left of it; the next
    response on the connection, head and body smaller than that, must not wait for that
    many bytes (until the timeout)."""
    ranges = HttpRanges()
    read_all(ranges, f"{server}/slow", SLOW, timeout=2.0)
    began = time.monotonic()
    resp, body = ranges.request("GET", f"{server}/tiny", {}, 2.0, "AWS_CA_BUNDLE")
    assert (resp.status, body) == (200, b"tiny\n")
    read_all(ranges, f"{server}/fast", FAST, timeout=2.0)
    assert time.monotonic() - began < 1.5


def test_a_body_partly_buffered_is_not_waited_for_past_its_end(server: str) -> None:
    """The reader's buffer holds part of the body (a small read came first): the socket's
    low-water mark must not ask for more than the socket will still bring, or the read
    waits out the timeout (a 30 s stall at the end of a resumed part)."""
    ranges = HttpRanges()
    buf = memoryview(bytearray(TAIL))
    began = time.monotonic()
    with ranges.get(f"{server}/tail", {}, 0, TAIL, TAIL, 2.0, "tail") as reader:
        got = reader.readinto(buf[:4000])  # from the bytes read in with the head
        while got < TAIL:
            n = reader.readinto(buf[got:])
            assert n, "the body ended early"
            got += n
    assert time.monotonic() - began < 1.5
