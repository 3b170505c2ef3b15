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
from typing import TYPE_CHECKING, Any, Protocol

from weightcache.config import PeerSettings, format_hostport
from weightcache.node.swarm import Bitmap
from weightcache.transfer.httprange import HttpRanges
from weightcache.transfer.sources import BlobSource, RangeReader

if TYPE_CHECKING:
    from weightcache.node.swarmfetch import Outcome
    from weightcache.transfer.ranged import RangedDownloader

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
#: The request header naming the asking peer's URL, so that a node downloading a blob
#: learns of a newcomer at its first HEAD, before the newcomer claims anything.
ASKER = "X-Weightcache-Peer"


class Live(Protocol):
    """A running swarm download (weightcache/node/swarmfetch.py), as its node's peer
    server sees it."""

    def pieces(self) -> tuple[int, Bitmap, Bitmap]:
        """(piece size, pieces written, pieces in flight)."""

    def joined(self, peer: str) -> None:
        """A peer asked about the blob: count it in the membership now."""


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
        self.own = frozenset(self._own)
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
        self._bad: dict[str, float] = {}  # peer -> until (clock): it served wrong bytes
        self._live: dict[str, Live] = {}  # blob -> what the swarm downloading it holds
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
        with self._lock:
            self._bad[peer] = self._clock() + BAD_PEER_SECONDS

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _skipped(self, peer: str, lying_only: bool = False) -> bool:
        with self._lock:
            avoid = (self._bad if lying_only else self._avoid).get(peer, float("-inf"))
            return peer in self._self or avoid > self._clock()

    def _avoid_for(self, peer: str, seconds: float) -> None:
        with self._lock:
            until = self._clock() + seconds
            self._avoid[peer] = max(until, self._avoid.get(peer, until))

    def _head(self, peer: str, sha256: str, size: int) -> Holding | None:
        """Ask one peer about a blob; None if it does not hold it or does not answer."""
        answer = self.probe(peer, sha256)
        if answer is None:
            self._avoid_for(peer, DOWN_PEER_SECONDS)
            return None
        status, headers = answer
        return _holding(peer, headers, size) if status == 200 else None

    def probe(self, peer: str, sha256: str) -> tuple[int, dict[str, str]] | None:
        """(status, headers) of one HEAD of the blob at `peer`; None if it did not answer,
        refused our token, or is this node itself (learnt from its node id)."""
        url = peer.removeprefix("http://")
        conn = http.client.HTTPConnection(url, timeout=HEAD_TIMEOUT)
        auth = {"Authorization": f"Bearer {self.settings.token}", ASKER: self.own_url()}
        try:
            conn.request("HEAD", f"/blobs/sha256/{sha256}", headers=auth)
            resp = conn.getresponse()
            resp.read()
        except (OSError, http.client.HTTPException) as e:
            log.debug("peer %s did not answer (%s)", peer, e)
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
        return resp.status, dict(resp.getheaders())

    # -- the swarm (weightcache/node/swarmfetch.py) -------------------------------------------

    def probe_all(
        self, sha256: str, skip: frozenset[str] = frozenset()
    ) -> dict[str, tuple[int, dict[str, str]] | None]:
        """`probe` of every peer discovered now but those in `skip`, this node and those
        avoided for lying, in parallel; {} once the daemon is stopping."""
        peers = [p for p in self.discovery.peers()
                 if p not in skip and not self._skipped(p, lying_only=True)]  # fmt: skip
        try:
            answers = list(self._pool.map(lambda p: self.probe(p, sha256), peers))
        except RuntimeError:  # closed: the daemon is stopping
            return {}
        return dict(zip(peers, answers, strict=True))

    def own_url(self) -> str:
        """This node's URL as its peers list it (for its rank in the membership)."""
        host, port = self.settings.listen
        if host in _WILDCARDS:
            host = min(self.discovery.own, default=host)
        return peer_url(host, port)

    def blob(
        self, peer: str, sha256: str, on_response: Callable[[http.client.HTTPResponse], None]
    ) -> PeerBlob:
        """The blob at `peer`, asking for held pieces only; `on_response` sees every
        response (its advertisement)."""
        return PeerBlob(self._http, peer, self.settings.token, sha256, held_only=True,
                        on_response=on_response)  # fmt: skip

    def advertise(self, sha256: str, live: Live) -> None:
        """Serve the pieces `live()` says are held (and advertise those in flight) while
        the swarm downloads the blob; without it the server reads the partial's state."""
        with self._lock:
            self._live[sha256] = live

    def unadvertise(self, sha256: str, live: Live) -> None:
        with self._lock:
            if self._live.get(sha256) is live:  # not a newer download's
                del self._live[sha256]

    def live(self, sha256: str) -> Live | None:
        with self._lock:
            return self._live.get(sha256)

    def asked_by(self, sha256: str, asker: str | None) -> None:
        """A peer request named its asker (ASKER): tell the blob's swarm download, if one
        runs, of a discovered peer (only those: the header is a hint, not an identity)."""
        live = self.live(sha256) if asker else None
        if live is not None and asker in self.discovery.peers():
            live.joined(asker)

    def swarm(
        self, sha256: str, size: int, partial: Path, label: str, origin: BlobSource,
        downloader: RangedDownloader,
    ) -> Outcome:  # fmt: skip
        """Download one blob piece by piece from the peers and the store into `partial`
        (weightcache/node/swarmfetch.py); the fetch layer sees only this method."""
        from weightcache.node.swarmfetch import SwarmDownload

        return SwarmDownload(self, sha256, size, partial, label, origin, downloader).run()


def _holding(peer: str, headers: dict[str, str], size: int) -> Holding | None:
    try:
        length = int(headers.get("Content-Length", "-1"))
        available = int(headers.get("X-Weightcache-Available", "0"))
        claim_text = headers.get("X-Weightcache-Claim")
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

    def __init__(
        self, ranges: HttpRanges, peer: str, token: str, sha256: str, held_only: bool = False,
        on_response: Callable[[http.client.HTTPResponse], None] | None = None,
    ) -> None:  # fmt: skip
        self._http, self._token = ranges, token
        self.peer, self.sha256 = peer, sha256
        self._held_only, self._on_response = held_only, on_response

    @property
    def where(self) -> str:
        return f"{self.peer}/blobs/sha256/{self.sha256}"

    def open_range(
        self, start: int, end: int, size: int, timeout: float
    ) -> contextlib.AbstractContextManager[RangeReader]:
        headers = {"Authorization": f"Bearer {self._token}"}
        if self._held_only:  # a piece it lacks is refused at once (416), not waited for
            headers["X-Weightcache-Held-Only"] = "1"
        return self._http.get(self.where, headers, start, end, size, timeout, self.where,
                              self._on_response)  # fmt: skip
