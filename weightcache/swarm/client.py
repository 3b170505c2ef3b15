"""This node's side of peer-to-peer (design §8): what it downloads (`Peers.claim`:
its server then serves the pieces of the partial), what the peers advertise
(`Peers.probe_all`, one HEAD each), the peers to avoid (`Peers.mark_bad`: a peer whose
pieces differ from the store's is not asked again for a while), and a blob on a peer
as a `BlobSource` (`PeerBlob`) for the swarm's piece requests
(weightcache/swarm/download.py). The peers' server is weightcache/swarm/server.py.

Nothing a peer sends is trusted: the receiver hashes every blob and publishes it only
if its sha256 is the manifest's, exactly as for the store."""

from __future__ import annotations

import contextlib
import http.client
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weightcache.config import PeerSettings
from weightcache.swarm.discovery import WILDCARDS, Clock, Discovery
from weightcache.swarm.pieces import Bitmap
from weightcache.swarm.wire import ASKER, HELD_ONLY, peer_url
from weightcache.transfer.httpclient import HttpRanges
from weightcache.transfer.sources import RangeReader

log = logging.getLogger(__name__)


HEAD_TIMEOUT = 1.0  # a peer that cannot answer a HEAD in a second is not worth waiting for
BAD_PEER_SECONDS = 600.0  # a peer that served wrong bytes is not asked again for this long
DOWN_PEER_SECONDS = 10.0  # nor one that refused our token, for this long


@dataclass(frozen=True)
class Claim:
    """One download of a blob by this node (`Peers.claim`): only that download releases it."""

    nonce: int


class Live(Protocol):
    """A running swarm download (weightcache/swarm/download.py), as its node's peer
    server sees it."""

    def pieces(self) -> tuple[int, Bitmap, Bitmap, Bitmap]:
        """(piece size, pieces written, pieces in flight, those of them streamed)."""

    def streamed(self, piece: int, offset: int, limit: int, at_least: int) -> bytes | None:
        """Up to `limit` bytes of `piece` from `offset` (in the piece) as they arrived from
        the store so far; b"" while fewer than `at_least` have; None once the piece is not
        streamed (written, or its request ended)."""

    def joined(self, peer: str) -> None:
        """A peer asked about the blob: count it in the membership now."""


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
        clock: Clock = time.monotonic, on_bad: Callable[[str], None] = lambda reason: None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self._on_bad = on_bad  # told why (metrics' BAD_PEER_REASONS) each time a peer is avoided
        self.discovery = discovery or Discovery(settings)
        self.node_id = secrets.token_hex(8)
        self._clock = clock
        self._lock = threading.Lock()
        self._avoid: dict[str, float] = {}  # peer -> until (clock)
        self._live: dict[str, Live] = {}  # blob -> what the swarm downloading it holds
        self._self: set[str] = set()
        self._downloads: dict[str, _Download] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer-head")
        self._http = HttpRanges()  # the downloads' connections to peers, one per worker
        self._kept: dict[str, http.client.HTTPConnection] = {}  # peer -> idle HEAD connection
        self._closed = False

    # -- what this node downloads (its server serves the written prefix) -----------------------

    def claim(self, sha256: str, partial: Path, size: int) -> Claim:
        """Announce that this node downloads the blob into `partial`, from now on."""
        claim = Claim(secrets.randbits(63))
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

    def mark_bad(self, peer: str, why: str) -> None:
        """Avoid `peer` for BAD_PEER_SECONDS: it served bytes that did not verify."""
        log.warning("avoiding peer %s for %.0fs: %s", peer, BAD_PEER_SECONDS, why)
        self._avoid_for(peer, BAD_PEER_SECONDS)
        self._on_bad("wrong_bytes")

    def failed(self, peer: str) -> None:
        """`peer` cut or stalled a piece request (the swarm leaves it out for a moment)."""
        log.debug("peer %s failed a piece request", peer)
        self._on_bad("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._forget_connections()

    def _skipped(self, peer: str) -> bool:
        with self._lock:
            return peer in self._self or self._avoid.get(peer, float("-inf")) > self._clock()

    def _avoid_for(self, peer: str, seconds: float) -> None:
        with self._lock:
            until = self._clock() + seconds
            self._avoid[peer] = max(until, self._avoid.get(peer, until))

    def probe(self, peer: str, sha256: str) -> tuple[int, dict[str, str]] | None:
        """(status, headers) of one HEAD of the blob at `peer`; None if it did not answer,
        refused our token, or is this node itself (learnt from its node id)."""
        auth = {"Authorization": f"Bearer {self.settings.token}", ASKER: self.own_url()}
        try:
            resp = self._head(peer, f"/blobs/sha256/{sha256}", auth)
        except (OSError, http.client.HTTPException) as e:
            log.debug("peer %s did not answer (%s)", peer, e)
            return None
        if resp.status in (401, 403):
            log.warning("peer %s refused our token (HTTP %d); give every daemon the same "
                        "--peer-token", peer, resp.status)  # fmt: skip
            self._avoid_for(peer, DOWN_PEER_SECONDS)
            self._on_bad("bad_token")
            return None
        if resp.getheader("X-Weightcache-Node") == self.node_id:
            with self._lock:
                self._self.add(peer)
            return None
        return resp.status, dict(resp.getheaders())

    def _head(self, peer: str, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """One HEAD on the connection kept to `peer` (a probe round asks every peer twice a
        second: a connection per HEAD cost both ends a connect, an accept and a close). A
        second HEAD to the same peer at once gets a connection of its own. A kept
        connection the peer closed meanwhile (its idle timeout) is retried once on a new
        one; a timeout is not (the peer is slow, not gone)."""
        with self._lock:
            conn = self._kept.pop(peer, None)
        reused = conn is not None
        while True:
            if conn is None:
                conn = http.client.HTTPConnection(peer.removeprefix("http://"),
                                                  timeout=HEAD_TIMEOUT)  # fmt: skip
            try:
                conn.request("HEAD", path, headers=headers)
                resp = conn.getresponse()
                resp.read()
                break
            except ConnectionError:
                conn.close()
                if not reused:
                    raise
                conn, reused = None, False
            except BaseException:
                conn.close()
                raise
        with self._lock:
            if resp.will_close or self._closed or peer in self._kept:
                conn.close()
            else:
                self._kept[peer] = conn
        return resp

    def _forget_connections(self, keep: Sequence[str] = ()) -> None:
        """Close the kept connections of peers not in `keep` (gone from discovery)."""
        wanted = set(keep)
        with self._lock:
            gone = [p for p in self._kept if p not in wanted]
            conns = [self._kept.pop(p) for p in gone]
        for conn in conns:
            conn.close()

    # -- the swarm (weightcache/swarm/download.py) -------------------------------------------

    def probe_all(
        self, sha256: str, skip: frozenset[str] = frozenset(), within: Collection[str] = ()
    ) -> dict[str, tuple[int, dict[str, str]] | None]:
        """`probe` of every peer discovered now (of those in `within`, if given) but those
        in `skip`, this node and those avoided (lying, or refusing our token), in parallel;
        {} once the daemon stops."""
        known = self.discovery.peers()
        self._forget_connections(keep=known)
        peers = [p for p in known if (not within or p in within) and p not in skip
                 and not self._skipped(p)]  # fmt: skip
        try:
            answers = list(self._pool.map(lambda p: self.probe(p, sha256), peers))
        except RuntimeError:  # closed: the daemon is stopping
            return {}
        return dict(zip(peers, answers, strict=True))

    def own_url(self) -> str:
        """This node's URL as its peers list it (for its rank in the membership)."""
        host, port = self.settings.listen
        if host in WILDCARDS:
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
        if live is not None and asker in self.discovery.last():
            live.joined(asker)


class PeerBlob:
    """A blob on one peer, as a BlobSource: `GET /blobs/sha256/<hex>` with the token.

    The swarm asks a peer for one piece at a time and re-chooses a piece that failed, so
    tries the next source), and its 503 means "busy", not "slow down": it does not lower
    the download's concurrency, which the origin's throttling governs."""

    kind = "peer"
    attempts: int | None = 1
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
            headers[HELD_ONLY] = "1"
        return self._http.get(self.where, headers, start, end, size, timeout, self.where,
                              on_response=self._on_response)  # fmt: skip
