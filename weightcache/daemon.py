"""The node agent (SPEC §5): converge to the models file, bound the cache, coordinate fetches.

One `Fetcher` (so one token bucket for `--bwlimit` and one AIMD gate) serves both the
prefetch loop and the Pods' `fetch` requests arriving on the Unix socket; requests for the
same revision share one download (single-flight). Revisions are prefetched one at a time.
Capacity is enforced after every change and before every download. SIGTERM stops new
work, interrupts downloads (partials stay resumable) and exits within the grace period.

Peers (SPEC §8, `--peer-addr`): the daemon serves its blobs to the other nodes' daemons
and, for the fetches it runs, asks them before the origin (weightcache/peers.py).

Who holds credentials: the daemon downloads with its own (DaemonSet Secret or IRSA) for
every fetch it coordinates; a Pod's `fetch` uses its own only when it falls back to
fetching alone (no daemon, or a daemon that does not answer).
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from weightcache import coord, eviction, labels
from weightcache.config import Capacity, PeerSettings, Source, StoreSettings, parse_pod_uid
from weightcache.errors import NoSpaceError, UsageError, WeightcacheError
from weightcache.eviction import Watermarks
from weightcache.fetch import Fetcher, FetchResult
from weightcache.index import for_cache
from weightcache.layout import Layout
from weightcache.metrics import Metrics
from weightcache.models import DesiredState, load
from weightcache.peers import Peers, PeerServer
from weightcache.progress import human
from weightcache.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DaemonSettings:
    models_file: Path
    capacity: Capacity | None = None  # None: only the disk bounds the cache (prefetch)
    watermarks: Watermarks = field(default_factory=Watermarks)
    metrics_addr: tuple[str, int] | None = None
    #: The kubelet's pod directories (read-only hostPath): a lease ends when its Pod's
    #: directory is gone. Without it, leases end after `lease_max_age`.
    kubelet_pods_dir: Path = Path("/var/lib/kubelet/pods")
    lease_max_age: float = 24 * 3600.0
    #: How often to look at the models file, leases and capacity.
    interval: float = 2.0
    node_name: str | None = None  # set to label the node (needs RBAC, see daemonset/)
    grace: float = 25.0  # seconds to wind down after SIGTERM, within the Pod's grace period
    peer: PeerSettings | None = None  # serve and fetch blobs between nodes (SPEC §8)


class Daemon:
    def __init__(self, layout: Layout, store_settings: StoreSettings, settings: DaemonSettings):
        self.layout = layout
        self.settings = settings
        self.metrics = Metrics()
        self.store = Store(layout)
        self.index = for_cache(layout)
        self._pins_generation = -1  # the index generation our pins were written to
        self.peers = Peers(settings.peer) if settings.peer is not None else None
        self.fetcher = Fetcher(
            layout, store_settings, observer=self.metrics, reserve=self.make_room, peers=self.peers
        )
        self.desired = DesiredState(())
        self.stopping = threading.Event()
        self._inflight: dict[tuple[str, str], Future[FetchResult]] = {}
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fetch")
        self._servers: list[socketserver.BaseServer] = []
        self._labels: dict[str, str] | None = None
        self.failures: dict[tuple[str, str], WeightcacheError] = {}

    # -- single-flight fetches -----------------------------------------------------------------

    def submit(self, source: Source, pod_uid: str | None = None) -> Future[FetchResult]:
        """Start (or join) the fetch of a revision; every caller shares one download.

        The Pod's lease is committed first, so that the marker check that follows (ours,
        or the final one in `wait`) sees a revision no evictor can remove any more.
        """
        if pod_uid:
            self.index.lease(source.name, source.revision, pod_uid)
        key = (source.name, source.revision)
        with self._lock:
            future = self._inflight.get(key)
            if future is None:
                if self.stopping.is_set():
                    raise UsageError("the node daemon is shutting down")
                future = self._pool.submit(self._fetch, source, pod_uid)
                self._inflight[key] = future
                future.add_done_callback(lambda _: self._forget(key))
        return future

    def _forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def _fetch(self, source: Source, pod_uid: str | None) -> FetchResult:
        result = self.fetcher.fetch(source, pod_uid)
        self.metrics.cache_bytes.set(self.store.usage())
        return result

    def wait(self, source: Source, pod_uid: str | None = None, beat: Any = None) -> FetchResult:
        """Submit and wait, calling `beat()` every HEARTBEAT seconds; counts this caller's
        fetch (hit, miss or error) and its own wait in the metrics, so six Pods joining one
        download are six fetches with six durations."""
        start = time.monotonic()
        try:
            result = self._wait_ready(source, pod_uid, beat)
        except WeightcacheError:
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
            if self.store.ready(source.name, source.revision) is not None:
                return result
            log.warning("%s was evicted as it became ready; fetching it again", source.label)
            with self._lock:  # its done-callback may not have run yet: do not join it again
                if self._inflight.get((source.name, source.revision)) is future:
                    del self._inflight[(source.name, source.revision)]
        raise NoSpaceError(
            f"{source.label} was evicted three times as soon as it was ready; the cache is "
            "too small for what runs on this node: raise --capacity"
        )

    def record_hit(self, source: Source) -> None:
        marker = self.store.read_marker(source.name, source.revision)
        self.metrics.fetches.labels("hit").inc()
        self.metrics.duration.labels("hit").observe(0.0)
        if marker is not None:
            self.metrics.bytes.labels("local").inc(marker.size)

    # -- capacity ------------------------------------------------------------------------------

    def capacity_bytes(self) -> int | None:
        if self.settings.capacity is None:
            return None
        st = os.statvfs(self.layout.root)
        return self.settings.capacity.resolve(st.f_blocks * st.f_frsize)

    def make_room(self, need: int) -> None:
        """Evict LRU revisions so that `need` more bytes fit under capacity, or raise."""
        capacity = self.capacity_bytes()
        if capacity is None or need <= 0:
            return
        with self._evict_lock:
            self._collect_orphans()
            revisions, sizes, usage = eviction.survey(self.store, self.index, self.desired.pinned)
            plan = eviction.plan_eviction(revisions, sizes, usage, capacity - need)
            if not plan.sufficient:
                raise NoSpaceError(
                    f"the revision needs {human(need)} but the cache holds {human(usage)} of "
                    f"{human(capacity)} capacity and evicting every unpinned, unused "
                    f"revision would free only {human(plan.freed_bytes)}; raise --capacity "
                    "or unpin models"
                )
            self._execute(plan)

    def enforce_capacity(self) -> None:
        """Above the high watermark, evict down to the low one."""
        capacity = self.capacity_bytes()
        if capacity is None:
            return
        self.metrics.capacity_bytes.set(capacity)
        with self._evict_lock:
            self._collect_orphans()
            revisions, sizes, usage = eviction.survey(self.store, self.index, self.desired.pinned)
            self.metrics.cache_bytes.set(usage)
            if usage <= capacity * self.settings.watermarks.high:
                return
            target = int(capacity * self.settings.watermarks.low)
            self._execute(eviction.plan_eviction(revisions, sizes, usage, target))

    def _collect_orphans(self) -> None:
        """Delete blobs no revision links and no running fetch wants (issue 9 item 13):
        they count as usage but would never be evicted."""
        freed = self.store.collect_orphans()
        if freed:
            log.info("removed %s of blobs no revision uses", human(freed))

    def _execute(self, plan: eviction.EvictionPlan) -> None:
        if not plan.evict:
            return
        log.info("eviction plan: %s", plan.describe())
        eviction.execute(plan, self.store, self.index)
        self.metrics.evictions.inc(len(plan.evict))
        self.metrics.cache_bytes.set(self.store.usage())

    # -- convergence ---------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the models file; True if it changed."""
        try:
            desired = load(self.settings.models_file)
        except UsageError as e:
            log.error("%s; keeping the previous desired state", e)
            return False
        if desired.digest == self.desired.digest:
            return False
        for problem in desired.problems:
            log.error("skipping a bad models entry: %s", problem)
        self.desired = desired
        self._write_pins()
        log.info("desired state: %d model(s), %d pinned", len(desired.models), len(desired.pinned))
        return True

    def _write_pins(self) -> None:
        generation = self.index.generation
        self.index.set_pins(set(self.desired.pinned))
        self._pins_generation = generation

    def _restore_pins(self) -> None:
        """Write the pins again into a state.db that replaced ours (or was rebuilt)."""
        if self.index.generation != self._pins_generation:
            self._write_pins()

    def converge_once(self) -> None:
        """Fetch every listed revision that is not ready, one at a time."""
        for spec in self.desired.models:
            if self.stopping.is_set():
                return
            key = (spec.source.name, spec.source.revision)
            if self.store.ready(*key) is not None:
                self.metrics.ready.labels(*key).set(1)
                continue
            try:
                self.wait(spec.source)
                self.failures.pop(key, None)
                self.metrics.ready.labels(*key).set(1)
            except WeightcacheError as e:
                self.failures[key] = e
                self.metrics.ready.labels(*key).set(0)
                log.error("prefetch of %s failed: %s", spec.source.label, e)
        self._update_labels()

    def health_problem(self) -> str | None:
        """None while the daemon can do its job, else one line saying what is wrong
        (the /healthz contract: a 503 with that line)."""
        return None

    def ready(self) -> bool:
        """Every pinned revision is present (the /readyz contract)."""
        return all(self.store.ready(n, r) is not None for n, r in self.desired.pinned)

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
            if self.store.ready(m.source.name, m.source.revision)
        ]
        wanted = labels.node_labels(ready)
        if wanted != self._labels:
            try:
                labels.patch_node(self.settings.node_name, wanted, self._labels or {})
                self._labels = wanted
            except OSError as e:
                log.warning("could not label node %s: %s", self.settings.node_name, e)

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stopping` is set (SIGTERM)."""
        self.store.clean_tmp()
        self.reload()
        self._serve_socket()
        self._serve_peers()
        if self.settings.metrics_addr is not None:
            self._serve_http(self.settings.metrics_addr)
        converger = threading.Thread(target=self._converge_loop, name="converge", daemon=True)
        converger.start()
        while not self.stopping.wait(self.settings.interval):
            try:
                self._restore_pins()
                self.reap_leases()
                self.enforce_capacity()
            except WeightcacheError as e:
                log.error("%s", e)
        self._shutdown(converger)

    def _converge_loop(self) -> None:
        changed = True
        while not self.stopping.is_set():
            if changed or self.failures:
                self.converge_once()
                self.enforce_capacity()
            self.stopping.wait(self.settings.interval if not self.failures else 10.0)
            changed = self.reload()

    def stop(self) -> None:
        """Ask `run()` to return (safe from a signal handler): no new work, downloads
        interrupted at their next read, partial files kept resumable."""
        self.stopping.set()
        self.fetcher.interrupt()

    def _shutdown(self, converger: threading.Thread) -> None:
        log.info("stopping: no new work, downloads interrupted, partial files kept")
        converger.join(self.settings.grace)
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.peers is not None:
            self.peers.close()
        if self.layout.socket.exists():
            self.layout.socket.unlink()

    def _serve_socket(self) -> None:
        path = self.layout.socket
        if path.exists() or path.is_symlink():
            path.unlink()
        server = socketserver.ThreadingUnixStreamServer(str(path), _make_socket_handler(self))
        server.daemon_threads = True
        os.chmod(path, 0o666)  # Pods may run as another uid than the daemon
        self._servers.append(server)
        threading.Thread(target=server.serve_forever, name="socket", daemon=True).start()
        log.info("coordinating fetches on %s", path)

    def _serve_peers(self) -> None:
        if self.peers is None or self.settings.peer is None:
            return
        server = PeerServer(self.settings.peer, self.layout, self.peers, self.metrics,
                            self.stopping)  # fmt: skip
        self._servers.append(server.http)
        server.start()

    def _serve_http(self, addr: tuple[str, int]) -> None:
        server = ThreadingHTTPServer(addr, _make_http_handler(self))
        server.daemon_threads = True
        self._servers.append(server)
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        log.info("metrics on http://%s:%d/metrics", *server.server_address[:2])

    def handle_fetch(self, msg: dict[str, Any], send: Any) -> None:
        """Serve one Pod's fetch over the socket: accept, heartbeat, answer."""
        source = Source.parse(msg["source"], msg.get("name"), msg.get("revision"))
        pod_uid = msg.get("pod_uid")
        if msg.get("op") == "hit":
            self.record_hit(source)
            return
        send({"event": "accepted"})
        self.metrics.replica_waiting(+1)
        try:
            result = self.wait(source, pod_uid, beat=lambda: send({"event": "waiting"}))
            send({"event": "done", "result": result.to_dict()})
        except WeightcacheError as e:
            send({"event": "error", "exit_code": e.exit_code, "message": str(e)})
        finally:
            self.metrics.replica_waiting(-1)


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


def _make_socket_handler(daemon: Daemon) -> type[socketserver.StreamRequestHandler]:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            def send(msg: dict[str, Any]) -> None:
                self.wfile.write(json.dumps(msg).encode() + b"\n")
                self.wfile.flush()

            try:
                msg = json.loads(self.rfile.readline(65536))
                daemon.handle_fetch(msg, send)
            except (OSError, ValueError, KeyError) as e:
                log.warning("bad request on the fetch socket: %s", e)
            except WeightcacheError as e:
                send({"event": "error", "exit_code": e.exit_code, "message": str(e)})

    return Handler


def _make_http_handler(daemon: Daemon) -> type[BaseHTTPRequestHandler]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, generate_latest(daemon.metrics.registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                problem = daemon.health_problem()
                if problem is None:
                    self._send(200, b"ok\n")
                else:
                    self._send(503, (problem + "\n").encode())
            elif self.path == "/readyz":
                ok = daemon.ready()
                missing = [
                    f"{n}/{r}"
                    for n, r in sorted(daemon.desired.pinned)
                    if daemon.store.ready(n, r) is None
                ]
                body = b"ready\n" if ok else ("missing: " + " ".join(missing) + "\n").encode()
                self._send(200 if ok else 503, body)
            else:
                self._send(404, b"not found\n")

        def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
