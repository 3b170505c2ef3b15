"""Reading ranged GETs' bodies (transfer/httpclient.py) from a small local server: a body
that trickles in is read in few large reads, not one per packet, and a kept connection's
next response is not held back by the previous body's read size. And how S3Revision asks
for the part sizes of composite checksums, with an Origin that counts the calls."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from weightcache.errors import TransientError
from weightcache.transfer.backends.s3.revision import S3Revision
from weightcache.transfer.httpclient import HttpRanges

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
    read_all(ranges, f"{server}/slow", SLOW, timeout=5.0)
    began = time.monotonic()
    resp, body = ranges.request("GET", f"{server}/tiny", {}, 5.0, "AWS_CA_BUNDLE")
    assert (resp.status, body) == (200, b"tiny\n")
    read_all(ranges, f"{server}/fast", FAST, timeout=5.0)
    assert time.monotonic() - began < 4.0  # held back: a 5 s timeout waited out


def test_a_body_partly_buffered_is_not_waited_for_past_its_end(server: str) -> None:
    """The reader's buffer holds part of the body (a small read came first): the socket's
    low-water mark must not ask for more than the socket will still bring, or the read
    waits out the timeout (a 30 s stall at the end of a resumed part)."""
    ranges = HttpRanges()
    buf = memoryview(bytearray(TAIL))
    began = time.monotonic()
    with ranges.get(f"{server}/tail", {}, 0, TAIL, TAIL, 5.0, "tail") as reader:
        got = reader.readinto(buf[:4000])  # from the bytes read in with the head
        while got < TAIL:
            n = reader.readinto(buf[got:])
            assert n, "the body ended early"
            got += n
    assert time.monotonic() - began < 4.0  # waited for more: the 5 s timeout


def test_a_range_left_unread_does_not_spoil_the_next_one(server: str) -> None:
    """A reader that stops before its range's end (the rest is read elsewhere) leaves a
    body on the connection: it is not kept, or the next GET on it fails (ResponseNotReady)."""
    ranges = HttpRanges()
    with ranges.get(f"{server}/fast", {}, 0, FAST, FAST, 5.0, "fast") as reader:
        assert reader.readinto(memoryview(bytearray(1000)))
    assert read_all(ranges, f"{server}/fast", FAST, timeout=5.0)


PART = 5 << 20


class _PartsOrigin:
    """The calls `S3Revision.vouches` makes of an Origin: one object "w.bin" whose COMPOSITE
    crc32c has `parts` parts, GetObjectAttributes refused, each HeadObject PartNumber
    answered after 10 ms (failing for good from part `fail_from` on)."""

    def __init__(self, parts: int, fail_from: int | None = None) -> None:
        self.parts, self.fail_from = parts, fail_from
        self.lock = threading.Lock()
        self.inflight = self.peak = self.asked = 0

    def list_sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        return {"w.bin": self.parts * PART}

    def head_checksums(self, bucket: str, key: str) -> dict[str, str]:
        return {"ChecksumCRC32C": f"aZDu2w==-{self.parts}", "ChecksumType": "COMPOSITE"}

    def listed_part_sizes(self, bucket: str, key: str, count: int) -> None:
        return None

    def part_size(self, bucket: str, key: str, number: int) -> int:
        with self.lock:
            self.asked += 1
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        time.sleep(0.01)
        with self.lock:
            self.inflight -= 1
        if self.fail_from is not None and number >= self.fail_from:
            raise TransientError(f"HEAD part {number}: SlowDown (attempt 6/6)")
        return PART


def test_the_part_heads_of_a_composite_object_run_at_once() -> None:
    origin = _PartsOrigin(parts=64)
    vouches = S3Revision(HttpRanges(), origin, "models", "m/r1").vouches()  # type: ignore[arg-type]
    assert vouches["w.bin"].parts == (PART,) * 64
    assert origin.asked == 64 and origin.peak >= 4, (origin.asked, origin.peak)


def test_a_part_head_failing_for_good_sends_no_more() -> None:
    """The fetch fails (exit 6) without sending the thousands of HEADs queued behind
    (Executor.map cancels what is still queued once a result raises)."""
    origin = _PartsOrigin(parts=2000, fail_from=2)
    revision = S3Revision(HttpRanges(), origin, "models", "m/r1")  # type: ignore[arg-type]
    with pytest.raises(TransientError, match="HEAD part"):
        revision.vouches()
    assert origin.asked < 200, origin.asked
