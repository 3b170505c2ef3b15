"""The kubelet's probes against a storm of scrapers on a real daemon's metrics port (design
§5, Bounds): 128 clients scraping /metrics in a loop, twice the connections scrapers may
hold, and /healthz and /readyz must still answer 200 within the probes' timeout, or the
liveness probe restarts the daemon over and over.

The daemon lists many cached revisions and each scrape reads every listed revision's
marker, so a render is slow enough that the scrapers keep the cap full on any machine. The
test checks that scrapers were turned away while it probed (the cap was full), so it
cannot pass on a storm too weak to matter."""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    wait_for,
    write_models,
)
from tests.support.cached import add_revision
from weightcache.cache.layout import Layout
from weightcache.cache.store import Cache

REVISIONS = 100  # listed and cached: a scrape reads each one's marker
SCRAPERS = 128  # twice the connections scrapers may hold on the metrics port
SCRAPES = 300  # per scraper at most: the loops end by themselves
SCRAPE_TIMEOUT = 20.0  # seconds; a slow scrape is fine, only the probes are timed
PROBE_TIMEOUT = 3.0  # seconds: the probes' timeoutSeconds in daemonset/daemonset.yaml
ROUNDS = 10  # of one /healthz and one /readyz, each on a new connection as the kubelet's
PROBE_EVERY = 0.2  # seconds between two probes (the kubelet waits 10 s: more probes here)
NO_ANSWER = 0  # connection refused, reset or closed before a status line
TIMED_OUT = 1
TURNED_AWAY = (503, NO_ANSWER)  # both happen only at the full cap: refused or closed for room


class ProbesFailed(AssertionError):
    """Probes failed under a storm the test saw was strong enough."""


class Tally:
    """Scrapes by status, counted from every scraper's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[int] = Counter()

    def add(self, status: int) -> None:
        with self._lock:
            self._counts[status] += 1

    def counts(self) -> dict[int, int]:
        with self._lock:
            return dict(self._counts)

    def turned_away(self) -> int:
        counts = self.counts()
        return sum(counts.get(code, 0) for code in TURNED_AWAY)


class Scraper:
    """One client scraping /metrics in a loop on a kept-alive connection (as Prometheus
    does), a new one at once after a failure; until `stop` is set or SCRAPES are done."""

    def __init__(self, port: int, stop: threading.Event, tally: Tally) -> None:
        self.port, self.stop, self.tally = port, stop, tally
        self._conn: http.client.HTTPConnection | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _scrape(self) -> int:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=SCRAPE_TIMEOUT)
        try:
            self._conn.request("GET", "/metrics")
            resp = self._conn.getresponse()
            resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._close()
            return TIMED_OUT if isinstance(e, TimeoutError) else NO_ANSWER
        if resp.will_close:
            self._close()
        return resp.status

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _loop(self) -> None:
        try:
            for _ in range(SCRAPES):
                if self.stop.is_set():
                    return
                got = self._scrape()
                self.tally.add(got)
        finally:
            self._close()


def probe(port: int, path: str) -> int:
    """The status of GET path on a new connection, as the kubelet probes; NO_ANSWER or
    TIMED_OUT if nothing answered within PROBE_TIMEOUT."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException) as e:
        return TIMED_OUT if isinstance(e, TimeoutError) else NO_ANSWER
    finally:
        conn.close()


@pytest.mark.timeout(240)
def test_probes_answer_while_128_scrapers_storm_the_metrics_port(
    store: Any, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    cache = Cache(Layout.open(cache_dir))
    listed = []
    for i in range(REVISIONS):
        source = f"s3://{BUCKET}/lora/adapter{i}/r1"
        add_revision(cache, f"adapter{i}", "r1", 512, source=source)
        listed.append({"source": source})
    daemon = daemons.start(cache_dir, write_models(tmp_path / "models.yaml", listed),
                           endpoint=store.endpoint_url)  # fmt: skip
    last = (
        f'weightcache_revision_ready{{name="adapter{REVISIONS - 1}",pinned="false",revision="r1"}}'
    )
    wait_for("every listed revision to be ready", lambda: daemon.metrics().get(last) == 1)

    stop, tally = threading.Event(), Tally()
    scrapers = [Scraper(daemon.port, stop, tally) for _ in range(SCRAPERS)]
    failed: list[tuple[str, int]] = []
    try:
        for s in scrapers:
            s.thread.start()
        wait_for("a scrape turned away at the full cap", tally.turned_away, timeout=60)
        before = tally.turned_away()
        for _ in range(ROUNDS):
            for path in ("/healthz", "/readyz"):
                got = probe(daemon.port, path)
                if got != 200:
                    failed.append((path, got))
                time.sleep(PROBE_EVERY)
        during = tally.turned_away() - before
    finally:
        stop.set()
        for s in scrapers:
            s.thread.join(SCRAPE_TIMEOUT + 5)
    assert not any(s.thread.is_alive() for s in scrapers), "a scraper did not stop"
    scrapes = tally.counts()
    assert during > 0, f"no scraper was turned away while probing: {scrapes}"
    assert scrapes.get(200, 0) > 0, f"no scrape was served: {scrapes}\n{daemon.log()}"
    assert daemon.alive(), daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()
    if failed:
        raise ProbesFailed(
            f"{len(failed)} of {2 * ROUNDS} probes failed ({NO_ANSWER}: reset or closed, "
            f"{TIMED_OUT}: no answer within {PROBE_TIMEOUT}s): {failed}; scrapes: {scrapes}"
        )
