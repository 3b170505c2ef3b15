"""Real web servers on loopback for the http(s):// source tests and benchmark.

`Nginx`: Debian's nginx (`.ci/run` installs it) run in the foreground as the current user,
with a temp prefix: one plain-http server honouring Range, its `/private/` files behind a
bearer token, its `/throttled/` files behind a request rate limit answering 429, its
`/nohead/` files refusing HEAD (405), and the same root over https with a self-signed
certificate. `NoRangeServer`: Python's SimpleHTTPRequestHandler, which ignores Range (200
with the whole file), in a thread; with `head=False`, it implements GET only (HEAD: 501);
with `gzips=True`, it gzip-encodes files over 1 KiB even to a client asking for identity.
`silent_server()`: one that accepts connections and never answers.
"""

from __future__ import annotations

import functools
import gzip
import http.server
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKEN = "s3cret-token-for-tests"

_CONF = """
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 100000;
    limit_req_zone $binary_remote_addr zone=slow:1m rate=20r/s;
    server {{
        listen 127.0.0.1:{port};
        listen 127.0.0.1:{tls_port} ssl;
        ssl_certificate {tmp}/cert.pem;
        ssl_certificate_key {tmp}/key.pem;
        root {root};
        location /private/ {{
            if ($http_authorization != "Bearer {token}") {{ return 401; }}
        }}
        location /throttled/ {{
            limit_req zone=slow burst=2 nodelay;
            limit_req_status 429;
        }}
        location /nohead/ {{
            if ($request_method = HEAD) {{ return 405; }}
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(port: int, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Nginx:
    """nginx serving `root` on http://127.0.0.1:<port> and https://127.0.0.1:<tls_port>."""

    def __init__(self, root: Path, tmp: Path) -> None:
        self.root, self.tmp = root, tmp
        self.port, self.tls_port = free_port(), free_port()
        self.cert = tmp / "cert.pem"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        return f"https://127.0.0.1:{self.tls_port}"

    def start(self) -> Nginx:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(self.tmp / "key.pem"), "-out", str(self.cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        conf = self.tmp / "nginx.conf"
        conf.write_text(_CONF.format(tmp=self.tmp, port=self.port, tls_port=self.tls_port,
                                     root=self.root, token=TOKEN))  # fmt: skip
        self._proc = subprocess.Popen(
            [binary, "-p", str(self.tmp), "-c", str(conf), "-e", str(self.tmp / "error.log")]
        )
        wait_listening(self.port, self._proc)
        wait_listening(self.tls_port, self._proc)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: it sends Content-Length

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _GetOnly(_Quiet):
    def do_HEAD(self) -> None:
        self.send_error(501, f"Unsupported method ({self.command!r})")


class _Gzips(_Quiet):
    """Compresses every file over GZIP_MIN bytes whatever the client accepts, as a
    misconfigured server or proxy does (HEAD: the file's own length)."""

    GZIP_MIN = 1024

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file() or path.stat().st_size <= self.GZIP_MIN:
            super().do_GET()
            return
        body = gzip.compress(path.read_bytes(), compresslevel=1)
        self.send_response(200)
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client killed mid-download (the kill -9 tests): nothing to report


class _WebPage(http.server.BaseHTTPRequestHandler):
    """A web server where a store or a Hub should be: 200 and a page, whatever the request."""

    def do_GET(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        page = b"<html><body>It works!</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    do_PUT = do_POST = do_GET

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def web_page() -> Iterator[str]:
    """The URL of a `_WebPage` server on loopback, for the block's duration."""
    with serving(_WebPage) as url:
        yield url


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """The URL of a server of `handler` on loopback, for the block's duration; its handlers
    still running at the end are not waited for."""
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class NoRangeServer:
    """Python's file server, which ignores Range, serving `root` from a thread; without
    `head`, one that answers HEAD 501 (as a server implementing GET only); with `gzips`,
    one that gzip-encodes its files' bodies whatever the client accepts."""

    def __init__(self, root: Path, head: bool = True, gzips: bool = False) -> None:
        kind = _Gzips if gzips else _Quiet if head else _GetOnly
        handler = functools.partial(kind, directory=str(root))
        self._server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> NoRangeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SilentServer:
    """A server that accepts connections and never answers (a hung web server or mirror);
    `accepted` counts them."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._held.append(conn)
            self.accepted += 1

    def wait_accepted(self, count: int, timeout: float = 20) -> None:
        """Until `count` connections came (and a moment for their requests to be sent)."""
        deadline = time.monotonic() + timeout
        while self.accepted < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.accepted >= count, f"{self.accepted} of {count} connections came"
        time.sleep(0.2)

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()


@contextmanager
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()
