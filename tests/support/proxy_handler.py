"""The per-connection half of the fault proxy: parse a request, forward it, relay the
response, and break it when the proxy says so. See `faultproxy` for the behaviour."""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from tests.support.faultproxy import FaultProxy

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>faultproxy</RequestId></Error>"
)
_SLOWDOWN = ("503 Slow Down", SLOWDOWN_BODY)
_NOT_IMPLEMENTED = (
    "501 Not Implemented",
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>NotImplemented</Code><Message>A header you provided implies "
    b"functionality that is not implemented.</Message><RequestId>faultproxy</RequestId></Error>",
)
_CHUNK = 64 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class ProxyHandler(BaseHTTPRequestHandler):
    """Forwards each request on one client connection; see the module docstring."""

    protocol_version = "HTTP/1.1"
    timeout = 300
    server: Any
    trickle: float | None = None  # bytes/s of this response's body (Faults.trickle_rate)
    slow = False  # this response is a scripted "slow" one (Faults.slow_rate)

    def __init__(self, request: socket.socket, client_address: Any, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.upstream: http.client.HTTPConnection | None = None
        super().__init__(request, client_address, proxy)  # type: ignore[arg-type]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self._close_upstream()

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except Exception:  # a broken client or store ends this connection, not the proxy
            self.close_connection = True

    def __getattr__(self, name: str) -> Any:
        # Every method (GET, PUT, HEAD, DELETE, POST, ...) is forwarded the same way.
        if name.startswith("do_"):
            return self._forward
        raise AttributeError(name)

    # --- one request ---------------------------------------------------------------------

    def _forward(self) -> None:
        proxy = self.proxy
        if proxy.down is not None:
            self._abort(reset=True)
            return
        path = unquote(self.path.partition("?")[0])
        has_range = "Range" in self.headers
        proxy._begin(self.command, path, has_range)
        try:
            self._forward_counted(path, has_range)
        finally:
            proxy._end(self.command, has_range)

    def _forward_counted(self, path: str, has_range: bool) -> None:
        proxy = self.proxy
        fault = None
        self.trickle, self.slow = None, False
        if self.command == "HEAD" and proxy.faults.head_latency > 0:
            time.sleep(proxy.faults.head_latency)
        if proxy.eligible(self.command, self.path, has_range):
            faults = proxy.faults
            if faults.latency > 0:
                time.sleep(faults.latency)
            fault = proxy._decide(path)
            self.trickle = faults.trickle_rate
            if fault == "slow":  # this response only, not lifted with the trickle
                fault, self.trickle, self.slow = None, faults.slow_rate, True
                proxy._count_fault("slow")
        answer = _NOT_IMPLEMENTED if proxy.unsupported(self.path) else None
        answer = _SLOWDOWN if fault == "slowdown" else answer
        if answer is not None:
            self._drain_request_body()
            proxy._count_fault("slowdown" if fault == "slowdown" else "unsupported")
            self._send_error(*answer)
            return
        try:
            response = self._send_upstream()
        except (OSError, http.client.HTTPException):
            # The store is unreachable: look like it to the client.
            self._abort(reset=True)
            return
        self._relay(response, path, fault)

    def _send_upstream(self) -> http.client.HTTPResponse:
        framing = self._request_body_framing()
        reused = self.upstream is not None
        if reused and framing is not None:
            # A request with a body can't be replayed, so it never rides on a connection
            # the store may have closed while it was idle.
            self._close_upstream()
            reused = False
        while True:
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(
                    self.proxy.upstream_host, self.proxy.upstream_port, timeout=120
                )
            conn = self.upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True,
                                skip_accept_encoding=True)  # fmt: skip
                for name, value in self.headers.items():
                    conn.putheader(name, value)
                conn.endheaders()
                if framing is not None:
                    self._copy_request_body(conn, framing)
                return conn.getresponse()
            except ConnectionError:
                self._close_upstream()
                if not reused:
                    raise
                reused = False  # the idle connection was stale: once more on a new one

    def _close_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    def _request_body_framing(self) -> str | int | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return "chunked"
        length = int(self.headers.get("Content-Length", "0") or 0)
        return length if length > 0 else None

    def _copy_request_body(self, conn: http.client.HTTPConnection, framing: str | int) -> None:
        if framing == "chunked":
            # Relay the chunked framing as is, line by line.
            while True:
                size_line = self.rfile.readline(65537)
                conn.send(size_line)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        line = self.rfile.readline(65537)
                        conn.send(line)
                        if line in (b"\r\n", b"\n", b""):
                            return
                self._copy_exact(size + 2, conn.send)
        else:
            assert isinstance(framing, int)
            self._copy_exact(framing, conn.send)

    def _copy_exact(self, n: int, send: Any) -> None:
        while n > 0:
            chunk = self.rfile.read(min(_CHUNK, n))
            if not chunk:
                raise ConnectionError("client closed during the request body")
            send(chunk)
            n -= len(chunk)

    def _drain_request_body(self) -> None:
        framing = self._request_body_framing()
        if framing is not None:

            class _Null:
                def send(self, data: bytes) -> None:
                    pass

            self._copy_request_body(_Null(), framing)  # type: ignore[arg-type]

    # --- responses -----------------------------------------------------------------------

    def _send_error(self, status: str, body: bytes) -> None:
        head = (
            f"HTTP/1.1 {status}\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n"
            "x-amz-request-id: faultproxy\r\n"
            "\r\n"
        ).encode()
        self.wfile.write(head + (body if self.command != "HEAD" else b""))
        if self.headers.get("Connection", "").lower() == "close":
            self.close_connection = True

    def _relay(self, resp: http.client.HTTPResponse, path: str, fault: str | None) -> None:
        head = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode("latin-1")]
        for name, value in resp.msg.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        self.wfile.write(b"".join(head))

        if resp.will_close:
            self.close_connection = True
        if self.command == "HEAD" or resp.status in _NO_BODY_STATUSES or resp.status < 200:
            resp.close()
            return
        if fault is not None and (resp.status not in (200, 206) or not resp.length):
            fault = None  # nothing to break: the fault is not injected
        if fault is not None:
            self.proxy._count_fault(fault)
            self._relay_with_fault(resp, path, fault, resp.length or 0)
        elif resp.chunked:
            while chunk := resp.read1(_CHUNK):
                self._send_raw(b"%x\r\n" % len(chunk))
                self._send_body(path, chunk)
                self._send_raw(b"\r\n")
            self._send_raw(b"0\r\n\r\n")
        elif resp.length is None:  # delimited by the end of the connection
            while chunk := resp.read1(_CHUNK):
                self._send_body(path, chunk)
            self.close_connection = True
        else:
            remaining = resp.length
            while remaining > 0:
                chunk = resp.read(min(_CHUNK, remaining))
                if not chunk:  # the store cut the body short: so do we
                    self._abort(reset=False)
                    return
                self._send_body(path, chunk)
                remaining -= len(chunk)
        resp.close()  # lets the upstream connection carry the next request

    def _relay_with_fault(
        self, resp: http.client.HTTPResponse, path: str, fault: str, length: int
    ) -> None:
        proxy = self.proxy
        cut = length if fault == "corrupt" else proxy._randrange(length)
        flip_at = proxy._randrange(length) if fault == "corrupt" else -1
        sent = 0
        while sent < cut:
            chunk = resp.read(min(_CHUNK, cut - sent))
            if not chunk:
                break
            if sent <= flip_at < sent + len(chunk):
                i = flip_at - sent
                mask = 1 + proxy._randrange(255)
                chunk = chunk[:i] + bytes([chunk[i] ^ mask]) + chunk[i + 1 :]
            self._send_body(path, chunk)
            sent += len(chunk)
        if fault == "corrupt":
            return
        # The rest of the upstream body is unread: that connection can't be reused.
        resp.close()
        self._close_upstream()
        if fault == "stall":
            self.proxy.hold(self.connection)
            self._abort(reset=False)
        else:
            self._abort(reset=(fault == "reset"))

    def _send_body(self, path: str, data: bytes) -> None:
        """Send response body bytes: paced, then counted once the socket took them."""
        if self.trickle is not None:
            self._send_trickle(path, data, self.trickle)
            return
        self.proxy._pace(len(data))
        self.wfile.write(data)
        self.proxy._sent(path, len(data))

    def _send_trickle(self, path: str, data: bytes, rate: float) -> None:
        """Send `data` a tenth of a second's worth at a time; once the trickle is lifted
        (`configure(trickle_rate=None)`), the rest at once."""
        piece = max(1, int(rate / 10))
        for i in range(0, len(data), piece):
            if self.proxy.faults.trickle_rate is None and not self.slow:
                self.trickle = None
                self._send_body(path, data[i:])
                return
            chunk = data[i : i + piece]
            if self.proxy._stopping.wait(len(chunk) / rate):
                raise ConnectionError("the proxy is stopping")
            self.wfile.write(chunk)
            self.proxy._sent(path, len(chunk))

    def _send_raw(self, data: bytes) -> None:
        self.wfile.write(data)

    def _abort(self, *, reset: bool) -> None:
        """Close the client connection now: with RST if `reset`, else with FIN."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        for f in (self.rfile, self.wfile):
            with contextlib.suppress(OSError):
                f.close()
        if reset:
            reset_connection(self.connection)
        else:
            shutdown_quietly(self.connection)
            close_quietly(self.connection)


def reset_connection(conn: socket.socket) -> None:
    """Close with RST: SO_LINGER on with a zero timeout, then close the descriptor."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    close_quietly(conn)


def shutdown_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def close_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
