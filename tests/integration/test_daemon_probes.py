"""The kubelet's probes against scrapers of the metrics port (design §5, Bounds): with as many
scrapes in progress as the port serves at once, /healthz and /readyz still answer, so a
scrape storm cannot get the daemon restarted by its liveness probe.

The daemon's own HTTP server and limits on loopback, with a /metrics page that the test
holds until it lets go: how long a real render takes under load is not what is tested."""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.integration.daemon_helpers import wait_for
from weightcache.daemon.daemon import HTTP_LIMITS, TEXT
from weightcache.listeners import http as serve

ANSWER_TIMEOUT = 20.0  # seconds; only a refused or starved probe comes near it


def get(port: int, path: str) -> int:
    """The status of GET path; 0 if nothing answered."""
    try:
        url = f"http://127.0.0.1:{port}{path}"
        with urllib.request.urlopen(url, timeout=ANSWER_TIMEOUT) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


@pytest.fixture
def held_metrics() -> Iterator[tuple[serve.HttpServer, int, threading.Event, list[str]]]:
    """A metrics port whose /metrics answers once the event is set; (server, port, event,
    paths rendered)."""
    release = threading.Event()
    rendered: list[str] = []

    def page(path: str, wait: bool) -> serve.Page:
        def render() -> tuple[int, bytes, str]:
            rendered.append(path)
            if wait:
                release.wait(60)
            return 200, b"ok\n", TEXT

        return render

    pages = {"/metrics": page("/metrics", True), "/healthz": page("/healthz", False),
             "/readyz": page("/readyz", False)}  # fmt: skip
    loop = serve.LoopThread()
    http = serve.HttpServer(serve.page_handler(pages), HTTP_LIMITS)
    _, port = loop.run(http.start("127.0.0.1", 0))
    try:
        yield http, port, release, rendered
    finally:
        release.set()
        loop.run(http.close())
        loop.stop()


def scrape(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT)
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


@pytest.mark.timeout(120)
def test_probes_answer_while_scrapers_hold_every_connection_busy(
    held_metrics: tuple[serve.HttpServer, int, threading.Event, list[str]],
) -> None:
    http, port, release, rendered = held_metrics
    cap = HTTP_LIMITS.requests
    scrapers = []
    try:
        for _ in range(cap):
            scrapers.append(scrape(port))
        # Every one of them is being served (some wait for a thread to render in).
        wait_for("every scrape to be served",
                 lambda: sum(c.busy for c in list(http.books.open)) == cap)  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT) as extra:
            extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(100).startswith(b"HTTP/1.1 503"), "the cap is not full"
        for _ in range(10):  # the kubelet probes every few seconds, each on a new connection
            for path in ("/healthz", "/readyz"):
                assert get(port, path) == 200, f"{path} failed while scrapers held the cap"
        assert rendered.count("/healthz") == 10
        release.set()
        for s in scrapers:  # the scrapes held were answered, not cut
            assert s.recv(100).startswith(b"HTTP/1.1 200"), "a held scrape was dropped"
    finally:
        for s in scrapers:
            with contextlib.suppress(OSError):
                s.close()
