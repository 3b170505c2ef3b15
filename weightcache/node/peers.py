"""Peer-to-peer blob sharing between node daemons (design §8): discovery and the client.

The peers' server is weightcache/node/peerserver.py: `GET|HEAD /blobs/sha256/<64 hex>` with
`Authorization: Bearer <token>`, serving complete blobs and the written prefix of blobs the
node is downloading. Here: which peers there are (`Discovery`), which of them hold a blob
(`Peers.sources`, one HEAD each), and each of those as a `BlobSource` (`PeerBlob`) that the
fetch tries before the origin.

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

import contextlib
import http.client
import logging
import random
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.config import PeerSettings, format_hostport
from weightcache.transfer.httprange import HttpRanges
from weightcache.transfer.sources import RangeReader

log = logging.getLogger(__name__)

#: The peer protocol's one path, and the reasons its server refuses a request (metric labels).
BLOB_PATH = re.compile(r"/blobs/sha256/([0-9a-f]{64})")
REFUSAL_REASONS = ("no_token", "bad_token", "bad_path", "not_found", "bad_range", "not_held",
                   "method", "busy")  # fmt: skip
HEAD_TIMEOUT = 1.0  # a peer that cannot answer a HEAD in a second is not worth waiting for
#: Failed requests to one peer without progress before the blob goes to the next source.
PEER_ATTEMPTS = 3
BAD_PEER_SECONDS = 600.0  # a peer that served wrong bytes is not asked again for this long
DOWN_PEER_SECONDS = 10.0  # nor one that did not answer, for this long
DNS_REFRESH = 5.0  # seconds between lookups of the Service name
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
        self._http = HttpRanges()  # the downloads' connections to peers, one per worker

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

    def sources(self, sha256: str, size: int, own: Claim | None) -> list[PeerBlob]:
        """The blob on the peers to download it from, best first (see `rank`); [] when no
        peer has it (the origin's turn)."""
        peers = [p for p in self.discovery.peers() if not self._skipped(p)]
        if not peers:
            return []
        try:
            found = list(self._pool.map(lambda p: self._head(p, sha256, size), peers))
        except RuntimeError:  # closed: the daemon is stopping
            return []
        with self._lock:
            ranked = rank([h for h in found if h is not None], own, self._rng)
        return [PeerBlob(self._http, h.peer, self.settings.token, sha256) for h in ranked]

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


class PeerBlob:
    """A blob on one peer, as a BlobSource: `GET /blobs/sha256/<hex>` with the token.

    A peer is given up on after PEER_ATTEMPTS failures without progress (the fetch then
    tries the next source), and its 503 means "busy", not "slow down": it does not lower
    the download's concurrency, which the origin's throttling governs."""

    kind = "peer"
    attempts: int | None = PEER_ATTEMPTS
    throttles = False

    def __init__(self, http: HttpRanges, peer: str, token: str, sha256: str) -> None:
        self._http, self._token = http, token
        self.peer, self.sha256 = peer, sha256

    @property
    def where(self) -> str:
        return f"{self.peer}/blobs/sha256/{self.sha256}"

    def open_range(
        self, start: int, end: int, size: int, timeout: float
    ) -> contextlib.AbstractContextManager[RangeReader]:
        auth = {"Authorization": f"Bearer {self._token}"}
        return self._http.get(self.where, auth, start, end, size, timeout, self.where)
