"""The daemon's Prometheus metrics (design §6) and the observer that feeds them.

The early-warning signal is `weightcache_get_concurrency_per_replica`: object-store GETs
in flight from this node divided by the fetches running on it, both counting every fetch
of the cache dir: the Pods waiting on the daemon, the daemon's own downloads, and the
fetches downloading alone (registered in the cache dir, weightcache/cache/alone.py). During a
scale-out it stays at most max-concurrency / waiting-replicas when fetches coalesce, and
drops to 0 as replicas find the node warm; if it does not fall, every replica is pulling
the weights. `weightcache_max_concurrency` and `weightcache_downloads_inflight` let a
rule normalise it (daemonset/prometheusrule.yaml).

The swarm (design §8) is read from `weightcache_bytes{source}` (origin against peer: the
store's share), `weightcache_peer_upload_bytes` (every node should upload, not one),
`weightcache_pieces_inflight{source}` and `weightcache_peers_marked_bad{reason}`.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from weightcache.swarm.wire import REFUSAL_REASONS

disable_created_metrics()  # type: ignore[no-untyped-call]  # the *_created series only add noise to every scrape

#: Fetch durations range from a hit in milliseconds to hours for a cold model on a shared
#: link; buckets stopping within a minute would hide the slow tail that matters.
DURATION_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1200,
    1800,
    3600,
    7200,
    14400,
    28800,
)

#: Why a peer is avoided: its bytes did not verify; it did not answer; it refused our token.
BAD_PEER_REASONS = ("wrong_bytes", "unreachable", "bad_token")
#: The sources of a download's bytes (`TransferObserver`'s `source`).
DOWNLOAD_SOURCES = ("origin", "peer")


class Metrics:
    """All metrics on one registry; also a TransferObserver for the daemon's downloads."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.origin_get_inflight = Gauge(
            "weightcache_origin_get_inflight",
            "Object-store GETs in flight from this node's cache dir: the daemon's and those "
            "of fetches downloading alone.",
            registry=r,
        )
        self.replica_fetches_inflight = Gauge(
            "weightcache_replica_fetches_inflight",
            "`weightcache fetch` processes running on this node's cache dir: Pods waiting on "
            "the daemon plus fetches alone.",
            registry=r,
        )
        self.alone_inflight = Gauge(
            "weightcache_fetches_alone_inflight",
            "Fetches on this node's cache dir running without the daemon (--no-daemon, a "
            "refused source, a daemon that did not answer); included in "
            "replica_fetches_inflight.",
            registry=r,
        )
        self.alone_get_inflight = Gauge(
            "weightcache_fetches_alone_origin_get_inflight",
            "Object-store GETs in flight of fetches alone; included in origin_get_inflight.",
            registry=r,
        )
        self.downloads_inflight = Gauge(
            "weightcache_downloads_inflight",
            "Distinct revisions being fetched on this node, by the daemon or alone.",
            registry=r,
        )
        self.copies_inflight = Gauge(
            "weightcache_copies_inflight",
            "Copies of revisions downloading on this node's cache dir: one per revision the "
            "daemon fetches, plus one per fetch alone that has had object-store GETs. Above "
            "downloads_inflight, some revision is downloaded more than once.",
            registry=r,
        )
        self.max_concurrency = Gauge(
            "weightcache_max_concurrency",
            "The daemon's --max-concurrency: object-store GETs one download uses at most.",
            registry=r,
        )
        self.ratio = Gauge(
            "weightcache_get_concurrency_per_replica",
            "origin_get_inflight / replica_fetches_inflight (0 when no fetch runs).",
            registry=r,
        )
        self.ratio.set_function(self._ratio)
        self.fetches = Counter(
            "weightcache_fetches", "Fetches by result (hit, miss, error).", ["result"], registry=r
        )
        self.bytes = Counter(
            "weightcache_bytes",
            "Bytes by where they came from: origin (received from the object store), peer "
            "(received from another node), local (already on this node: hits and linked "
            "blobs). Received bytes include any a retry or a losing second copy threw away.",
            ["source"],
            registry=r,
        )
        self.throttles = Counter(
            "weightcache_origin_throttled",
            "Object-store answers asking to slow down (503/429), to the daemon and to the "
            "fetches alone on this node's cache dir.",
            registry=r,
        )
        self.verify_failures = Counter(
            "weightcache_verify_failures",
            "Downloads whose sha256 did not match the manifest.",
            registry=r,
        )
        self.evictions = Counter(
            "weightcache_evictions", "Revisions evicted to stay under capacity.", registry=r
        )
        self.cache_bytes = Gauge(
            "weightcache_cache_bytes", "Bytes the cache occupies (blobs and partials).", registry=r
        )
        self.capacity_bytes = Gauge(
            "weightcache_cache_capacity_bytes", "The capacity bound in bytes.", registry=r
        )
        self.disk_free_bytes = Gauge(
            "weightcache_disk_free_bytes",
            "Free bytes on the cache's disk, as an unprivileged writer sees them.",
            registry=r,
        )
        self.min_free_bytes = Gauge(
            "weightcache_min_free_bytes",
            "The --min-free floor in bytes: free space the cache never takes from its disk.",
            registry=r,
        )
        self.duration = Histogram(
            "weightcache_fetch_duration_seconds",
            "Time from fetch request to ready.",
            ["result"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ready = Gauge(
            "weightcache_revision_ready",
            "1 when a revision of the models file is ready on this node, 0 until then; "
            'pinned="true" for pinned ones (readiness does not wait for them: alert on '
            "this instead).",
            ["name", "revision", "pinned"],
            registry=r,
        )
        self.peer_upload_bytes = Counter(
            "weightcache_peer_upload_bytes",
            "Blob bytes this node served to other nodes' daemons.",
            registry=r,
        )
        self.peer_streamed_bytes = Counter(
            "weightcache_peer_streamed_bytes",
            "Of the bytes served to other nodes' daemons, those passed on while they arrived "
            "from the object store (cut-through).",
            registry=r,
        )
        self.peer_refusals = Counter(
            "weightcache_peer_requests_refused",
            "Peer requests refused, by reason: no_token, bad_token, bad_path, not_found, "
            "bad_range, method, busy.",
            ["reason"],
            registry=r,
        )
        self.pieces_inflight = Gauge(
            "weightcache_pieces_inflight",
            "Requests (pieces, or parts of a blob) this daemon's downloads have in flight, by "
            "source: origin (the object store) or peer.",
            ["source"],
            registry=r,
        )
        self.peers_marked_bad = Counter(
            "weightcache_peers_marked_bad",
            "Times this node started avoiding a peer, by reason: wrong_bytes (its bytes did "
            "not verify), unreachable (it did not answer), bad_token (it refused our token).",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.peer_refusals.labels(reason)
        for reason in BAD_PEER_REASONS:
            self.peers_marked_bad.labels(reason)
        for source in DOWNLOAD_SOURCES:
            self.pieces_inflight.labels(source)
        for result in ("hit", "miss", "error"):
            self.fetches.labels(result)
        for source in ("origin", "peer", "local"):
            self.bytes.labels(source)
        self._lock = threading.Lock()
        self._gets = 0  # the daemon's own
        self._replicas = 0  # waiting on the daemon
        self._alone = (0, 0)  # fetches alone, their GETs

    def _ratio(self) -> float:
        with self._lock:
            replicas = self._replicas + self._alone[0]
            return (self._gets + self._alone[1]) / replicas if replicas > 0 else 0.0

    def _publish(self) -> None:
        """Set the node-wide gauges from the counts (the caller holds `_lock`)."""
        fetches, gets = self._alone
        self.origin_get_inflight.set(self._gets + gets)
        self.replica_fetches_inflight.set(self._replicas + fetches)
        self.alone_inflight.set(fetches)
        self.alone_get_inflight.set(gets)

    def replica_waiting(self, delta: int) -> None:
        """A Pod's fetch started (+1) or ended (-1) waiting on this node."""
        with self._lock:
            self._replicas += delta
            self._publish()

    def fetches_alone(self, fetches: int, gets: int) -> None:
        """The fetches running alone on the cache dir now, and their GETs in flight."""
        with self._lock:
            self._alone = (fetches, gets)
            self._publish()

    # -- TransferObserver -----------------------------------------------------------------------

    def expect(self, nbytes: int) -> None:
        pass

    def request_started(self, source: str) -> None:
        self.pieces_inflight.labels(source).inc()
        if source != "origin":
            return
        with self._lock:
            self._gets += 1
            self._publish()

    def request_finished(self, source: str) -> None:
        self.pieces_inflight.labels(source).dec()
        if source != "origin":
            return
        with self._lock:
            self._gets -= 1
            self._publish()

    def received(self, nbytes: int, source: str) -> None:
        self.bytes.labels(source).inc(nbytes)

    def throttled(self) -> None:
        self.throttles.inc()

    def verify_failed(self) -> None:
        self.verify_failures.inc()

    # -- ServedObserver (the peer server) -------------------------------------------------------

    def peer_uploaded(self, nbytes: int) -> None:
        self.peer_upload_bytes.inc(nbytes)

    def peer_streamed(self, nbytes: int) -> None:
        self.peer_streamed_bytes.inc(nbytes)

    def peer_refused(self, reason: str) -> None:
        self.peer_refusals.labels(reason).inc()

    # -- the swarm's peer bookkeeping -------------------------------------------------------------

    def peer_marked_bad(self, reason: str) -> None:
        """This node started avoiding a peer. Raises ValueError for a reason not in
        BAD_PEER_REASONS (a typo would otherwise make a series no dashboard reads)."""
        if reason not in BAD_PEER_REASONS:
            raise ValueError(f"unknown reason {reason!r} for a bad peer: {BAD_PEER_REASONS}")
        self.peers_marked_bad.labels(reason).inc()
