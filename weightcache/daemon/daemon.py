"""The node agent (design §5): its lifecycle, and the composition of its roles.

Each role is a class of its own module, testable alone:

- converger.py `Converger`: follow the models file, prefetch its revisions one at a time,
  pin the pinned ones; the one definition of a listed revision being ready;
- coordinator.py `Coordinator`: one download per revision for every caller
  (single-flight), and `FetchSocketHandler`, the daemon's side of the fetch socket;
- capacity.py `CapacityGuard`: evict under --capacity and --min-free, collect orphan blobs;
- leases.py `LeaseReaper`: end the leases of Pods that are gone;
- client.py: serve blobs to the other nodes' daemons and fetch from them (design §8).

The daemon holds `daemon.lock`, runs the listeners (the fetch socket, /metrics /healthz
/readyz, the peer port) on one event loop (http.py), and the two loops (converging;
ending leases and bounding capacity) as supervised workers (worker.py): a failing step is
logged and retried, and one that keeps failing, or dies, fails /healthz. One `Fetcher`
(so one token bucket for `--bwlimit` and one AIMD gate) serves both the prefetch and the
Pods' requests. SIGTERM stops new work, interrupts downloads (partials stay resumable)
and exits within the grace period.

Who holds credentials: the daemon downloads with its own (DaemonSet Secret or IRSA) for
every fetch it coordinates; a Pod's `fetch` uses its own only when it falls back to
fetching alone (no daemon, a daemon that does not answer, or one that refuses a source
outside its `--allow-source` prefixes: any Pod on the node can reach the socket, so the
daemon's credentials must not read whatever a Pod names).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from weightcache.cache.eviction import Watermarks
from weightcache.cache.index import for_cache
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache
from weightcache.config import (
    INTERVAL,
    KUBELET_PODS_DIR,
    MIN_FREE,
    Capacity,
    OriginSettings,
    PeerSettings,
    format_hostport,
)
from weightcache.daemon import coordinator
from weightcache.daemon.capacity import CapacityGuard
from weightcache.daemon.converger import Converger
from weightcache.daemon.coordinator import Coordinator, FetchSocketHandler
from weightcache.daemon.leases import LeaseReaper
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.models import DesiredState
from weightcache.daemon.worker import Worker
from weightcache.errors import UsageError, WeightcacheError
from weightcache.fetch import Fetcher, FetchResult
from weightcache.listeners import http as serve
from weightcache.listeners.admission import ConnectionLimits
from weightcache.smallfile import open_own
from weightcache.sourceurl import Source, SourcePrefix
from weightcache.swarm.entry import NodeSwarm
from weightcache.swarm.server import PeerServer

log = logging.getLogger(__name__)

#: The fetch socket: Pods waiting at once (a node runs at most ~110 Pods), and 5 s for the
#: request line, which `fetch` sends as soon as it connects (design §5, Bounds).
SOCKET_LIMITS = ConnectionLimits(connections=256, idle=5.0, header=5.0)
REQUEST_LINE_LIMIT = 64 << 10  # bytes; a request is ~300
#: Seconds the lease-and-capacity step (reap, evict: file renames and deletes) may run
#: before /healthz says it is stuck. The converge step has none: a download may take an
#: hour, and the downloader bounds its own stalls.
HOUSEKEEPING_STUCK_AFTER = 300.0
#: Leases or accesses in a row that state.db refused before /healthz says so.
UNRECORDED_UNHEALTHY = 3
#: /metrics, /healthz, /readyz: 64 scrapes at once and 8 probes apart (admission.PROBES), so
#: scrapers at their cap never fail liveness. The connections past those 72 hold the ones
#: whose request is not read yet, so a probe's is not closed to make room for scrapers'.
HTTP_LIMITS = ConnectionLimits(connections=256, idle=30.0, header=10.0, requests=64, probes=8)
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class DaemonSettings:
    models_file: Path
    capacity: Capacity | None = None  # None: only the disk bounds the cache (prefetch)
    min_free: Capacity = MIN_FREE  # free space the cache never takes (config.MIN_FREE)
    watermarks: Watermarks = field(default_factory=Watermarks)
    metrics_addr: tuple[str, int] | None = None
    #: The kubelet's pod directories (read-only hostPath): a lease ends when its Pod's
    #: directory is gone. Without it, leases end after `lease_max_age`.
    kubelet_pods_dir: Path = KUBELET_PODS_DIR
    lease_max_age: float = 24 * 3600.0
    #: How often to look at the models file, leases and capacity.
    interval: float = INTERVAL
    node_name: str | None = None  # set to label the node (needs RBAC, see daemonset/)
    grace: float = 25.0  # seconds to wind down after SIGTERM, within the Pod's grace period
    peer: PeerSettings | None = None  # serve and fetch blobs between nodes (design §8)
    #: Where the daemon fetches for Pods (`--allow-source`); None: under the parent of
    #: every source of the models file (any revision of a listed model).
    allow_sources: tuple[SourcePrefix, ...] | None = None
    #: Fetch only bytes a sha256 verifies (`--require-sha256`); a models-file entry's
    #: `require_sha256` asks it for that revision alone.
    require_sha256: bool = False


class Daemon:
    """The node agent: composes the roles and runs them for the life of the process.

    The roles, each testable alone: `Converger` (the models file, prefetch, readiness),
    `Coordinator` and its `FetchSocketHandler` (single-flight fetches, the Pods' socket),
    `CapacityGuard` (eviction under --capacity and --min-free, orphan blobs), `LeaseReaper`
    (leases of Pods that are gone). The daemon itself owns the lifecycle: `daemon.lock`,
    the listeners (socket, metrics/health HTTP, peers) on one event loop, the supervised
    worker loops, and SIGTERM (`stop`).

    Contract of `run()`: UsageError (exit 2) before serving anything when another daemon
    holds the cache dir, the models file is missing or invalid, or a port is taken; then
    serves until `stop()`, and returns within `grace` seconds of it.
    """

    def __init__(self, layout: Layout, store_settings: OriginSettings, settings: DaemonSettings):
        self.layout = layout
        self.settings = settings
        self.stopping = threading.Event()
        self.metrics = Metrics()
        self.metrics.max_concurrency.set(store_settings.max_concurrency)
        self.cache = Cache(layout)
        self.index = for_cache(layout)
        self.peers = (
            NodeSwarm(settings.peer, on_bad=self.metrics.peer_marked_bad)
            if settings.peer is not None
            else None
        )
        self.capacity = CapacityGuard(
            self.cache,
            self.index,
            self.metrics,
            capacity=settings.capacity,
            min_free=settings.min_free,
            watermarks=settings.watermarks,
            pinned=lambda: self.converger.desired.pinned,
        )
        self.fetcher = Fetcher(
            layout,
            store_settings,
            observer=self.metrics,
            reserve=self.capacity.make_room,
            peers=self.peers,
        )
        self.coordinator = Coordinator(
            self._fetch, self.cache, self.index, self.metrics, self.stopping
        )
        self.converger = Converger(
            settings.models_file,
            self.cache,
            self.index,
            self.metrics,
            self.coordinator.wait,
            self.stopping,
            settings.node_name,
            settings.require_sha256,
        )
        self.leases = LeaseReaper(self.index, settings.kubelet_pods_dir, settings.lease_max_age)
        handler = FetchSocketHandler(
            self.coordinator, settings.allow_sources, lambda: self.converger.desired
        )
        self._socket = coordinator.SocketServer(
            layout.socket, handler.handle_line, SOCKET_LIMITS, REQUEST_LINE_LIMIT
        )
        self._loop: serve.LoopThread | None = None
        self._http: list[serve.HttpServer] = []  # the metrics port, the peer port
        self._dir_lock: int | None = None
        self._workers: list[Worker] = []

    def _fetch(self, source: Source, pod_uid: str | None) -> FetchResult:
        key = (source.name, source.revision)
        strict = self.settings.require_sha256 or any(
            m.require_sha256
            for m in self.converger.desired.models
            if (m.source.name, m.source.revision) == key
        )
        result = self.fetcher.fetch(source, pod_uid, require_sha256=strict)
        self.capacity.measure()
        return result

    # -- what `prefetch` uses: converge once, without serving --------------------------------

    @property
    def desired(self) -> DesiredState:
        return self.converger.desired

    @property
    def failures(self) -> dict[tuple[str, str], WeightcacheError]:
        return self.converger.failures

    def load_models(self) -> None:
        self.converger.load()

    def converge_once(self) -> None:
        """Converge once, as `prefetch` does: a failure is not retried (the process exits)."""
        self.converger.converge_once(retries=False)

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stopping` is set (SIGTERM). Raises UsageError before serving
        anything when another daemon holds the cache dir (checked before touching it), the
        models file is missing or invalid, or a port is taken."""
        self._dir_lock = hold_cache_dir(self.layout)
        self.load_models()  # before /readyz answers: it must not say ready for an empty list
        serve.raise_fd_limit()
        self.cache.clean_tmp()
        self._loop = serve.LoopThread()
        self._loop.run(self._listen())
        self._loop.run(self._socket.start())
        log.info("coordinating fetches on %s", self.layout.socket)
        interval = self.settings.interval
        self._workers = [
            Worker("converge", self.converge_step, interval, self.stopping),
            Worker(
                "lease and capacity",
                self.housekeeping_step,
                interval,
                self.stopping,
                stuck_after=HOUSEKEEPING_STUCK_AFTER,
            ),
        ]
        for worker in self._workers:
            worker.start()
        self.stopping.wait()  # until stop(): SIGTERM calls it from a thread (cli/signals.py)
        self._shutdown()

    def converge_step(self) -> None:
        """Follow the models file; bound the capacity after converging."""
        self.converger.step(then=self.capacity.enforce)

    def housekeeping_step(self) -> None:
        self.converger.restore_pins()
        self.leases.reap()
        self.capacity.enforce()

    async def _listen(self) -> None:
        """The peer port and the metrics port, on the loop; UsageError if one is taken."""
        if self.peers is not None and self.settings.peer is not None:
            server = PeerServer(
                self.settings.peer, self.layout, self.peers, self.metrics, self.stopping
            )
            await server.start()
            self._http.append(server.http)
        if self.settings.metrics_addr is not None:
            http = serve.HttpServer(serve.page_handler(self._pages()), HTTP_LIMITS)
            host, port = self.settings.metrics_addr
            try:
                bound = await http.start(host, port)
            except OSError as e:
                where = format_hostport(host, port)
                raise UsageError(
                    f"cannot serve metrics on {where} ({e.strerror}); choose a free --metrics-addr"
                ) from e
            self._http.append(http)
            log.info("metrics on http://%s/metrics", format_hostport(*bound))

    def stop(self) -> None:
        """Ask `run()` to return (safe from a signal handler): no new work, downloads
        interrupted at their next read, partial files kept resumable."""
        self.stopping.set()
        self.fetcher.interrupt()

    def _shutdown(self) -> None:
        """The socket closes first, without a last answer: the Pods waiting on it fall back
        to fetching alone at once, rather than fail or wait for us."""
        log.info("stopping: no new work, downloads interrupted, partial files kept")
        assert self._loop is not None
        self._loop.run(self._socket.close())
        deadline = time.monotonic() + self.settings.grace
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for http in self._http:
            self._loop.run(http.close())
        self._loop.stop()
        self.coordinator.shutdown()
        if self.peers is not None:
            self.peers.close()

    # -- health and readiness: /healthz, /readyz, /metrics -------------------------------------

    def health_problem(self) -> str | None:
        """None while the daemon can do its job, else one line saying what is wrong
        (the /healthz contract: a 503 with that line): a worker died, keeps failing or is
        stuck, or the index keeps refusing to record leases (without them a running Pod's
        revision could be evicted)."""
        for worker in self._workers:
            problem = worker.problem()
            if problem is not None:
                return problem
        if self.index.unrecorded >= UNRECORDED_UNHEALTHY:
            return (
                f"{self.index.path} refused the last {self.index.unrecorded} leases or "
                f"accesses ({self.index.unrecorded_error}); restart the daemon, or check "
                "the disk if that does not help"
            )
        return None

    def serving(self) -> bool:
        """The /readyz contract: the daemon serves (models file loaded, fetch socket and
        HTTP up, not stopping), whatever it is still downloading. Waiting for pinned
        revisions made every models-file change mark the fleet NotReady for the download,
        and one unfetchable pin keep it NotReady for good (design §5); pinned
        progress is `weightcache_revision_ready{pinned="true"}` and its alert instead."""
        return self._socket.listening and not self.stopping.is_set()

    def _pages(self) -> dict[str, serve.Page]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        def metrics() -> tuple[int, bytes, str]:
            self.coordinator.count_fetches()
            self.converger.export_readiness()
            self.capacity.measure_disk()
            return 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST

        return {"/metrics": metrics, "/healthz": self._healthz, "/readyz": self._readyz}

    def _healthz(self) -> tuple[int, bytes, str]:
        problem = self.health_problem()
        return (200, b"ok\n", TEXT) if problem is None else (503, f"{problem}\n".encode(), TEXT)

    def _readyz(self) -> tuple[int, bytes, str]:
        """200 while serving; the body also names pinned revisions still missing, for a
        human at `curl` (the status does not depend on them)."""
        if not self.serving():
            what = "stopping" if self.stopping.is_set() else "the fetch socket is not up yet"
            return 503, f"not serving: {what}\n".encode(), TEXT
        missing = self.converger.pinned_missing()
        body = "ready"
        if missing:  # the cache's state, not the daemon's: "not yet ready" read as a contradiction
            body += "; pinned revisions not cached yet: " + " ".join(missing)
        return 200, (body + "\n").encode(), TEXT


def hold_cache_dir(layout: Layout) -> int:
    """flock the cache dir's daemon lock for the life of the process (the fd stays open;
    the kernel releases it on any exit). Raises UsageError naming the holder's pid: two
    daemons on one cache dir would take each other's socket and partials (design §5)."""
    fd = open_own(layout.daemon_lock)  # it is truncated: never through a planted symlink
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise UsageError(
            f"another weightcache daemon{pid} holds the cache directory {layout.root}; run "
            "one daemon per cache directory: stop that one or give this one another --cache-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
