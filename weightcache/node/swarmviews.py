"""What a node's swarm download knows of its peers for one blob (design §8, Swarm): their
views (pieces held and in flight, uploads), the membership whose stripes split the store's
copy, and the peers to leave out for a while. The inputs `swarm.choose` takes from peers;
the download loop is weightcache/node/swarmfetch.py.

Views come from HEAD rounds (`refresh`, every VIEW_EVERY seconds, skipping peers that
answered a piece request since the last round: that answer carried the same headers) and
from every answer to a piece request (`heard`). A peer that asks this node about the blob
joins the membership at once (`joined`), before it claims anything, so that stripes agree.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from weightcache.node.peers import PIECES, parse_view
from weightcache.node.swarm import Bitmap, PeerView

if TYPE_CHECKING:
    from weightcache.node.peers import Peers

log = logging.getLogger(__name__)

VIEW_EVERY = 0.5  # seconds between HEAD rounds (an answer to a piece request stands for one)
MEMBER_TTL = 3.0  # seconds without an answer before a peer leaves the membership
SHUN_SECONDS = 2.0  # a peer that failed a piece is left out this long, or until it answers


class PeerViews:
    """The peers of one blob's swarm as this node sees them. Thread-safe."""

    def __init__(self, peers: Peers, sha256: str, size: int, piece_size: int) -> None:
        self.peers, self.sha256, self.size, self.piece_size = peers, sha256, size, piece_size
        self.count = -(-size // piece_size)
        self.lock = threading.Lock()
        #: Peers that hold or download the blob (they advertise pieces): with this node,
        #: the membership whose stripes split the store's copy.
        self.views: dict[str, PeerView] = {}
        self.heard_at: dict[str, float] = {}  # peer -> when it last answered anything
        self.answered_at: dict[str, float] = {}  # peer -> when it last answered a piece request
        self.shunned: dict[str, float] = {}  # peer -> until when it is left out
        self.refreshing = threading.Event()  # a HEAD round is running

    def current(self) -> tuple[list[PeerView], int, int]:
        """(the views of the peers not left out, this node's rank, the membership size)."""
        own, now = self.peers.own_url(), time.monotonic()
        with self.lock:
            views = [v for u, v in self.views.items() if self.shunned.get(u, 0.0) <= now]
            members = sorted(self.views.keys() | {own})
        return views, members.index(own), len(members)

    def alone(self) -> bool:
        with self.lock:
            return not self.views

    def refresh(self) -> None:
        """One HEAD round (call with `refreshing` set; it is cleared here)."""
        now = time.monotonic()
        with self.lock:
            fresh = frozenset(u for u, t in self.answered_at.items() if now - t < VIEW_EVERY)
        try:
            answers = self.peers.probe_all(self.sha256, fresh)
        except Exception:  # a view is an optimisation: never let it end the download
            log.exception("refreshing the swarm's view of %s", self.sha256)
            return
        finally:
            self.refreshing.clear()
        answered = {u for u, a in answers.items() if a is not None}
        with self.lock:
            now = time.monotonic()
            for url in answered:
                self.heard_at[url] = now
            # A peer stays a member until it has not answered for MEMBER_TTL: a HEAD that
            # timed out on a busy host must not reshuffle everyone's stripes.
            alive = {u for u, t in self.heard_at.items() if now - t < MEMBER_TTL}
            self.views = {u: v for u, v in self.views.items() if u in alive}
            self.shunned = {u: t for u, t in self.shunned.items()
                            if t > now and u not in answered}  # fmt: skip
        for url, answer in answers.items():
            if answer is not None:
                self.heard(url, answer[1])

    def heard(self, url: str, headers: Mapping[str, str], piece_answer: bool = False) -> None:
        """A peer's answer: its view, or (no pieces advertised: 404) none."""
        try:
            view: PeerView | None = parse_view(url, headers, self.size, self.piece_size)
        except ValueError as e:
            log.debug("peer %s advertised %s badly (%s)", url, self.sha256, e)
            view = None
        with self.lock:
            if piece_answer:
                self.heard_at[url] = self.answered_at[url] = time.monotonic()
            if view is None or PIECES not in headers:
                self.views.pop(url, None)
            else:
                self.views[url] = view

    def joined(self, peer: str) -> None:
        """A peer asked about the blob: a member from now on, holding nothing yet, until
        its own advertisement says more."""
        empty = Bitmap(self.count)
        with self.lock:
            self.views.setdefault(peer, PeerView(peer, empty, empty))

    def shun(self, peer: str) -> None:
        """Leave out a peer that failed a piece (cut, timed out) for SHUN_SECONDS."""
        with self.lock:
            self.shunned[peer] = time.monotonic() + SHUN_SECONDS
        self.peers.failed(peer)
