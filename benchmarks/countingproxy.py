"""A counting HTTP reverse proxy in front of the object store (stdlib, threads).

Everything a client sends is forwarded unchanged, the Host header included (S3 SigV4 signs
the host, so the client signs for the proxy's address and the store checks that same
header); only hop-by-hop headers are re-framed. Bodies are streamed both ways, never
buffered whole. The proxy counts what leaves the store: response body bytes, requests per
method and status, and GETs in flight (with their exact peak). `Sampler` records the
in-flight count every 50 ms for plots.

    proxy = CountingProxy("http://127.0.0.1:8333").start()
    ... clients use proxy.url as their endpoint ...
    proxy.snapshot(); proxy.stop()

Run alone for manual checks: `python benchmarks/countingproxy.py UPSTREAM_URL [PORT]`.
"""

from __future__ import annotations

import contextlib
import http.client
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade",
    )
)  # fmt: skip
BUFFER = 1 << 20


@dataclass
class Counters:
    """Totals since the last reset; guarded by the proxy's lock."""

    body_bytes_out: int = 0  # response bodies sent to clients: bytes leaving the store
    body_bytes_in: int = 0  # request bodies sent to the store
    requests: Counter[str] = field(default_factory=Counter)  # by method
    statuses: Counter[int] = field(default_factory=Counter)
    get_inflight: int = 0
    get_inflight_peak: int = 0
    errors: int = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive to the client, like the store itself
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _forward(self) -> None:
        proxy = self.server.proxy
        is_get = self.command == "GET"
        proxy._begin(self.command)
        self._answered = False
        try:
            for attempt in (1, 2):
                reused = self.upstream is not None
                try:
                    self._relay(proxy)
                    return
                except (OSError, http.client.HTTPException):
                    if self.upstream is not None:
                        self.upstream.close()
                        self.upstream = None
                    # A kept-alive upstream connection the store closed while idle: replay a
                    # bodiless request once on a new one. Anything else ends this connection.
                    bodiless = not self.headers.get("Content-Length", "0").strip("0")
                    bodiless = bodiless and "Transfer-Encoding" not in self.headers
                    if attempt == 1 and reused and bodiless and not self._answered:
                        continue
                    proxy._count_error()
                    self.close_connection = True
                    if not self._answered:
                        with contextlib.suppress(OSError):  # the client may be gone too
                            self.send_error(502, "upstream failed")
                    return
        finally:
            proxy._end(is_get)

    def _relay(self, proxy: CountingProxy) -> None:
        if self.upstream is None:
            self.upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port)
        up = self.upstream
        up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in HOP_BY_HOP:
                up.putheader(name, value)
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if chunked:
            up.putheader("Transfer-Encoding", "chunked")
        up.endheaders()
        if chunked:
            self._relay_chunked_request(up, proxy)
        else:
            self._relay_request_body(up, int(self.headers.get("Content-Length") or 0), proxy)
        resp = up.getresponse()
        proxy._count_status(resp.status)
        self._answered = True
        self.send_response_only(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        for name, value in resp.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        body_expected = self.command != "HEAD" and resp.status not in (204, 304)
        rechunk = body_expected and length is None
        if rechunk:
            self.send_header("Transfer-Encoding", "chunked")
        if resp.will_close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self._relay_response_body(resp, rechunk, proxy)
        if resp.will_close:
            up.close()
            self.upstream = None

    def _relay_request_body(
        self, up: http.client.HTTPConnection, left: int, proxy: CountingProxy
    ) -> None:
        while left > 0:
            data = self.rfile.read(min(BUFFER, left))
            if not data:
                raise ConnectionError("client closed during the request body")
            up.send(data)
            left -= len(data)
            proxy._count_in(len(data))

    def _relay_chunked_request(self, up: http.client.HTTPConnection, proxy: CountingProxy) -> None:
        while True:
            size_line = self.rfile.readline(65537)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            data = self.rfile.read(size + 2) if size else b""
            up.send(size_line + data)
            proxy._count_in(size)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = self.rfile.readline(65537)
                    up.send(line)
                    if line in (b"\r\n", b"\n", b""):
                        return

    def _relay_response_body(
        self, resp: http.client.HTTPResponse, rechunk: bool, proxy: CountingProxy
    ) -> None:
        buf = bytearray(BUFFER)
        view = memoryview(buf)
        while True:
            n = resp.readinto(buf)
            if not n:
                break
            if rechunk:
                self.wfile.write(b"%x\r\n" % n)
            self.wfile.write(view[:n])
            if rechunk:
                self.wfile.write(b"\r\n")
            proxy._count_out(n)
        if rechunk:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = _forward


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    proxy: CountingProxy


class CountingProxy:
    """A reverse proxy to `upstream_url` on 127.0.0.1; use as a context manager or start/stop."""

    def __init__(self, upstream_url: str, port: int = 0) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream_url!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self._lock = threading.Lock()
        self.counters = Counters()
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.proxy = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> CountingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self) -> None:
        """Zero the totals (in-flight requests keep being tracked)."""
        with self._lock:
            inflight = self.counters.get_inflight
            self.counters = Counters(get_inflight=inflight, get_inflight_peak=inflight)

    def snapshot(self) -> Counters:
        """A copy of the totals, consistent at one instant."""
        with self._lock:
            c = self.counters
            return replace(c, requests=Counter(c.requests), statuses=Counter(c.statuses))

    def get_inflight(self) -> int:
        return self.counters.get_inflight  # one int read; no lock needed for sampling

    # -- called by handler threads
    def _begin(self, method: str) -> None:
        with self._lock:
            self.counters.requests[method] += 1
            if method == "GET":
                self.counters.get_inflight += 1
                self.counters.get_inflight_peak = max(
                    self.counters.get_inflight_peak, self.counters.get_inflight
                )

    def _end(self, was_get: bool) -> None:
        if was_get:
            with self._lock:
                self.counters.get_inflight -= 1

    def _count_out(self, n: int) -> None:
        with self._lock:
            self.counters.body_bytes_out += n

    def _count_in(self, n: int) -> None:
        with self._lock:
            self.counters.body_bytes_in += n

    def _count_status(self, status: int) -> None:
        with self._lock:
            self.counters.statuses[status] += 1

    def _count_error(self) -> None:
        with self._lock:
            self.counters.errors += 1


class Sampler:
    """Every `interval` seconds, record (t, GETs in flight, *extra()) until stopped."""

    def __init__(
        self,
        proxy: CountingProxy,
        extra: Callable[[], tuple[float, ...]] = tuple,
        interval: float = 0.05,
    ) -> None:
        self.proxy, self.extra, self.interval = proxy, extra, interval
        self.samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = 0.0

    def start(self, t0: float | None = None) -> Sampler:
        self.t0 = time.perf_counter() if t0 is None else t0
        self._thread.start()
        return self

    def _run(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            self.samples.append((now - self.t0, self.proxy.get_inflight(), *self.extra()))
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.perf_counter()))

    def stop(self) -> list[tuple[float, ...]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    with CountingProxy(sys.argv[1], port) as proxy:
        print(proxy.url, flush=True)
        try:
            while True:
                time.sleep(5)
                print(proxy.snapshot(), flush=True)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
