"""Peer-to-peer blob sharing between node daemons (design §8): server, discovery, client.

Server: `GET|HEAD /blobs/sha256/<64 hex>` and nothing else, each request with `Authorization:
Bearer <token>` (constant-time compare), one `Range` honoured. Blobs are read from the blob
store (regular files, never through a symlink); a blob this node is downloading right now
(`claim()`ed by its Fetcher) from `tmp/<hex>.part`, only the prefix of parts its `.part.json`
records as written, a GET ahead of it waiting up to PARTIAL_WAIT for it to grow. One token
bucket (`--peer-upload-limit`) and MAX_REQUESTS bound the uploads, PEER_LIMITS the
connections (a cap, idle and header timeouts: weightcache/node/serve.py).

Nothing a peer sends is trusted: the receiver hashes every blob and publishes it only if its
sha256 is the manifest's, exactly as for the origin. A prefix served from a partial is not
verified on its own; the receiver's whole-blob check keeps a corrupt piece (from a lying peer
or a seeder's own corrupt download) out of the cache, marks that peer bad and goes to the
origin.

A burst of cold nodes: each node claims a blob (wall clock + nonce) before asking peers and
follows only peers holding it complete or claiming it earlier (`rank`). The earliest finds
nobody and goes to the origin; the others stream from it as its prefix grows. Clocks off by
more than the gap between two claims only cost a second origin download, never wrong data.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http.client
import json
import logging
import os
import random
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from weightcache.cache.layout import Layout
from weightcache.config import PeerSettings, format_hostport
from weightcache.errors import UsageError
from weightcache.node.serve import HttpServer, Limits
from weightcache.transfer.pacing import TokenBucket
from weightcache.transfer.parts import PartState

log = logging.getLogger(__name__)

BLOB_PATH = re.compile(r"/blobs/sha256/([0-9a-f]{64})")
CHUNK = 256 << 10  # bytes per read and per token-bucket debit when uploading
HEAD_TIMEOUT = 1.0  # a peer that cannot answer a HEAD in a second is not worth waiting for
PARTIAL_WAIT = 20.0  # below the downloader's 30 s socket timeout, so the receiver sees a cut
MAX_REQUESTS = 256  # uploads at once; more are answered 503 (the receiver retries elsewhere)
BAD_PEER_SECONDS = 600.0  # a peer that served wrong bytes is not asked again for this long
DOWN_PEER_SECONDS = 10.0  # nor one that did not answer, for this long
DNS_REFRESH = 5.0  # seconds between lookups of the Service name
REFUSAL_REASONS = ("no_token", "bad_token", "bad_path", "not_found", "bad_range", "method",
                   "busy")  # fmt: skip
_WILDCARDS = ("", "0.0.0.0", "::")


# -- pure decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Claim:
    """When a node started to want a blob; earlier claims go to the origin, later follow."""

    since: float  # wall clock (time.time()), comparable across nodes
    nonce: int  # breaks ties

    def header(self) -> str:
        return f"{self.since!r} {self.nonce}"

    @classmethod
    def parse(cls, text: str) -> Claim:
        since, nonce = text.split()
        return cls(float(since), int(nonce))


@dataclass(frozen=True)
class Holding:
    """A peer that can serve a blob: complete (`claim` None) or while downloading it."""

    peer: str  # base URL, "http://host:port"
    available: int  # bytes it can serve now from the start of the blob
    claim: Claim | None = None


def rank(holdings: Sequence[Holding], own: Claim | None, rng: random.Random) -> list[Holding]:
    """The peers to try for one blob, best first.

    Complete holders first, shuffled to spread the uploads; then peers still downloading
    it that claimed it before `own` (None: follow any), most bytes first. A peer that
    claimed it after us is never followed: it follows us, or someone before us.
    """
    complete = [h for h in holdings if h.claim is None]
    rng.shuffle(complete)
    earlier = [h for h in holdings if h.claim is not None and (own is None or h.claim < own)]
    return complete + sorted(earlier, key=lambda h: -h.available)


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


def peer_url(host: str, port: int) -> str:
    return "http://" + format_hostport(host, port)


# -- discovery and the client -----------------------------------------------------------------

Resolve = Callable[[str, int], Sequence[tuple[Any, ...]]]
Clock = Callable[[], float]


class Discovery:
    """The other daemons: the static list, or the addresses behind the headless Service
    (looked up every DNS_REFRESH seconds), without this node's own addresses."""

    def __init__(
        self, settings: PeerSettings, resolve: Resolve = socket.getaddrinfo,
        clock: Clock = time.monotonic, own: set[str] | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self._resolve = resolve
        self._clock = clock
        self._own = own if own is not None else _own_addresses(settings.listen[0])
        self._cached: list[str] = []
        self._resolved_at = float("-inf")

    def peers(self) -> list[str]:
        if self.settings.service is None:
            return [peer_url(h, p) for h, p in self.settings.static if not self._is_own(h, p)]
        if self._clock() - self._resolved_at >= DNS_REFRESH:
            self._resolved_at = self._clock()
            self._cached = self._lookup(*self.settings.service)
        return self._cached

    def _is_own(self, host: str, port: int) -> bool:
        return (host, port) == self.settings.listen or (
            host in self._own and port == self.settings.listen[1]
        )

    def _lookup(self, name: str, port: int) -> list[str]:
        try:
            infos = self._resolve(name, port)
        except OSError as e:
            log.warning("cannot resolve peer service %s (%s); keeping the last peers", name, e)
            return self._cached
        found = {(str(i[4][0]), int(i[4][1])) for i in infos}
        return sorted(peer_url(h, p) for h, p in found if h not in self._own)


def _own_addresses(listen_host: str) -> set[str]:
    own = set() if listen_host in _WILDCARDS else {listen_host}
    with contextlib.suppress(OSError):
        own |= {str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None)}
    return own


@dataclass(frozen=True)
class _Download:
    claim: Claim
    partial: Path
    size: int


class Peers:
    """This node's side of peer-to-peer: who holds a blob, who to avoid, what we download.

    Thread-safe. `node_id` lets the node recognise itself in a list of peers.
    """

    def __init__(
        self, settings: PeerSettings, discovery: Discovery | None = None,
        clock: Clock = time.monotonic, rng: random.Random | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.discovery = discovery or Discovery(settings)
        self.node_id = secrets.token_hex(8)
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._avoid: dict[str, float] = {}  # peer -> until (clock)
        self._self: set[str] = set()
        self._downloads: dict[str, _Download] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer-head")

    # -- what this node downloads (its server serves the written prefix) -----------------------

    def claim(self, sha256: str, partial: Path, size: int) -> Claim:
        """Announce that this node downloads the blob into `partial`, from now on."""
        claim = Claim(time.time(), secrets.randbits(63))
        with self._lock:
            self._downloads[sha256] = _Download(claim, partial, size)
        return claim

    def release(self, sha256: str, claim: Claim) -> None:
        with self._lock:
            d = self._downloads.get(sha256)
            if d is not None and d.claim == claim:
                del self._downloads[sha256]

    def downloading(self, sha256: str) -> _Download | None:
        with self._lock:
            return self._downloads.get(sha256)

    # -- finding a blob -----------------------------------------------------------------------

    def sources(self, sha256: str, size: int, own: Claim | None) -> list[Holding]:
        """Peers to download the blob from, best first (see `rank`); [] for the origin."""
        peers = [p for p in self.discovery.peers() if not self._skipped(p)]
        if not peers:
            return []
        try:
            found = list(self._pool.map(lambda p: self._head(p, sha256, size), peers))
        except RuntimeError:  # closed: the daemon is stopping
            return []
        with self._lock:
            return rank([h for h in found if h is not None], own, self._rng)

    def mark_bad(self, peer: str, why: str) -> None:
        """Avoid `peer` for BAD_PEER_SECONDS: it served bytes that did not verify."""
        log.warning("avoiding peer %s for %.0fs: %s", peer, BAD_PEER_SECONDS, why)
        self._avoid_for(peer, BAD_PEER_SECONDS)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _skipped(self, peer: str) -> bool:
        with self._lock:
            return peer in self._self or self._avoid.get(peer, float("-inf")) > self._clock()

    def _avoid_for(self, peer: str, seconds: float) -> None:
        with self._lock:
            until = self._clock() + seconds
            self._avoid[peer] = max(until, self._avoid.get(peer, until))

    def _head(self, peer: str, sha256: str, size: int) -> Holding | None:
        """Ask one peer about a blob; None if it does not hold it or does not answer."""
        url = peer.removeprefix("http://")
        conn = http.client.HTTPConnection(url, timeout=HEAD_TIMEOUT)
        auth = {"Authorization": f"Bearer {self.settings.token}"}
        try:
            conn.request("HEAD", f"/blobs/sha256/{sha256}", headers=auth)
            resp = conn.getresponse()
            resp.read()
        except (OSError, http.client.HTTPException) as e:
            log.debug("peer %s did not answer (%s)", peer, e)
            self._avoid_for(peer, DOWN_PEER_SECONDS)
            return None
        finally:
            conn.close()
        if resp.status in (401, 403):
            log.warning("peer %s refused our token (HTTP %d); give every daemon the same "
                        "--peer-token", peer, resp.status)  # fmt: skip
            self._avoid_for(peer, DOWN_PEER_SECONDS)
            return None
        if resp.getheader("X-Weightcache-Node") == self.node_id:
            with self._lock:
                self._self.add(peer)
            return None
        return _holding(peer, resp, size) if resp.status == 200 else None


def _holding(peer: str, resp: http.client.HTTPResponse, size: int) -> Holding | None:
    try:
        length = int(resp.getheader("Content-Length", "-1"))
        available = int(resp.getheader("X-Weightcache-Available", "0"))
        claim_text = resp.getheader("X-Weightcache-Claim")
        claim = Claim.parse(claim_text) if claim_text else None
    except ValueError:
        return None
    return Holding(peer, available, claim) if length == size else None


# -- the server -------------------------------------------------------------------------------

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
                f"cannot serve peers on {host}:{port} ({e.strerror}); choose a free --peer-addr"
            ) from e
        log.info("serving blobs to peers on %s:%d", *self.address)

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
        state = Layout.part_state(d.partial)
        return d.partial, d.size, partial_prefix(state, d.size), d.claim

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
