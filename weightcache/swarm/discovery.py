"""Which peers there are (design §8, Peers): the static list, or the addresses behind
the headless Service, without this node's own."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from weightcache.config import PeerSettings
from weightcache.swarm.wire import peer_url

log = logging.getLogger(__name__)


DNS_REFRESH = 5.0  # seconds between lookups of the Service name
WILDCARDS = ("", "0.0.0.0", "::")


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

    def last(self) -> list[str]:
        """The peers as of the last `peers()`, without a lookup: for the peer server's event
        loop, which a slow DNS must not stall."""
        return self.peers() if self.settings.service is None else self._cached

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
    own = set() if listen_host in WILDCARDS else {listen_host}
    with contextlib.suppress(OSError):
        own |= {str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None)}
    return own
