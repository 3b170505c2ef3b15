"""The daemon's convergence role (design §5, Roles): follow the models file, prefetch its
revisions, pin the pinned ones, and say which are ready (the one place that decides it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from weightcache.cache.index import Index
from weightcache.cache.store import Cache
from weightcache.daemon import labels
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.models import DesiredState, digest, parse, read
from weightcache.daemon.worker import backoff
from weightcache.errors import Interrupted, UsageError, WeightcacheError
from weightcache.sourceurl import Source

log = logging.getLogger(__name__)

#: A models entry that failed is retried after ENTRY_RETRY x 2**(n-1) s, at most ENTRY_RETRY_MAX.
ENTRY_RETRY = 10.0
ENTRY_RETRY_MAX = 300.0

RevisionKey = tuple[str, str]


class Converger:
    """Brings the cache to the models file's desired state.

    Contract:
    - `load()` reads the models file at start and raises UsageError (exit 2) when it is
      missing or invalid; `reload()` keeps the last good state when it later vanishes or
      turns invalid. A change writes the pins into the index before it takes effect.
    - `converge_once()` fetches every listed revision that is not ready, one at a time,
      through `fetch` (the Coordinator's, so Pods asking for it share the download). A
      failing entry, whatever it raises, never stops the others: it is kept in `failures`
      and retried after a backoff doubling from ENTRY_RETRY to ENTRY_RETRY_MAX s.
    - `ready(name, revision)` is readiness of a listed revision, decided here only: the
      cache holds it complete and its last prefetch did not fail. /metrics
      (`weightcache_revision_ready`), the /readyz body (`pinned_missing`) and the node
      labels all read it.
    """

    def __init__(
        self,
        models_file: Path,
        cache: Cache,
        index: Index,
        metrics: Metrics,
        fetch: Callable[[Source], object],
        stopping: threading.Event,
        node_name: str | None = None,
        require_sha256: bool = False,
        parse: Callable[[Path, bytes], DesiredState] = parse,
    ) -> None:
        """`node_name`: label that node with the ready revisions (needs RBAC);
        `require_sha256`: a revision cached with a file no sha256 verified is not ready, for
        every entry (`fetch` refuses it); an entry's own `require_sha256` does so for it;
        `parse`: models.parse (tests count its calls)."""
        self.models_file = models_file
        self.cache = cache
        self.index = index
        self.metrics = metrics
        self.fetch = fetch
        self.stopping = stopping
        self.node_name = node_name
        self.require_sha256 = require_sha256
        self.parse = parse
        self.desired = DesiredState(())
        self._parsed: str | None = None  # digest of the bytes parsed last, valid or not
        self.failures: dict[RevisionKey, WeightcacheError] = {}
        #: (failures in a row, monotonic time of the next attempt) of failing entries
        self._retry: dict[RevisionKey, tuple[int, float]] = {}
        self._models_error: str | None = None  # why the models file is unusable, if it is
        self._converged = False  # every listed entry was attempted since the last change
        self._pins_generation = -1  # the index generation our pins were written to
        self._labels: dict[str, str] | None = None
        self._exported: set[tuple[str, str, str]] = set()  # weightcache_revision_ready series
        self._export_lock = threading.Lock()

    # -- the models file -------------------------------------------------------------------

    def load(self) -> None:
        """Read the models file at start; raises UsageError (exit 2) when it is missing or
        invalid: there is no last good state to keep yet."""
        data = read(self.models_file)
        self._parsed = digest(data)
        self._apply(self.parse(self.models_file, data))

    def reload(self) -> bool:
        """Re-read the models file; True if it changed. A file that vanished or turned
        invalid keeps the last good state, logged once until the error changes. Bytes
        parsed already, valid or not, are not parsed again: an idle daemon would parse a
        large file at every --interval."""
        parsed, self._parsed = self._parsed, None
        try:
            data = read(self.models_file)
            self._parsed = digest(data)
            if self._parsed == parsed:
                return False
            desired = self.parse(self.models_file, data)
        except UsageError as e:
            if str(e) != self._models_error:
                log.error("%s; keeping the last good desired state", e)
                self._models_error = str(e)
            return False
        if self._models_error is not None:
            log.info("the models file %s is usable again", self.models_file)
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
        log.info("desired state: %d model(s), %d pinned", len(desired.models), len(desired.pinned))
        return True

    def _write_pins(self, pinned: frozenset[RevisionKey]) -> None:
        generation = self.index.generation
        self.index.set_pins(set(pinned))
        self._pins_generation = generation

    def restore_pins(self) -> None:
        """Write the pins again into a state.db that replaced ours (or was rebuilt)."""
        if self.index.generation != self._pins_generation:
            self._write_pins(self.desired.pinned)

    # -- converging ------------------------------------------------------------------------

    def step(self, then: Callable[[], None] = lambda: None) -> None:
        """The converge worker's step: after a change of the models file, or when a retry
        is due, converge and then call `then()` (the daemon bounds its capacity); a step
        whose `then()` fails converges again next time."""
        if self.reload() or not self._converged or self.retry_due():
            self.converge_once()
            then()
            self._converged = True

    def converge_once(self, retries: bool = True) -> None:
        """Fetch every listed revision that is not ready, one at a time. A failing entry
        (whatever it raises) never stops the others: it is recorded in `failures` and
        retried with a backoff (`retry_due`). `retries=False` (`prefetch`, which runs this
        once and exits) logs a failure as final: nothing retries it, the exit code says it."""
        now = time.monotonic()
        for spec in self.desired.models:
            if self.stopping.is_set():
                return
            key = (spec.source.name, spec.source.revision)
            if self._retry.get(key, (0, now))[1] <= now:
                strict = self.require_sha256 or spec.require_sha256
                self._converge_entry(spec.source, retries, strict)
        self._update_labels()

    def _converge_entry(self, source: Source, retries: bool = True, strict: bool = False) -> None:
        key = (source.name, source.revision)
        try:
            marker = self.cache.ready(*key)
            # Cached from another source: the Fetcher proves it the same or refuses it; and
            # one verified by less than a sha256 that `strict` requires, it refuses.
            if marker is None or marker.source != source.url or (strict and marker.not_by_sha256()):
                self.fetch(source)
        except Exception as e:
            if isinstance(e, Interrupted) and self.stopping.is_set():  # SIGTERM: no failure
                log.info("prefetch of %s stopped; partial files are kept", source.label)
                return
            failures = self._retry.get(key, (0, 0.0))[0] + 1
            delay = backoff(failures, ENTRY_RETRY, ENTRY_RETRY_MAX)
            self._retry[key] = (failures, time.monotonic() + delay)
            if not isinstance(e, WeightcacheError):  # a bug or the disk: say what it was
                e = WeightcacheError(f"unexpected {type(e).__name__}: {e}")
            self.failures[key] = e
            if retries:
                log.error("prefetch of %s failed (retry in %.0fs): %s", source.label, delay, e)
            else:
                log.error(
                    "prefetch of %s failed (not retried: the exit code reports it): %s",
                    source.label,
                    e,
                )
            return
        self.failures.pop(key, None)
        self._retry.pop(key, None)

    def retry_due(self) -> bool:
        """A failed entry's backoff has run out."""
        now = time.monotonic()
        return any(at <= now for _, at in self._retry.values())

    # -- readiness -------------------------------------------------------------------------

    def ready(self, name: str, revision: str) -> bool:
        """The one definition of a listed revision being ready on this node: the cache
        holds it complete (every file its size) and its last prefetch did not fail (a
        revision cached from another source that the Fetcher refused is not ready)."""
        failed = (name, revision) in self.failures
        return not failed and self.cache.ready(name, revision) is not None

    def pinned_missing(self) -> list[str]:
        """NAME/REV of every pinned revision not ready on this node, sorted."""
        return [f"{n}/{r}" for n, r in sorted(self.desired.pinned) if not self.ready(n, r)]

    def export_readiness(self) -> None:
        """One `weightcache_revision_ready` series per listed revision, labelled pinned or
        not, and none for revisions no longer listed: the alert on pinned revisions not
        ready (daemonset/prometheusrule.yaml) sees a new pin as 0 until it is fetched.
        Called at each scrape, so an evicted revision reads 0 at once."""
        desired = self.desired
        values = {}
        for m in desired.models:
            key = (m.source.name, m.source.revision)
            series = (*key, "true" if key in desired.pinned else "false")
            values[series] = 1 if self.ready(*key) else 0
        with self._export_lock:
            for series in self._exported - values.keys():
                self.metrics.ready.remove(*series)
            for series, value in values.items():
                self.metrics.ready.labels(*series).set(value)
            self._exported = set(values)

    def _update_labels(self) -> None:
        if not self.node_name:
            return
        if not labels.in_cluster():
            # Said once, then off: outside a cluster it could never work.
            log.warning(
                "could not label node %s: a node's labels cannot be read or set outside a "
                "Kubernetes cluster (no in-cluster API: KUBERNETES_SERVICE_HOST is unset); "
                "node labels are off, readiness is still on /readyz and /metrics",
                self.node_name,
            )
            self.node_name = None
            return
        listed = [(m.source.name, m.source.revision) for m in self.desired.models]
        ready = [key for key in listed if self.ready(*key)]
        wanted = labels.node_labels(ready)
        if wanted != self._labels:
            try:
                labels.patch_node(self.node_name, wanted, self._labels or {})
                self._labels = wanted
            except (OSError, ValueError) as e:
                # Labels are a convenience: failing to set them never fails the converge
                # step (nor, through it, /healthz).
                log.warning("could not label node %s: %r", self.node_name, e)
