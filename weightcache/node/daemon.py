"""The node agent (design §5): converge to the models file, bound the cache, coordinate fetches.

One `Fetcher` (so one token bucket for `--bwlimit` and one AIMD gate) serves both the
prefetch loop and the Pods' `fetch` requests arriving on the Unix socket; requests for the
same revision share one download (single-flight). Revisions are prefetched one at a time.
Capacity is enforced after every change and before every download. SIGTERM stops new
work, interrupts downloads (partials stay resumable) and exits within the grace period.

Peers (design §8, `--peer-addr`): the daemon serves its blobs to the other nodes' daemons
and, for the fetches it runs, asks them before the origin (weightcache/node/peers.py).

Who holds credentials: the daemon downloads with its own (DaemonSet Secret or IRSA) for
every fetch it coordinates; a Pod's `fetch` uses its own only when it falls back to
fetching alone (no daemon, a daemon that does not answer, or one that refuses a source
outside its `--allow-source` prefixes: any Pod on the node can reach the socket, so the
daemon's credentials must not read whatever a Pod names).

Its loops (converging to the models file; ending leases and bounding capacity) run as
supervised workers (weightcache/node/worker.py): a failing step is logged and retried, and
one that keeps failing, or dies, fails /healthz.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightcache.cache import alone, eviction
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
    Source,
    SourcePrefix,
    parse_pod_uid,
)
from weightcache.errors import NoSpaceError, UsageError, WeightcacheError
from weightcache.fetch import Fetcher, FetchResult
from weightcache.node import coord, labels, serve
from weightcache.node.metrics import Metrics
from weightcache.node.models import DesiredState, load
from weightcache.node.peers import Peers, PeerServer
from weightcache.node.worker import Worker, backoff
from weightcache.progress import human

log = logging.getLogger(__name__)

#: The fetch socket: Pods waiting at once (a node runs at most ~110 Pods), and 5 s for the
#: request line, which `fetch` sends as soon as it connects (design §5, Bounds).
SOCKET_LIMITS = serve.Limits(connections=256, idle=5.0, header=5.0)
REQUEST_LINE_LIMIT = 64 << 10  # bytes; a request is ~300
#: /metrics, /healthz, /readyz: a scraper and the kubelet's probes.
HTTP_LIMITS = serve.Limits(connections=64, idle=30.0, header=10.0)
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


#: A models entry that failed is retried after ENTRY_RETRY x 2**(n-1) s, at most ENTRY_RETRY_MAX.
ENTRY_RETRY = 10.0
ENTRY_RETRY_MAX = 300.0


class Daemon:
    def __init__(self, layout: Layout, store_settings: OriginSettings, settings: DaemonSettings):
        self.layout = layout
        self.settings = settings
        self.metrics = Metrics()
        self.metrics.max_concurrency.set(store_settings.max_concurrency)
        self.cache = Cache(layout)
        self.index = for_cache(layout)
        self._pins_generation = -1  # the index generation our pins were written to
        self.peers = Peers(settings.peer) if settings.peer is not None else None
        self.fetcher = Fetcher(
            layout, store_settings, observer=self.metrics, reserve=self.make_room, peers=self.peers
        )
        self.desired = DesiredState(())
        self.stopping = threading.Event()
        self._inflight: dict[tuple[str, str, str], Future[FetchResult]] = {}
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fetch")
        self._loop: serve.LoopThread | None = None
        self._socket = serve.SocketServer(layout.socket, self.handle_line, SOCKET_LIMITS,
                                          REQUEST_LINE_LIMIT)  # fmt: skip
        self._http: list[serve.HttpServer] = []  # the metrics port, the peer port
        self._dir_lock: int | None = None
        self._labels: dict[str, str] | None = None
        self.failures: dict[tuple[str, str], WeightcacheError] = {}
        #: (failures in a row, monotonic time of the next attempt) of failing entries
        self._retry: dict[tuple[str, str], tuple[int, float]] = {}
        self._models_error: str | None = None  # why the models file is unusable, if it is
        self._converged = False  # every listed entry was attempted since the last change
        self._workers: list[Worker] = []

    # -- single-flight fetches -----------------------------------------------------------------

    def submit(self, source: Source, pod_uid: str | None = None) -> Future[FetchResult]:
        """Start (or join) the fetch of a revision; every caller shares one download.
        Only callers of the same source join: another source under the same name and
        revision is settled by the Fetcher (same manifest or exit 2), never handed the
        first source's result. The Pod's lease is committed first, so that the marker check
        that follows (ours, or the final one in `wait`) sees a revision no evictor can
        remove any more.
        """
        if pod_uid:
            self.index.lease(source.name, source.revision, pod_uid)
        key = (source.name, source.revision, source.url)
        with self._lock:
            future = self._inflight.get(key)
            if future is None:
                if self.stopping.is_set():
                    raise UsageError("the node daemon is shutting down")
                future = self._pool.submit(self._fetch, source, pod_uid)
                self._inflight[key] = future
                future.add_done_callback(lambda _: self._forget(key))
        return future

    def _forget(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def _fetch(self, source: Source, pod_uid: str | None) -> FetchResult:
        result = self.fetcher.fetch(source, pod_uid)
        self.metrics.cache_bytes.set(self.cache.usage())
        return result

    def wait(self, source: Source, pod_uid: str | None = None, beat: Any = None) -> FetchResult:
        """Submit and wait, calling `beat()` every HEARTBEAT seconds; counts this caller's
        fetch (hit, miss or error) and its own wait in the metrics, so six Pods joining one
        download are six fetches with six durations."""
        start = time.monotonic()
        try:
            result = self._wait_ready(source, pod_uid, beat)
        except Exception:  # any failure is this caller's failed fetch
            self.metrics.fetches.labels("error").inc()
            self.metrics.duration.labels("error").observe(time.monotonic() - start)
            raise
        outcome = "hit" if result.hit else "miss"
        self.metrics.fetches.labels(outcome).inc()
        self.metrics.duration.labels(outcome).observe(time.monotonic() - start)
        return result

    def _wait_ready(self, source: Source, pod_uid: str | None, beat: Any) -> FetchResult:
        """The result of a fetch whose revision is still there after our lease: a fetch
        we joined may have found it before we leased it, and an evictor removed it since."""
        for _ in range(3):
            future = self.submit(source, pod_uid)
            while True:
                try:
                    result = future.result(timeout=coord.HEARTBEAT)
                    break
                except TimeoutError:
                    if beat is not None:
                        beat()
            if self.cache.ready(source.name, source.revision) is not None:
                return result
            log.warning("%s was evicted as it became ready; fetching it again", source.label)
            with self._lock:  # its done-callback may not have run yet: do not join it again
                key = (source.name, source.revision, source.url)
                if self._inflight.get(key) is future:
                    del self._inflight[key]
        raise NoSpaceError(
            f"{source.label} was evicted three times as soon as it was ready; the cache is "
            "too small for what runs on this node: raise --capacity"
        )

    def record_hit(self, source: Source, pod_uid: str | None = None) -> None:
        """Count a Pod's hit and lease the revision for it: a Pod on a read-only mount of
        the cache (initcontainer/, design §5) cannot write its lease itself, and
        without one its revision could be evicted under the running engine. The lease is
        committed before the marker is read (as in `submit`); a revision that is gone by
        then keeps a lease that ends with the Pod, as any lease does."""
        if pod_uid:
            self.index.lease(source.name, source.revision, pod_uid)
        marker = self.cache.read_marker(source.name, source.revision)
        self.metrics.fetches.labels("hit").inc()
        self.metrics.duration.labels("hit").observe(0.0)
        if marker is not None:
            self.metrics.bytes.labels("local").inc(marker.size)

    # -- capacity ------------------------------------------------------------------------------

    def capacity_bytes(self) -> int | None:
        if self.settings.capacity is None:
            return None
        return self.settings.capacity.resolve(self.layout.disk_space()[0])

    def make_room(self, need: int) -> None:
        """Evict LRU revisions so that `need` more bytes fit under capacity and leave
        --min-free free on the disk, or raise NoSpaceError (exit 5) saying which bound
        cannot be kept."""
        if need <= 0:
            return
        with self._evict_lock:
            self._collect_orphans()
            revisions, sizes, usage = eviction.survey(self.cache, self.index, self.desired.pinned)
            size, free = self.layout.disk_space()
            floor = self.settings.min_free.resolve(size)
            by_floor = eviction.floor_target(usage, need, free, floor)
            capacity = self.capacity_bytes()
            target = by_floor if capacity is None else min(capacity - need, by_floor)
            plan = eviction.plan_eviction(revisions, sizes, usage, target)
            if not plan.sufficient:
                if plan.usage_after > by_floor:
                    raise NoSpaceError(_floor_message(need, usage, free, floor, plan))
                assert capacity is not None
                raise NoSpaceError(
                    f"the revision needs {human(need)} but the cache holds {human(usage)} of "
                    f"{human(capacity)} capacity and evicting every unpinned, unused "
                    f"revision would free only {human(plan.freed_bytes)}; raise --capacity "
                    "or unpin models"
                )
            self._execute(plan)

    def enforce_capacity(self) -> None:
        """Above the high watermark, evict down to the low one; below --min-free free on
        the disk (other files grew), evict until the floor is back."""
        capacity = self.capacity_bytes()
        with self._evict_lock:
            self._collect_orphans()
            revisions, sizes, usage = eviction.survey(self.cache, self.index, self.desired.pinned)
            self.metrics.cache_bytes.set(usage)
            size, free = self.layout.disk_space()
            target = eviction.floor_target(usage, 0, free, self.settings.min_free.resolve(size))
            if capacity is not None:
                self.metrics.capacity_bytes.set(capacity)
                if usage > capacity * self.settings.watermarks.high:
                    target = min(target, int(capacity * self.settings.watermarks.low))
            if target < usage:
                self._execute(eviction.plan_eviction(revisions, sizes, usage, target))

    def _collect_orphans(self) -> None:
        """Delete blobs no revision links and no running fetch wants (design §5, Capacity):
        they count as usage but would never be evicted."""
        freed = self.cache.collect_orphans()
        if freed:
            log.info("removed %s of blobs no revision uses", human(freed))

    def _execute(self, plan: eviction.EvictionPlan) -> None:
        if not plan.evict:
            return
        log.info("eviction plan: %s", plan.describe())
        eviction.execute(plan, self.cache, self.index)
        self.metrics.evictions.inc(len(plan.evict))
        self.metrics.cache_bytes.set(self.cache.usage())

    # -- convergence ---------------------------------------------------------------------------

    def load_models(self) -> None:
        """Read the models file at start; raises UsageError (exit 2) when it is missing or
        invalid: there is no last good state to keep yet."""
        self._apply(load(self.settings.models_file))

    def reload(self) -> bool:
        """Re-read the models file; True if it changed. A file that vanished or turned
        invalid keeps the last good state, logged once until the error changes."""
        try:
            desired = load(self.settings.models_file)
        except UsageError as e:
            if str(e) != self._models_error:
                log.error("%s; keeping the last good desired state", e)
                self._models_error = str(e)
            return False
        if self._models_error is not None:
            log.info("the models file %s is usable again", self.settings.models_file)
            self._models_error = None
        return self._apply(desired)

    def _apply(self, desired: DesiredState) -> bool:
        if desired.digest == self.desired.digest:
            return False
        for problem in desired.problems:
            log.error("skipping a bad models entry: %s", problem)
        self._write_pins(desired.pinned)  # first: a failure here is retried, state unchanged
        self.desired = desired
        self._converged = False
        self._retry.clear()
        self._export_readiness()
        log.info("desired state: %d model(s), %d pinned", len(desired.models), len(desired.pinned))
        return True

    def _export_readiness(self) -> None:
        """One `weightcache_revision_ready` series per listed revision, labelled pinned or
        not, and none for revisions no longer listed: the alert on pinned revisions not
        ready (daemonset/prometheusrule.yaml) sees a new pin as 0 until it is fetched."""
        self.metrics.ready.clear()
        for name, revision in self._listed():
            self._set_ready(name, revision, self.cache.ready(name, revision) is not None)

    def _listed(self) -> list[tuple[str, str]]:
        return [(m.source.name, m.source.revision) for m in self.desired.models]

    def _set_ready(self, name: str, revision: str, ready: bool) -> None:
        pinned = "true" if (name, revision) in self.desired.pinned else "false"
        self.metrics.ready.labels(name, revision, pinned).set(1 if ready else 0)

    def _write_pins(self, pinned: frozenset[tuple[str, str]]) -> None:
        generation = self.index.generation
        self.index.set_pins(set(pinned))
        self._pins_generation = generation

    def _restore_pins(self) -> None:
        """Write the pins again into a state.db that replaced ours (or was rebuilt)."""
        if self.index.generation != self._pins_generation:
            self._write_pins(self.desired.pinned)

    def converge_once(self) -> None:
        """Fetch every listed revision that is not ready, one at a time. A failing entry
        (whatever it raises) never stops the others: it is recorded in `failures` and
        retried with a backoff (`retry_due`)."""
        now = time.monotonic()
        for spec in self.desired.models:
            if self.stopping.is_set():
                return
            key = (spec.source.name, spec.source.revision)
            if self._retry.get(key, (0, now))[1] <= now:
                self._converge_entry(spec.source)
        self._update_labels()

    def _converge_entry(self, source: Source) -> None:
        key = (source.name, source.revision)
        try:
            marker = self.cache.ready(*key)
            # Cached from another source: the Fetcher proves it the same or refuses it.
            if marker is None or marker.source != source.url:
                self.wait(source)
        except Exception as e:
            failures = self._retry.get(key, (0, 0.0))[0] + 1
            delay = backoff(failures, ENTRY_RETRY, ENTRY_RETRY_MAX)
            self._retry[key] = (failures, time.monotonic() + delay)
            if not isinstance(e, WeightcacheError):  # a bug or the disk: say what it was
                e = WeightcacheError(f"unexpected {type(e).__name__}: {e}")
            self.failures[key] = e
            self._set_ready(*key, False)
            log.error("prefetch of %s failed (retry in %.0fs): %s", source.label, delay, e)
            return
        self.failures.pop(key, None)
        self._retry.pop(key, None)
        self._set_ready(*key, True)

    def retry_due(self) -> bool:
        """A failed entry's backoff has run out."""
        now = time.monotonic()
        return any(at <= now for _, at in self._retry.values())

    def health_problem(self) -> str | None:
        """None while the daemon can do its job, else one line saying what is wrong
        (the /healthz contract: a 503 with that line): a worker died or keeps failing."""
        for worker in self._workers:
            problem = worker.problem()
            if problem is not None:
                return problem
        return None

    def serving(self) -> bool:
        """The /readyz contract: the daemon serves (models file loaded, fetch socket and
        HTTP up, not stopping), whatever it is still downloading. Waiting for pinned
        revisions made every models-file change mark the fleet NotReady for the download,
        and one unfetchable pin keep it NotReady for good (design §5); pinned
        progress is `weightcache_revision_ready{pinned="true"}` and its alert instead."""
        return self._socket.listening and not self.stopping.is_set()

    def pinned_missing(self) -> list[str]:
        """NAME/REV of every pinned revision not ready on this node, sorted."""
        pinned = sorted(self.desired.pinned)
        return [f"{n}/{r}" for n, r in pinned if self.cache.ready(n, r) is None]

    def reap_leases(self) -> None:
        """End the leases of Pods that are gone (their kubelet directory vanished, or,
        without that directory, after `lease_max_age`), and at once those whose holder is
        not a Pod UID (written by an old version or by hand): they name no Pod that could
        ever go away."""
        holders = self.index.lease_holders()
        malformed = {uid for uid in holders if not _is_pod_uid(uid)}
        pods_dir = self.settings.kubelet_pods_dir
        if pods_dir.is_dir():
            try:
                gone = {u for u in holders - malformed if not _pod_dir_exists(pods_dir / u)}
            except PermissionError as e:
                # The kubelet makes the directory 0750 root: keep every lease (never evict
                # a revision in use) and say how to fix the node.
                log.error(
                    "cannot look into %s (%s): leases are kept until it is readable; "
                    "grant search with `setfacl -m u:%d:x %s`",
                    pods_dir,
                    e.strerror,
                    os.getuid(),
                    pods_dir,
                )
                gone = set()
        else:
            cutoff = time.time() - self.settings.lease_max_age
            gone = {uid for uid, since in self.index.lease_ages() if since < cutoff}
        if malformed:
            shown = ", ".join(repr(u[:40]) for u in sorted(malformed))
            log.warning("ending %d lease(s) not held by a Pod UID: %s", len(malformed), shown)
        if gone:
            log.info("ending %d lease(s) of Pods that are gone", len(gone))
        if gone | malformed:
            self.index.end_leases(gone | malformed)

    def _update_labels(self) -> None:
        if not self.settings.node_name:
            return
        ready = [
            (m.source.name, m.source.revision)
            for m in self.desired.models
            if self.cache.ready(m.source.name, m.source.revision)
        ]
        wanted = labels.node_labels(ready)
        if wanted != self._labels:
            try:
                labels.patch_node(self.settings.node_name, wanted, self._labels or {})
                self._labels = wanted
            except (OSError, KeyError, ValueError) as e:  # KeyError: not in a cluster
                # Labels are a convenience: failing to set them never fails the converge
                # step (nor, through it, /healthz).
                log.warning("could not label node %s: %r", self.settings.node_name, e)

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
            Worker("lease and capacity", self.housekeeping_step, interval, self.stopping),
        ]
        for worker in self._workers:
            worker.start()
        while not self.stopping.wait(interval):  # wake up: signal handlers run in this thread
            pass
        self._shutdown()

    def converge_step(self) -> None:
        """Follow the models file: converge after a change or when a retry is due."""
        if self.reload() or not self._converged or self.retry_due():
            self.converge_once()
            self.enforce_capacity()
            self._converged = True

    def housekeeping_step(self) -> None:
        self._restore_pins()
        self.reap_leases()
        self.enforce_capacity()

    async def _listen(self) -> None:
        """The peer port and the metrics port, on the loop; UsageError if one is taken."""
        if self.peers is not None and self.settings.peer is not None:
            server = PeerServer(self.settings.peer, self.layout, self.peers, self.metrics,
                                self.stopping)  # fmt: skip
            await server.start()
            self._http.append(server.http)
        if self.settings.metrics_addr is not None:
            http = serve.HttpServer(serve.page_handler(self._pages()), HTTP_LIMITS)
            host, port = self.settings.metrics_addr
            try:
                bound = await http.start(host, port)
            except OSError as e:
                raise UsageError(f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                                 "choose a free --metrics-addr") from e  # fmt: skip
            self._http.append(http)
            log.info("metrics on http://%s:%d/metrics", *bound)

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
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.peers is not None:
            self.peers.close()

    def _pages(self) -> dict[str, serve.Page]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        def metrics() -> tuple[int, bytes, str]:
            self.count_fetches()
            return 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST

        return {"/metrics": metrics, "/healthz": self._healthz, "/readyz": self._readyz}

    def count_fetches(self) -> None:
        """Bring the node-wide gauges up to date with the fetches running alone on the cache
        dir (outside our observer: read from their records at each scrape) and the
        distinct revisions being fetched, by us or by them."""
        running = alone.live(self.layout)
        self.metrics.fetches_alone(len(running), sum(f.gets for f in running))
        with self._lock:
            revisions = {(name, revision) for name, revision, _ in self._inflight}
        revisions |= {(f.name, f.revision) for f in running}
        self.metrics.downloads_inflight.set(len(revisions))

    def _healthz(self) -> tuple[int, bytes, str]:
        problem = self.health_problem()
        return (200, b"ok\n", TEXT) if problem is None else (503, f"{problem}\n".encode(), TEXT)

    def _readyz(self) -> tuple[int, bytes, str]:
        """200 while serving; the body also names pinned revisions still missing, for a
        human at `curl` (the status does not depend on them)."""
        if not self.serving():
            what = "stopping" if self.stopping.is_set() else "the fetch socket is not up yet"
            return 503, f"not serving: {what}\n".encode(), TEXT
        missing = self.pinned_missing()
        body = "ready" + ("; pinned not yet ready: " + " ".join(missing) if missing else "")
        return 200, (body + "\n").encode(), TEXT

    # -- the fetch socket ----------------------------------------------------------------------

    def handle_line(self, line: bytes, send: Any) -> None:
        """One request line from the socket (any bytes): a bad one is one warning line and
        an error event (the Pod falls back); nothing a Pod sends stops the daemon."""
        try:
            msg = coord.parse_request(line)
        except ValueError as e:
            log.warning("bad request on the fetch socket: %s", e)
            self._answer_error(send, UsageError(f"bad request: {e}"))
            return
        try:
            self.handle_fetch(msg, send)
        except WeightcacheError as e:
            self._answer_error(send, e)
        except OSError:
            raise  # the connection is gone: nothing to answer
        except Exception as e:  # a bug must not end the socket; the Pod falls back
            log.error("internal error serving a fetch of %s: %r", msg.get("source"), e)

    def _answer_error(self, send: Any, e: WeightcacheError) -> None:
        """A stopping daemon gives no verdict (the download was interrupted by us, not
        failed): its socket closes and the Pod falls back to fetching alone."""
        if not self.stopping.is_set():
            send({"event": "error", "exit_code": e.exit_code, "message": str(e)})

    def allowed_sources(self) -> tuple[SourcePrefix, ...]:
        """Where the daemon fetches for Pods: `--allow-source`, else the parent of every
        source of the models file (so any revision of a listed model)."""
        if self.settings.allow_sources is not None:
            return self.settings.allow_sources
        return tuple(sorted({SourcePrefix.parent_of(m.source) for m in self.desired.models}))

    def refusal(self, source: Source) -> str | None:
        """Why the daemon will not fetch `source` for a Pod, or None. Its credentials
        serve only the allowed prefixes, so a Pod cannot make it read any bucket it can."""
        if any(prefix.covers(source) for prefix in self.allowed_sources()):
            return None
        return (
            f"the node daemon does not fetch {source.url} for Pods: it is not under its "
            "--allow-source prefixes"
        )

    def handle_fetch(self, msg: dict[str, Any], send: Any) -> None:
        """Serve one Pod's fetch over the socket: refuse, or accept, heartbeat, answer."""
        source = Source.parse(msg["source"], msg.get("name"), msg.get("revision"))
        pod_uid = msg.get("pod_uid")
        if msg.get("op") == "hit":
            self.record_hit(source, pod_uid)
            return
        refusal = self.refusal(source)
        if refusal is not None:
            allowed = " ".join(map(str, self.allowed_sources())) or "none"
            log.info("refused a Pod's fetch of %s (allowed: %s)", source.url, allowed)
            send({"event": "refused", "message": refusal})
            return
        send({"event": "accepted"})
        self.metrics.replica_waiting(+1)
        try:
            result = self.wait(source, pod_uid, beat=lambda: send({"event": "waiting"}))
            send({"event": "done", "result": result.to_dict()})
        except WeightcacheError as e:
            self._answer_error(send, e)
        finally:
            self.metrics.replica_waiting(-1)


def _floor_message(
    need: int, usage: int, free: int, floor: int, plan: eviction.EvictionPlan
) -> str:
    return (
        f"the revision needs {human(need)} but the cache disk has {human(free)} free and "
        f"--min-free keeps {human(floor)} of it free (the cache holds {human(usage)}; other "
        f"files use the rest); evicting every unpinned, unused revision would free only "
        f"{human(plan.freed_bytes)}: free space on the disk, lower --min-free, or unpin "
        "models"
    )


def _is_pod_uid(holder: str) -> bool:
    try:
        return parse_pod_uid(holder) == holder
    except UsageError:
        return False


def _pod_dir_exists(path: Path) -> bool:
    """os.path.exists() swallows EACCES as "absent", which would end live leases."""
    try:
        path.stat()
    except FileNotFoundError:
        return False
    return True


def hold_cache_dir(layout: Layout) -> int:
    """flock the cache dir's daemon lock for the life of the process (the fd stays open;
    the kernel releases it on any exit). Raises UsageError naming the holder's pid: two
    daemons on one cache dir would take each other's socket and partials (design §5)."""
    fd = os.open(layout.daemon_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
