"""Ranged GETs over HTTP for blob sources: the origin's presigned URLs (backends/s3/revision.py), a
peer's blob URLs.

Why plain `http.client` rather than aiohttp or boto3 `get_object`: a worker `recv_into`s its
fixed buffer and the downloader `pwrite`s it, both releasing the GIL, so memory stays at
workers x buffer whatever the model size and no per-request botocore machinery runs
(benchmarks/cold_fetch.py measures the result against s5cmd). boto3 still signs: every GET
of the origin uses a presigned URL from `Origin.presign_get`.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from weightcache.config import is_digits
from weightcache.errors import IntegrityError, Interrupted, SourceError, UsageError
from weightcache.transfer.sources import READ_TIMEOUT, SMALL_BODY_MAX, RangeReader, RetryRange

#: A read of a body wakes when about this many seconds of the response's rate have arrived
#: (SO_RCVLOWAT), at most WAKE_MAX bytes: see `_Response.recv_into`.
WAKE_SECONDS = 0.1
WAKE_MAX = 256 << 10
#: The most of a body `HTTPResponse.fp` (`socket.makefile("rb")`) can hold read ahead.
READER_BUFFER = io.DEFAULT_BUFFER_SIZE


class _Response(http.client.HTTPResponse):
    """An HTTP response that can read what one recv brings, into a caller's buffer."""

    def __init__(self, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self._sock = sock
        self._lowat = 0  # the socket's SO_RCVLOWAT as this response last set it
        self._began = 0.0  # when its body's first read started
        self._got = 0  # body bytes read so far
        # A kept connection's previous body may have raised it: the head must not wait.
        self._set_lowat(1)

    def recv_into(self, b: memoryview) -> int:
        """Up to len(b) bytes with at most one socket read (HTTPResponse.readinto waits
        for the whole buffer, however slowly it fills)."""
        if self.fp is None or self.chunked or self.length is None:
            data = self.read1(len(b))  # odd servers: a copy, but rare
            b[: len(data)] = data
            return len(data)
        # Up to a buffer's worth of the body may sit in fp's buffer, not on the socket: a
        # mark asking for it would wait for bytes that never come (until the timeout).
        self._wake_at(min(len(b), self.length - READER_BUFFER))
        n = self.fp.readinto1(b[: self.length])
        self._got += n
        if not n and b:
            self._close_conn()  # type: ignore[attr-defined]
        else:
            self.length -= n
            if not self.length:
                self._close_conn()  # type: ignore[attr-defined]
        return n

    def _wake_at(self, want: int) -> None:
        """Let the next read wake when about WAKE_SECONDS of this response's rate so far
        have arrived (SO_RCVLOWAT, a power of two up to WAKE_MAX), never waiting for more
        than the `want` bytes still to come. Without it a read woke for every few packets:
        sixteen connections sharing a shaped link cost a thread switch (and its GIL
        handoff) per 10-20 KB, 12,000 futex calls a second for 20 MB/s. A read now times
        out only if less than its mark arrives within the read timeout: a connection that
        fell below 52 KB/s (a peer's 5 s) or 8.7 KB/s (the store's 30 s) at once, which is
        retried, or its piece asked elsewhere, as any other timeout."""
        now = time.monotonic()
        if not self._began:
            self._began = now
        rate = self._got / max(now - self._began, 1e-3)
        lowat = min(WAKE_MAX, max(1, want), 1 << max(0, int(rate * WAKE_SECONDS).bit_length() - 1))
        if lowat != self._lowat:
            self._set_lowat(lowat)

    def _set_lowat(self, lowat: int) -> None:
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
        self._lowat = lowat


def connect_ascii(
    address: tuple[str, int], timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
) -> socket.socket:  # fmt: skip
    """`socket.create_connection`, an ASCII host name given to the resolver as bytes: a
    str one goes through the idna codec, whose import (with stringprep and unicodedata)
    cost ~2 ms before a cold fetch's first GET. The connections below use it."""
    host, port = address
    name = host.encode("ascii") if host.isascii() else host  # getaddrinfo takes either
    return socket.create_connection((name, port), timeout, source_address)  # type: ignore[arg-type]


def ca_file(variable: str | None) -> str | None:
    """The CA bundle the environment variable `variable` names (None: unset, or no
    variable). Raises UsageError naming the variable when it names no readable file: that
    is configuration to fix, not a network failure to retry."""
    path = os.environ.get(variable) if variable else None
    if path and not os.access(path, os.R_OK):
        raise UsageError(
            f"{variable}={path} names no readable file; point it at the CA bundle (PEM) "
            "that signed the store's certificate, or unset it"
        )
    return path or None


def new_connection(
    scheme: str, netloc: str, timeout: float, cafile: str | None
) -> http.client.HTTPConnection:
    """A connection to `netloc` (https: trusting `cafile` if given, else the system's CAs),
    opened on its first request by `connect_ascii`."""
    conn: http.client.HTTPConnection
    if scheme == "https":
        context = ssl.create_default_context(cafile=cafile)
        conn = http.client.HTTPSConnection(netloc, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(netloc, timeout=timeout)
    conn._create_connection = connect_ascii  # type: ignore[attr-defined]
    return conn


#: Checks a response to a ranged GET (`check_status`'s contract) and returns how many bytes
#: of its body come before the range asked for (0 for a 206): a server that ignores Range
#: answers 200 with the whole object, whose first `start` bytes are read and dropped.
StatusCheck = Callable[[http.client.HTTPResponse, int, int, int, str], int]


class _HttpRange:
    def __init__(self, resp: _Response, skip: int) -> None:
        self._resp, self._skip = resp, skip

    def readinto(self, buf: memoryview) -> int:
        try:
            while self._skip:  # a whole body for a ranged GET: drop what precedes the range
                n = self._resp.recv_into(buf[: self._skip])
                if not n:
                    return 0
                self._skip -= n
            return self._resp.recv_into(buf)
        except (OSError, http.client.HTTPException) as e:
            raise RetryRange(f"{type(e).__name__}: {e}") from e


#: A kept connection: (scheme, host:port, timeout, the CA bundle's environment variable).
_ConnKey = tuple[str, str, float, str | None]
#: Hosts one thread keeps a connection to: the swarm's workers ask several peers in turn.
MAX_HOSTS_PER_THREAD = 16


class OpenConnections:
    """The connections a client opened, kept so that `interrupt()` (SIGTERM, from any
    thread) ends their requests at once: each socket is shut down, and a request on a new
    one is Interrupted. A request still connecting ends at its timeout."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()
        #: Set by `interrupt()`: the retry loops of the control plane wait on it.
        self.stopped = threading.Event()

    @property
    def interrupted(self) -> bool:
        return self.stopped.is_set()

    def check(self) -> None:
        """Interrupted once `interrupt()` was called."""
        if self.interrupted:
            raise Interrupted()

    def failure(self, e: Exception) -> Exception:
        """What a request that failed with `e` raises: Interrupted if `interrupt()` shut its
        connection down (not the server's doing: no retry, no warning), else RetryRange."""
        if self.interrupted:
            return Interrupted()
        return RetryRange(f"{type(e).__name__}: {e}")

    def add(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self.check()
            self._open.add(conn)

    def interrupt(self) -> None:
        with self._lock:
            self.stopped.set()
            conns = list(self._open)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class HttpRanges:
    """Ranged GETs over keep-alive connections: per worker thread (http.client connections
    are not thread-safe) one per host it asks, up to MAX_HOSTS_PER_THREAD. `interrupt()`
    ends them all at once (SIGTERM: a request waiting on a silent server would otherwise
    hold the process for its whole timeout)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._open = OpenConnections()
        #: The http(s) revisions (URLs) whose server ignores Range, learned once per
        #: revision and kept here, where every RevisionSource of a fetch finds it
        #: (backends/http.py).
        self.whole_only: set[str] = set()

    @contextlib.contextmanager
    def get(
        self, location: str, headers: dict[str, str], start: int, end: int, size: int,
        timeout: float, where: str, check: StatusCheck | None = None,
        ca_env: str | None = "AWS_CA_BUNDLE",
        on_response: Callable[[http.client.HTTPResponse], None] | None = None,
    ) -> Iterator[RangeReader]:  # fmt: skip
        """GET bytes [start, end) of the `size`-byte object at `location` (the
        `BlobSource.open_range` contract; `where` names the object in messages), its
        response checked by `check` (default `check_status`). https trusts the CA bundle
        named by the environment variable `ca_env` if set, else the system's (which
        OpenSSL lets SSL_CERT_FILE replace). `on_response` sees every response's status
        and headers before they are checked (a peer's advertisement rides on its refusals
        too)."""
        url = urllib.parse.urlsplit(location)
        target = f"{url.path}?{url.query}" if url.query else url.path
        conn = self._connection(url, timeout, ca_env)
        try:
            try:
                conn.request(
                    "GET", target, headers={**headers, "Range": f"bytes={start}-{end - 1}"}
                )
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise self._open.failure(e) from e
            assert isinstance(resp, _Response)
            if on_response is not None:
                on_response(resp)
            skip = (check or check_status)(resp, start, end, size, where)
            yield _HttpRange(resp, skip)
        except BaseException:
            self._drop_connection()  # its state is unknown: a fresh one for the next range
            raise
        if not resp.isclosed():  # left with its body unread: the next request would fail
            self._drop_connection()

    def request(
        self, method: str, location: str, headers: dict[str, str], timeout: float,
        ca_env: str | None, body: bool = True,
    ) -> tuple[http.client.HTTPResponse, bytes]:  # fmt: skip
        """One request for a small answer (a HEAD, a manifest) on this thread's connection:
        the response and its whole body (without `body`: b"", and the connection is closed
        rather than read to its end). Raises RetryRange if the connection failed, and
        ssl.SSLCertVerificationError as is (a retry cannot fix it)."""
        url = urllib.parse.urlsplit(location)
        conn = self._connection(url, timeout, ca_env)
        try:
            conn.request(method, url.path, headers=headers)
            resp = conn.getresponse()
            if body and method == "HEAD":  # no body, whatever its Content-Length says
                return resp, resp.read()
            if body:
                return resp, read_small_body(resp, f"{method} {location}")
            self._drop_connection()
            return resp, b""
        except (OSError, http.client.HTTPException) as e:
            self._drop_connection()
            if isinstance(e, ssl.SSLCertVerificationError):
                raise
            raise self._open.failure(e) from e

    def interrupt(self) -> None:
        """Shut every connection down (a request on one fails at once) and refuse new
        requests (Interrupted). Safe from a signal handler's thread."""
        self._open.interrupt()

    @property
    def stopped(self) -> threading.Event:
        """Set by `interrupt()`: what the retry loops of its clients wait on."""
        return self._open.stopped

    def _connection(
        self, url: urllib.parse.SplitResult, timeout: float, ca_env: str | None = "AWS_CA_BUNDLE"
    ) -> http.client.HTTPConnection:
        """This thread's connection to `url`'s host, kept alive across ranges (a thread
        may alternate between hosts: the swarm asks several peers and the store).
        Interrupted once `interrupt()` was called."""
        self._open.check()
        key = (url.scheme, url.netloc, timeout, ca_env)
        conns = self._conns()
        self._local.conn_key = key
        conn = conns.get(key)
        if conn is not None:
            return conn
        if len(conns) >= MAX_HOSTS_PER_THREAD:
            oldest = next(iter(conns))
            conns.pop(oldest).close()
        conn = new_connection(url.scheme, url.netloc, timeout, ca_file(ca_env))
        conn.response_class = _Response
        self._open.add(conn)  # Interrupted if interrupted since the check above
        conns[key] = conn
        return conn

    def _conns(self) -> dict[_ConnKey, http.client.HTTPConnection]:
        conns: dict[_ConnKey, http.client.HTTPConnection] | None
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def _drop_connection(self) -> None:
        """Close the connection of this thread's current range (its state is unknown)."""
        key: _ConnKey | None = getattr(self._local, "conn_key", None)
        conn = self._conns().pop(key, None) if key is not None else None
        if conn is not None:
            conn.close()


#: Bytes a small answer must move in READ_TIMEOUT seconds (the downloader's stall rule).
SMALL_BODY_PROGRESS = 1 << 10


def too_large(what: str) -> SourceError:
    """The error for a small answer over SMALL_BODY_MAX (exit 3)."""
    return SourceError(
        f"{what}: the answer is over {SMALL_BODY_MAX >> 20} MiB, more than a SHA256SUMS, a "
        "listing page or an error ever is; check the source (the URL, the endpoint)"
    )


def read_small_body(
    resp: http.client.HTTPResponse, what: str, stall: float = READ_TIMEOUT
) -> bytes:
    """The response's whole body, at most SMALL_BODY_MAX bytes of it; SourceError (exit 3)
    for a longer one, refused by its Content-Length before it is read when it says so.
    TimeoutError for a trickle (less than SMALL_BODY_PROGRESS bytes in `stall` seconds: each
    read within the socket's timeout, it would never end) and IncompleteRead for a body cut
    short, as the socket would raise them: every caller retries those."""
    said = resp.getheader("Content-Length", "")
    too_long = is_digits(said) and int(said) > SMALL_BODY_MAX
    chunks, got = [], 0
    since, moved = time.monotonic(), 0  # the stall clock: since when, bytes since then
    while not too_long and got <= SMALL_BODY_MAX:
        chunk = resp.read1(min(1 << 20, SMALL_BODY_MAX + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got, moved = got + len(chunk), moved + len(chunk)
        if time.monotonic() - since >= stall:
            if moved < SMALL_BODY_PROGRESS:
                resp.close()
                raise TimeoutError(f"{what}: less than {SMALL_BODY_PROGRESS} bytes in "
                                   f"{stall:.0f}s (a trickle)")  # fmt: skip
            since, moved = time.monotonic(), 0
    if too_long or got > SMALL_BODY_MAX:
        resp.close()
        raise too_large(what)
    if is_digits(said) and got != int(said):  # read1 takes a cut body for its end
        resp.close()
        raise http.client.IncompleteRead(b"".join(chunks), int(said) - got)  # as read() did
    if not resp.isclosed():  # read1 leaves a Content-Length body open at its end: done
        resp.read()  # (nothing left to read), so the kept connection takes the next request
    return b"".join(chunks)


def check_status(
    resp: http.client.HTTPResponse, start: int, end: int, size: int, where: str
) -> int:
    """Accept a 206 of the right object (or a 200 for a whole-object read): 0 bytes to
    skip (a `StatusCheck`); raise
    RetryRange for what a retry may fix (throttle=True for 429/503 SlowDown), IntegrityError
    for an object whose size changed, SourceError for the rest."""
    if resp.status == 206:
        got = resp.getheader("Content-Range", "")
        total = got.rpartition("/")[2]
        if is_digits(total) and int(total) != size:
            raise IntegrityError(
                f"{where} is {total} bytes now but was {size} when listed; the object changed "
                "during the fetch, run it again"
            )
        if got != f"bytes {start}-{end - 1}/{size}":  # its bytes would land elsewhere
            raise RetryRange(f"asked for bytes {start}-{end - 1}, got Content-Range {got!r}")
        return 0
    if resp.status == 200 and start == 0 and end == size:
        return 0  # a server that ignores Range for a whole-object read
    body = resp.read(4096)
    if resp.status in (429, 503) or b"SlowDown" in body:
        raise RetryRange(f"HTTP {resp.status} SlowDown", throttle=True)
    if resp.status >= 500 or resp.status == 408:
        raise RetryRange(f"HTTP {resp.status}")
    if resp.status == 403:
        raise SourceError(f"GET {where}: access denied (403); check the credentials")
    if resp.status in (404, 416):
        raise SourceError(f"GET {where}: HTTP {resp.status}; the object changed or vanished")
    raise SourceError(f"GET {where}: unexpected HTTP {resp.status}")
