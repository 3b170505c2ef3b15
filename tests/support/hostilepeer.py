"""A peer that speaks the peer protocol (weightcache/swarm/client.py) but never keeps its word.

It answers every HEAD and GET of any blob with an advertisement, and no GET with a piece:

- `claims`: it holds nothing but fetches every piece (`X-Weightcache-Fetching`), and with
  `streaming` says it passes each on as the store sends it; every GET is refused (416),
  with the same advertisement: a compromised or stuck node holding the token;
- `fails`: it holds every piece (`all`) and fails each GET in turn with one of `failures`:
  "416" (refused, still advertising all), "503", "reset" (half the body, then RST) or
  "range" (a 206 of other bytes than those asked for): a node with a failing disk.

`gets` counts the GETs it answered (one at a time: a threading server).
"""

from __future__ import annotations

import http.server
import re
import threading
from types import TracebackType
from typing import Any

from tests.support.proxy_handler import reset_connection
from weightcache.swarm.pieces import Bitmap, piece_count, piece_size_for
from weightcache.swarm.wire import FETCHING, PIECE_SIZE, PIECES, STREAMING

FAILURES = ("416", "503", "reset", "range")


class HostilePeer:
    """One hostile peer on 127.0.0.1 (see the module docstring); a context manager."""

    def __init__(
        self, size: int, mode: str, streaming: bool = True, failures: tuple[str, ...] = FAILURES
    ) -> None:
        if mode not in ("claims", "fails") or not set(failures) <= set(FAILURES):
            raise ValueError(f"unknown mode {mode!r} or failures {failures!r}")
        self.size, self.mode, self.failures = size, mode, failures
        self.gets = 0
        self._lock = threading.Lock()
        piece = piece_size_for(size)
        full = Bitmap.full(piece_count(size, piece)).encode()
        if mode == "fails":
            self.advertised = {PIECES: "all"}
        else:
            self.advertised = {PIECES: Bitmap(piece_count(size, piece)).encode(),
                               PIECE_SIZE: str(piece), FETCHING: full}  # fmt: skip
            if streaming:
                self.advertised[STREAMING] = full
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def addr(self) -> str:
        """host:port, as a daemon's --peers lists it."""
        return f"127.0.0.1:{self._server.server_address[1]}"

    def next_failure(self) -> str:
        """Count a GET; what it gets: the next of `failures`, or a refusal (claims)."""
        with self._lock:
            self.gets += 1
            n = self.gets
        return "416" if self.mode == "claims" else self.failures[(n - 1) % len(self.failures)]

    def __enter__(self) -> HostilePeer:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client hanging up on a peer it gave up: what the tests make happen


def _handler(peer: HostilePeer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_HEAD(self) -> None:
            self._answer(200, {"Content-Length": str(peer.size)})

        def do_GET(self) -> None:
            failure = peer.next_failure()
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
            start, end = (int(m.group(1)), int(m.group(2)) + 1) if m else (0, peer.size)
            if failure in ("416", "503"):
                self._answer(int(failure), {"Content-Length": "0"})
            elif failure == "reset":
                self._answer(206, {"Content-Range": f"bytes {start}-{end - 1}/{peer.size}",
                                   "Content-Length": str(end - start)})  # fmt: skip
                self.wfile.write(b"\0" * ((end - start) // 2))
                self.wfile.flush()
                reset_connection(self.connection)
                self.close_connection = True
            else:  # the same length, other bytes: they would land at the wrong offset
                shifted = (start + 1) % max(1, peer.size - (end - start) + 1)
                got = f"bytes {shifted}-{shifted + end - start - 1}/{peer.size}"
                self._answer(206, {"Content-Range": got, "Content-Length": str(end - start)})
                self.wfile.write(b"\0" * (end - start))

        def _answer(self, status: int, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in {**peer.advertised, **headers}.items():
                self.send_header(name, value)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
