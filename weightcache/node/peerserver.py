"""The peers' server (design §8): this node's blobs, served to the other daemons.

`GET|HEAD /blobs/sha256/<64 hex>` and nothing else, each request with `Authorization:
Bearer <token>` (constant-time compare), one `Range` honoured. Blobs are read from the blob
store (regular files, never through a symlink); a blob this node is downloading right now
(`claim()`ed by its Fetcher) from `tmp/<hex>.part`, only the prefix of parts its `.part.json`
records as written, a GET ahead of it waiting up to PARTIAL_WAIT for it to grow. One token
bucket (`--peer-upload-limit`) and MAX_REQUESTS bound the uploads, PEER_LIMITS the
connections (a cap, idle and header timeouts: weightcache/node/serve.py). The client side
(discovery, the HEADs, the downloads) is weightcache/node/peers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Protocol

from aiohttp import web

from weightcache.cache.layout import Layout
from weightcache.config import PeerSettings, format_hostport
from weightcache.errors import UsageError
from weightcache.node.peers import BLOB_PATH, Claim, Peers
from weightcache.node.serve import HttpServer, Limits
from weightcache.transfer.pacing import TokenBucket
from weightcache.transfer.parts import PartState
from weightcache.transfer.sources import READ_TIMEOUT

log = logging.getLogger(__name__)

CHUNK = 256 << 10  # bytes per read and per token-bucket debit when uploading
#: Seconds a GET ahead of a partial's written prefix waits for it to grow before the
#: response is cut: shorter than the receiver's read timeout, so that the receiver sees a
#: cut body (and moves on to the next source) rather than a timeout of its own.
PARTIAL_WAIT = READ_TIMEOUT * 2 / 3
MAX_REQUESTS = 256  # uploads at once; more are answered 503 (the receiver retries elsewhere)


# -- pure decisions ---------------------------------------------------------------------------


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) asked by a Range header; None for the whole blob.

    Raises ValueError for anything but one satisfiable `bytes=` range.
    """
    if header is None:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if m is None or m.group(1) == m.group(2) == "":
        raise ValueError(f"unsupported Range {header!r}")
    if m.group(1) == "":
        start, end = max(0, size - int(m.group(2))), size
    else:
        start = int(m.group(1))
        end = min(size, int(m.group(2)) + 1) if m.group(2) else size
    if start >= size or start >= end:
        raise ValueError(f"Range {header!r} is outside a {size}-byte blob")
    return start, end


def refusal(authorization: str | None, token: str) -> str | None:
    """Why a request's Authorization header is refused (None: it carries the token).

    Constant-time comparison: the time taken does not tell how much of a guess was right.
    """
    if not authorization:
        return "no_token"
    scheme, _, given = authorization.strip().partition(" ")
    ok = hmac.compare_digest(given.strip().encode(), token.encode())
    return None if scheme.lower() == "bearer" and ok else "bad_token"


def partial_prefix(state_path: Path, size: int) -> int:
    """Bytes at the start of a partial blob that its downloader recorded as written."""
    try:
        part_size = int(json.loads(state_path.read_text())["part_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if part_size < 4096:  # not what the downloader writes; never plan millions of parts
        return 0
    return PartState.load(state_path, size, part_size).contiguous_end()


#: Peer connections: more than MAX_REQUESTS so that HEADs still get in while uploads run;
#: an idle keep-alive connection lives a minute (the downloaders reuse theirs), a request
#: head must arrive within 10 s of its first byte (design §5, Bounds).
PEER_LIMITS = Limits(connections=2 * MAX_REQUESTS, idle=60.0, header=10.0)


class ServedObserver(Protocol):
    """The daemon's metrics, from the serving side."""

    def peer_uploaded(self, nbytes: int) -> None: ...
    def peer_refused(self, reason: str) -> None: ...


class _Abort(Exception):
    """Cut the response short: the receiver sees a truncated body and retries elsewhere."""


class PeerServer:
    """Serves this node's blobs to the other daemons (see the module docstring), on the
    daemon's event loop (weightcache/node/serve.py bounds the connections)."""

    def __init__(
        self, settings: PeerSettings, layout: Layout, peers: Peers, observer: ServedObserver,
        stopping: threading.Event | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.layout = layout
        self.peers = peers
        self.observer = observer
        self.stopping = stopping or threading.Event()
        limit = settings.upload_limit
        self.limiter = TokenBucket(limit) if limit else None
        self.http = HttpServer(self.handle, PEER_LIMITS, lambda: observer.peer_refused("busy"))
        self.address = settings.listen
        self._requests = 0  # being served; only the loop thread touches it

    async def start(self) -> None:
        """Listen on `settings.listen`; raises UsageError when that address is taken."""
        try:
            self.address = await self.http.start(*self.settings.listen)
        except OSError as e:
            host, port = self.settings.listen
            raise UsageError(
                f"cannot serve peers on {format_hostport(host, port)} ({e.strerror}); "
                "choose a free --peer-addr"
            ) from e
        log.info("serving blobs to peers on %s", format_hostport(*self.address))

    # -- one request ---------------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        head = request.method == "HEAD"
        if request.method not in ("GET", "HEAD"):
            return self._refuse(405, "method", head, {"Allow": "GET, HEAD"}, close=True)
        if self._requests >= MAX_REQUESTS:
            return self._refuse(503, "busy", head)
        self._requests += 1
        try:
            resp = await self._serve(request, head)
        finally:
            self._requests -= 1
        if request.content_length or "Transfer-Encoding" in request.headers:
            resp.force_close()  # a body we will not read: the connection ends here
        return resp

    async def _serve(self, request: web.BaseRequest, head: bool) -> web.StreamResponse:
        reason = refusal(request.headers.get("Authorization"), self.settings.token)
        if reason is not None:
            return self._refuse(401 if reason == "no_token" else 403, reason, head, close=True)
        m = BLOB_PATH.fullmatch(request.raw_path)
        if m is None:
            return self._refuse(404, "bad_path", head)
        sha256 = m.group(1)
        where = await asyncio.to_thread(self._where, sha256)
        if where is None:
            return self._refuse(404, "not_found", head)
        _, size, available, claim = where
        try:
            wanted = parse_range(request.headers.get("Range"), size)
        except ValueError:
            return self._refuse(416, "bad_range", head, {"Content-Range": f"bytes */{size}"})
        start, end = wanted or (0, size)
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "X-Weightcache-Node": self.peers.node_id,
                   "X-Weightcache-Available": str(available)}  # fmt: skip
        if wanted is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if claim is not None:
            headers["X-Weightcache-Claim"] = claim.header()
        resp = web.StreamResponse(status=200 if wanted is None else 206, headers=headers)
        resp.content_length = end - start
        await resp.prepare(request)
        if not head:
            try:
                await self._send(resp, sha256, start, end)
            except (_Abort, OSError):
                request.protocol.force_close()  # the receiver sees a cut body, and retries
        return resp

    def _where(self, sha256: str) -> tuple[Path, int, int, Claim | None] | None:
        """(file, blob size, bytes readable from its start, claim) now; None: not held."""
        blob = self.layout.blob(sha256)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(blob)
            if stat.S_ISREG(st.st_mode):
                return blob, st.st_size, st.st_size, None
        d = self.peers.downloading(sha256)
        if d is None:
            return None
        return d.partial, d.size, partial_prefix(Layout.part_state(d.partial), d.size), d.claim

    async def _send(self, resp: web.StreamResponse, sha256: str, start: int, end: int) -> None:
        """Send [start, end), waiting for a partial's prefix to grow; raises _Abort."""
        pos, path, available = start, self.layout.blob(sha256), 0
        idle_since = time.monotonic()
        while pos < end:
            if pos >= available:
                where = await asyncio.to_thread(self._where, sha256)
                if where is None:
                    raise _Abort()
                path, _, available, _ = where
            n = min(CHUNK, end - pos, available - pos)
            data = await asyncio.to_thread(_pread, path, n, pos) if n > 0 else None
            if data is None:  # nothing new yet, or the partial was published or dropped
                available = pos
                if time.monotonic() - idle_since > PARTIAL_WAIT or self.stopping.is_set():
                    raise _Abort()
                await asyncio.sleep(0.05)
                continue
            if self.limiter is not None:
                await asyncio.sleep(self.limiter.reserve(len(data)))
            await resp.write(data)
            self.observer.peer_uploaded(len(data))
            pos += len(data)
            idle_since = time.monotonic()

    def _refuse(
        self, code: int, reason: str, head: bool, headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> web.StreamResponse:  # fmt: skip
        self.observer.peer_refused(reason)
        all_headers = dict(headers or {})
        if code == 401:
            all_headers["WWW-Authenticate"] = 'Bearer realm="weightcache-peer"'
        resp = web.Response(status=code, text=f"refused: {reason}\n", headers=all_headers)
        if close:
            resp.force_close()
        return resp


def _pread(path: Path, n: int, offset: int) -> bytes | None:
    """n bytes at offset of a regular file, never through a symlink; None if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Abort()
        data = os.pread(fd, n, offset)
    finally:
        os.close(fd)
    if len(data) != n:
        raise _Abort()
    return data
