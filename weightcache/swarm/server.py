"""The peers' server (design §8): this node's blobs, served to the other daemons.

`GET|HEAD /blobs/sha256/<64 hex>` and nothing else, each request with `Authorization:
Bearer <token>` (constant-time compare), one `Range` honoured. Blobs are read from the blob
store (regular files, never through a symlink) and sent with sendfile(2), in chunks paced
by the upload limit; a blob this node is downloading right now (`claim()`ed by its Fetcher)
from `tmp/<hex>.part`, only the pieces (the parts of its `.part.json`) recorded as written,
streamed through the loop. Every answer advertises the pieces held (`X-Weightcache-Pieces`:
`all`, or a bitmap with `X-Weightcache-Piece-Size`). A GET of a partial touching a piece not
held waits up to PARTIAL_WAIT for it, or with `X-Weightcache-Held-Only: 1` is refused at
once (416, `not_held`). One token bucket (`--peer-upload-limit`) and MAX_REQUESTS bound the
uploads, PEER_LIMITS the connections (a cap, idle and header timeouts:
weightcache/listeners/http.py). The client side (discovery, the HEADs, the downloads) is
weightcache/swarm/client.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

from aiohttp import web

from weightcache.cache.layout import Layout
from weightcache.config import PeerSettings, format_hostport
from weightcache.errors import UsageError
from weightcache.listeners.admission import ConnectionLimits
from weightcache.listeners.http import HttpServer
from weightcache.swarm.client import Peers
from weightcache.swarm.peerpieces import Pieces, advertise, partial_pieces
from weightcache.swarm.wire import ASKER, BLOB_PATH, HELD_ONLY, LOAD
from weightcache.transfer.pacing import TokenBucket
from weightcache.transfer.sources import READ_TIMEOUT

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 256 << 10  # bytes per read and per token-bucket debit when uploading a partial
#: Bytes per sendfile(2) call for a complete blob: large enough that the loop's per-call
#: cost vanishes, small enough to check stopping often; under an upload limit a chunk is
#: at most the bucket's burst, so the pace stays smooth (`_sendfile_chunk`).
SENDFILE_CHUNK = 16 << 20
#: Seconds a GET ahead of a partial's written prefix waits for it to grow before the
#: response is cut: shorter than the receiver's read timeout, so that the receiver sees a
#: cut body (and moves on to the next source) rather than a timeout of its own.
PARTIAL_WAIT = READ_TIMEOUT * 2 / 3
#: A piece streamed from the store goes out at least this much at a time (its tail, less),
#: looked at every STREAM_POLL seconds: fewer, larger writes for the loop; but whatever has
#: arrived once STREAM_FLUSH seconds passed without a write, well within the receiver's
#: read timeout (pace.PEER_TIMEOUT), since a crowded store link may send less than a
#: chunk in that time and the receivers would shun an honest streamer (design §8, Pieces).
STREAM_CHUNK, STREAM_POLL, STREAM_FLUSH = 64 << 10, 0.02, 1.0
MAX_REQUESTS = 256  # uploads at once; more are answered 503 (the receiver retries elsewhere)
#: A chunk of a response must leave within SEND_GRACE seconds plus its size at
#: SEND_MIN_RATE bytes/s shared by the responses being served (the most seen while it is
#: sent, judged every SEND_RECHECK seconds; never below SEND_TRICKLE), or the response is
#: cut: a receiver that stops reading gives back its slot and file, while the honest
#: receivers sharing a crowded uplink keep theirs (design §8, Bounds).
SEND_GRACE, SEND_MIN_RATE, SEND_TRICKLE, SEND_RECHECK = READ_TIMEOUT, 256 << 10, 16 << 10, 0.5


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
    try:
        ok = hmac.compare_digest(given.strip().encode(), token.encode())
    except UnicodeEncodeError:  # a byte aiohttp could not decode: not our token
        return "bad_token"
    return None if scheme.lower() == "bearer" and ok else "bad_token"


#: Peer connections: more than MAX_REQUESTS so that HEADs still get in while uploads run;
#: an idle keep-alive connection lives a minute (the downloaders reuse theirs), a request
#: head must arrive within 10 s of its first byte (design §5, Bounds).
PEER_LIMITS = ConnectionLimits(connections=2 * MAX_REQUESTS, idle=60.0, header=10.0)


class ServedObserver(Protocol):
    """The daemon's metrics, from the serving side."""

    def peer_uploaded(self, nbytes: int) -> None: ...
    def peer_streamed(self, nbytes: int) -> None: ...  # of those, passed on from the store
    def peer_refused(self, reason: str) -> None: ...


class _Abort(Exception):
    """Cut the response short: the receiver sees a truncated body and retries elsewhere."""


class PeerServer:
    """Serves this node's blobs to the other daemons (see the module docstring), on the
    daemon's event loop (weightcache/listeners/http.py bounds the connections)."""

    def __init__(
        self,
        settings: PeerSettings,
        layout: Layout,
        peers: Peers,
        observer: ServedObserver,
        stopping: threading.Event | None = None,
    ) -> None:
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
        self.peers.asked_by(sha256, request.headers.get(ASKER))
        where = await self._locate(sha256)
        if where is None:
            return self._refuse(404, "not_found", head)
        path, pieces = where
        size = pieces.size
        try:
            ranges = request.headers.getall("Range", [])
            if len(ranges) > 1:  # which one would it mean? none
                raise ValueError(f"{len(ranges)} Range headers")
            wanted = parse_range(ranges[0] if ranges else None, size)
        except ValueError:
            return self._refuse(416, "bad_range", head, {"Content-Range": f"bytes */{size}"})
        start, end = wanted or (0, size)
        advertised = advertise(pieces)
        covered = pieces.covers(start, end)
        streamed = None if covered else pieces.streamed_piece(start, end)
        if request.headers.get(HELD_ONLY) == "1" and not covered and streamed is None:
            return self._refuse(
                416, "not_held", head, {"Content-Range": f"bytes */{size}", **advertised}
            )
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "X-Weightcache-Node": self.peers.node_id,
            LOAD: str(self._requests - 1),
            "X-Weightcache-Available": str(pieces.run_end(0)),
            **advertised,
        }
        if wanted is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        resp = web.StreamResponse(status=200 if wanted is None else 206, headers=headers)
        resp.content_length = end - start
        await resp.prepare(request)
        if not head:
            try:
                if covered:  # final bytes on disk: no copy through Python
                    await self._sendfile(request, path, start, end)
                elif streamed is not None:
                    await self._stream(resp, sha256, streamed, pieces.piece_size, start, end)
                else:
                    await self._send(resp, sha256, start, end)
                await resp.write_eof()
            except (_Abort, OSError):
                request.protocol.force_close()  # the receiver sees a cut body, and retries
        return resp

    async def _locate(self, sha256: str) -> tuple[Path, Pieces] | None:
        """`_where`, on the loop when it reads no file (an lstat, and the pieces of a
        download this process runs: every HEAD of a swarm, twice a second per peer; a
        thread hop cost more than the work), in a thread when it reads a part state."""
        if self.peers.live(sha256) is not None or self.peers.downloading(sha256) is None:
            return self._where(sha256)
        return await asyncio.to_thread(self._where, sha256)

    def _where(self, sha256: str) -> tuple[Path, Pieces] | None:
        """(file, the pieces held) now; None: not held."""
        blob = self.layout.blob(sha256)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(blob)
            if stat.S_ISREG(st.st_mode):
                return blob, Pieces(st.st_size)
        d = self.peers.downloading(sha256)
        if d is None:
            return None
        live = self.peers.live(sha256)
        if live is None:
            return d.partial, partial_pieces(Layout.part_state(d.partial), d.size)
        piece_size, held, fetching, streaming = live.pieces()
        held_list = tuple(i in held for i in range(held.count))
        return d.partial, Pieces(d.size, piece_size, held_list, fetching, streaming)

    def _sendfile_chunk(self) -> int:
        if self.limiter is None:
            return SENDFILE_CHUNK
        return max(CHUNK, min(SENDFILE_CHUNK, int(self.limiter.burst)))

    async def _sendfile(self, request: web.BaseRequest, path: Path, start: int, end: int) -> None:
        """Send [start, end) of a complete blob with sendfile(2) (asyncio falls back to
        reads and writes where the transport cannot), one paced chunk at a time; raises
        _Abort or OSError when the file or the connection ends first."""
        transport = request.transport
        if transport is None:
            raise _Abort()
        loop = asyncio.get_running_loop()

        async def chunk(f: BinaryIO, pos: int, n: int) -> int:
            # checked in the step that starts the send (a task's first step comes later):
            # asyncio's sendfile raises RuntimeError on a closing transport
            if self.stopping.is_set() or transport.is_closing():
                raise _Abort()
            return await loop.sendfile(transport, f, pos, n)

        with await asyncio.to_thread(_open_regular, path) as f:
            pos = start
            while pos < end:
                n = min(self._sendfile_chunk(), end - pos)
                if self.limiter is not None:
                    await asyncio.sleep(self.limiter.reserve(n))
                sent = await self._in_time(chunk(f, pos, n), n)
                self.observer.peer_uploaded(sent)
                if sent != n:  # the file is shorter than it was: never pad
                    raise _Abort()
                pos += sent

    async def _send(self, resp: web.StreamResponse, sha256: str, start: int, end: int) -> None:
        """Send [start, end) of a partial, waiting for pieces not yet written; raises _Abort."""
        pos, path, available = start, self.layout.blob(sha256), 0
        idle_since = time.monotonic()
        while pos < end:
            if pos >= available:
                where = await self._locate(sha256)
                if where is None:
                    raise _Abort()
                path, pieces = where
                available = pieces.run_end(pos)
            n = min(CHUNK, end - pos, available - pos)
            data = await asyncio.to_thread(_pread, path, n, pos) if n > 0 else None
            if data is None:  # nothing new yet, or the partial was published or dropped
                available = pos
                if time.monotonic() - idle_since > PARTIAL_WAIT or self.stopping.is_set():
                    raise _Abort()
                await asyncio.sleep(0.05)
                continue
            await self._write(resp, data)
            pos += len(data)
            idle_since = time.monotonic()

    async def _write(self, resp: web.StreamResponse, data: bytes) -> None:
        """Send bytes of a partial through the loop, paced and in time (raises _Abort)."""
        if self.limiter is not None:
            await asyncio.sleep(self.limiter.reserve(len(data)))
        await self._in_time(resp.write(data), len(data))
        self.observer.peer_uploaded(len(data))

    async def _stream(
        self,
        resp: web.StreamResponse,
        sha256: str,
        piece: int,
        piece_size: int,
        start: int,
        end: int,
    ) -> None:
        """Send [start, end) of a piece this node is receiving from the store as its bytes
        arrive (cut-through: design §8, Swarm), at least STREAM_CHUNK at a time or what has
        arrived after STREAM_FLUSH; once the piece is not streamed any more (written, or its
        request failed) the rest as from any partial (`_send`: from the file, or waited
        for). Raises _Abort."""
        pos, base = start, piece * piece_size
        idle_since = time.monotonic()
        while pos < end:
            live = self.peers.live(sha256)
            want = min(CHUNK, end - pos)
            data = None
            if live is not None:
                flush = time.monotonic() - idle_since >= STREAM_FLUSH
                at_least = 1 if flush else min(STREAM_CHUNK, want)
                data = live.streamed(piece, pos - base, want, at_least)
            if data is None:
                await self._send(resp, sha256, pos, end)
                return
            if not data:
                if time.monotonic() - idle_since > PARTIAL_WAIT or self.stopping.is_set():
                    raise _Abort()
                await asyncio.sleep(STREAM_POLL)
                continue
            await self._write(resp, data)
            self.observer.peer_streamed(len(data))
            pos += len(data)
            idle_since = time.monotonic()

    async def _in_time(self, sending: Awaitable[T], nbytes: int) -> T:
        """`sending` (nbytes to the receiver), or _Abort if the receiver does not take them
        within SEND_GRACE + nbytes / rate seconds, the rate SEND_MIN_RATE shared by the most
        responses served meanwhile (at least SEND_TRICKLE): requests arriving during a chunk
        slow it down, so its deadline is judged again every SEND_RECHECK seconds."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(sending)
        began, sharing = loop.time(), self._requests
        try:
            while True:
                rate = max(SEND_TRICKLE, SEND_MIN_RATE / max(1, sharing))
                left = began + SEND_GRACE + nbytes / rate - loop.time()
                if left <= 0:
                    log.info("cut a response: the receiver took less than %d bytes/s", rate)
                    raise _Abort()
                done, _ = await asyncio.wait({task}, timeout=min(left, SEND_RECHECK))
                if done:
                    return task.result()
                sharing = max(sharing, self._requests)
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieve)

    def _refuse(
        self,
        code: int,
        reason: str,
        head: bool,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> web.StreamResponse:
        self.observer.peer_refused(reason)
        all_headers = dict(headers or {})
        if code == 401:
            all_headers["WWW-Authenticate"] = 'Bearer realm="weightcache-peer"'
        resp = web.Response(status=code, text=f"refused: {reason}\n", headers=all_headers)
        if close:
            resp.force_close()
        return resp


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Retrieve a cancelled send's outcome (asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, never through a symlink; raises _Abort if it is gone or
    not a regular file (evicted or replaced since it was found)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _Abort() from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Abort()
    return os.fdopen(fd, "rb")


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
