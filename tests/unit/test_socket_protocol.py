"""The fetch socket's messages (weightcache/daemon/fetchsocket.py, design §5 "The fetch socket"):
the request line a Pod sends and the daemon's check of it, the event lines the daemon
answers, and the client's verdicts: a result, a DaemonError, or None (fetch alone).

The client side runs against a scripted peer on a real Unix socket: it sends the exact
bytes of each case, so that what the client does with every answer is pinned, including
answers the daemon never sends (a broken or foreign daemon must not break a Pod)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightcache.daemon import fetchsocket
from weightcache.daemon.fetchsocket import (
    DaemonError,
    ask_daemon,
    notify_hit,
    parse_request,
    request,
)
from weightcache.sourceurl import Source

UID = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"
SRC = Source.parse("s3://models/team/llama/v1")
RESULT = {"path": "/cache/llama/v1", "hit": False, "bytes_from_origin": 10, "seconds": 1.5}


# -- the request line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "pod_uid", "op"),
    [
        pytest.param(SRC, UID, "fetch", id="fetch"),
        pytest.param(SRC, None, "fetch", id="no-pod"),
        pytest.param(
            Source.parse("s3://models/a/b/m/r", "alias", "rev2"), UID, "hit", id="hit-overrides"
        ),
    ],
)
def test_a_request_is_one_json_line_that_the_daemon_reads_back(
    source: Source, pod_uid: str | None, op: str
) -> None:
    line = request(source, pod_uid, op)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {
        "op": op,
        "source": source.url,
        "name": source.name,
        "revision": source.revision,
        "pod_uid": pod_uid,
    }
    msg = parse_request(line)
    parsed = Source.parse(msg["source"], msg["name"], msg["revision"])
    assert (parsed, msg["op"], msg["pod_uid"]) == (source, op, pod_uid)


def test_the_default_op_is_fetch() -> None:
    assert json.loads(request(SRC, None))["op"] == "fetch"


def test_a_request_of_the_longest_names_fits_the_64_kib_line() -> None:
    long = "n" * 255
    source = Source.parse(f"s3://models/{'p/' * 400}{long}/{long}")
    assert len(request(source, UID)) < 64 * 1024


def line(**fields: object) -> bytes:
    return json.dumps(fields).encode() + b"\n"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(
            line(source="s3://b/m/r"),
            {"source": "s3://b/m/r", "pod_uid": None},
            id="op-absent-is-fetch",
        ),
        pytest.param(
            line(op="hit", source="s3://b/m/r", pod_uid=None),
            {"op": "hit", "source": "s3://b/m/r", "pod_uid": None},
            id="null-uid",
        ),
        pytest.param(
            line(op="fetch", source="s3://b/m/r", pod_uid=f"  {UID.upper()} "),
            {"op": "fetch", "source": "s3://b/m/r", "pod_uid": UID},
            id="uid-spaces",
        ),
        pytest.param(
            line(op="fetch", source="s3://b/m/r", name=None, revision=None),
            {
                "op": "fetch",
                "source": "s3://b/m/r",
                "name": None,
                "revision": None,
                "pod_uid": None,
            },
            id="null-overrides",
        ),
        pytest.param(
            b'{"op": "fetch", "source": "s3://b/m/r"}',
            {"op": "fetch", "source": "s3://b/m/r", "pod_uid": None},
            id="no-newline",
        ),
    ],
)
def test_requests_the_daemon_accepts(raw: bytes, expected: dict[str, Any]) -> None:
    assert parse_request(raw) == expected


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        pytest.param(line(op=None, source="s3://b/m/r"), 'unknown "op"', id="op-null"),
        pytest.param(line(op="FETCH", source="s3://b/m/r"), 'unknown "op"', id="op-case"),
        pytest.param(line(op=["fetch"], source="s3://b/m/r"), 'unknown "op"', id="op-list"),
        pytest.param(line(op="x" * 10_000, source="s"), 'unknown "op"', id="op-huge"),
        pytest.param(
            line(op="fetch", source=5), '"source" must be a string, not int', id="source-int"
        ),
        pytest.param(line(op="fetch", source={"url": "s3://b/m/r"}), "not dict", id="source-map"),
        pytest.param(
            line(source="s3://b/m/r", name=True),
            '"name" must be a string or null, not bool',
            id="name-bool",
        ),
        pytest.param(line(source="s3://b/m/r", revision=1.5), '"revision" must', id="rev-float"),
        pytest.param(line(source="s3://b/m/r", pod_uid={"a": 1}), '"pod_uid" must', id="uid-map"),
        pytest.param(
            line(source="s3://b/m/r", pod_uid=UID[:-1]), "^invalid pod_uid '", id="uid-short"
        ),
        pytest.param(line(source="s3://b/m/r", pod_uid=UID + "/.."), "Pod UID", id="uid-path"),
        pytest.param(b'"fetch"\n', "not str", id="json-string"),
        pytest.param(b"null\n", "not NoneType", id="json-null"),
        pytest.param(b'{"op": "fetch", "source": "s3://b/m/r"', "not JSON", id="truncated"),
        pytest.param(b"{" * 100_000, "^not JSON|^JSON nested too deeply$", id="deep-open-braces"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "^JSON nested too deeply$", id="deep-lists"),
    ],
)
def test_requests_the_daemon_refuses_say_what_is_wrong(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why) as e:
        parse_request(raw)
    assert len(str(e.value)) < 400  # one log line, whatever the Pod sent


def test_an_unknown_op_is_quoted_at_most_40_characters() -> None:
    with pytest.raises(ValueError) as e:
        parse_request(line(op="y" * 1000, source="s3://b/m/r"))
    assert "y" * 40 in str(e.value) and "y" * 41 not in str(e.value)


# -- the event lines -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "event"),
    [
        pytest.param(b'{"event": "accepted"}\n', {"event": "accepted"}, id="accepted"),
        pytest.param(
            b'{"event": "waiting"}\n{"event": "done"}\n',
            {"event": "waiting"},
            id="one-line-at-a-time",
        ),
        pytest.param(
            b'{"event": "done", "result": {"hit": true}}',
            {"event": "done", "result": {"hit": True}},
            id="last-line-no-newline",
        ),
    ],
)
def test_an_event_line_reads_as_its_object(raw: bytes, event: dict[str, Any]) -> None:
    assert fetchsocket._read_event(io.BytesIO(raw)) == event


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        pytest.param(b"", "^connection closed$", id="closed"),
        pytest.param(b"not json\n", "Expecting value", id="garbage"),
        pytest.param(b'{"event": "acc', "Unterminated string", id="cut-mid-line"),
        pytest.param(
            b'{"event": "done", "pad": "' + b"x" * 70_000 + b'"}\n',
            "Unterminated string",
            id="oversize-line",
        ),
        pytest.param(b"\xff\xfe\n", "utf-16|decode", id="not-utf8"),
    ],
)
def test_an_unreadable_event_line_is_a_value_error(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        fetchsocket._read_event(io.BytesIO(raw))


def test_an_event_line_is_read_at_most_64_kib_at_a_time() -> None:
    reader = io.BytesIO(b"[" + b" " * (1 << 20) + b"]\n")
    with pytest.raises(ValueError):
        fetchsocket._read_event(reader)
    assert reader.tell() == 65536


# -- the client's verdicts, against a scripted peer ------------------------------------------


class Scripted:
    """A Unix socket peer that reads one request line, then sends `script` (bytes, or a
    float: sleep that long), then closes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.script: list[bytes | float] = []
        self.requests: list[bytes] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(8)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as reader:
                self.requests.append(reader.readline(65536))
                for step in self.script:
                    if isinstance(step, float):
                        if self._closing.wait(step):
                            break
                    else:
                        try:
                            conn.sendall(step)
                        except OSError:
                            break

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self._server.close()
        self._thread.join(5)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # A short path: a Unix socket's path is limited to 107 bytes, tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="wc-") as d:
        yield Path(d)


@pytest.fixture
def daemon(sock_dir: Path) -> Iterator[Scripted]:
    peer = Scripted(sock_dir / "daemon.sock")
    yield peer
    peer.close()


def ev(**fields: object) -> bytes:
    return json.dumps(fields).encode() + b"\n"


ACCEPTED = ev(event="accepted")
WAITING = ev(event="waiting")


def ask(peer: Scripted, accept: float = 1.0, silence: float = 1.0) -> dict[str, Any] | None:
    return ask_daemon(peer.path, SRC, UID, accept_timeout=accept, silence_timeout=silence)


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([ACCEPTED, ev(event="done", result=RESULT)], id="done"),
        pytest.param(
            [ACCEPTED, WAITING, WAITING, ev(event="done", result=RESULT)], id="waiting-then-done"
        ),
        pytest.param(
            [ACCEPTED, ev(event="progress", pct=50), ev(event="done", result=RESULT)],
            id="unknown-event-ignored",
        ),
        pytest.param(
            [ACCEPTED, 0.1, WAITING, 0.1, WAITING, 0.1, ev(event="done", result=RESULT)],
            id="slow-but-heartbeating",
        ),
        pytest.param(
            [ACCEPTED + WAITING + ev(event="done", result=RESULT)], id="all-in-one-packet"
        ),
    ],
)
def test_the_daemons_result_is_the_answer(daemon: Scripted, script: list[bytes | float]) -> None:
    daemon.script = script
    assert ask(daemon) == RESULT
    assert daemon.requests == [request(SRC, UID)]


@pytest.mark.parametrize(
    ("script", "exit_code"),
    [
        pytest.param(
            [ACCEPTED, ev(event="error", exit_code=3, message="no SHA256SUMS")], 3, id="source"
        ),
        pytest.param(
            [ACCEPTED, WAITING, ev(event="error", exit_code=4, message="no SHA256SUMS")],
            4,
            id="after-waiting",
        ),
        pytest.param(
            [ACCEPTED, ev(event="error", exit_code="5", message="no SHA256SUMS")],
            5,
            id="code-as-string",
        ),
    ],
)
def test_the_daemons_error_is_a_final_verdict(
    daemon: Scripted, script: list[bytes | float], exit_code: int
) -> None:
    daemon.script = script
    with pytest.raises(DaemonError, match="no SHA256SUMS") as e:
        ask(daemon)
    assert e.value.exit_code == exit_code


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([], id="closes-at-once"),
        pytest.param([ev(event="refused", message="not under --allow-source")], id="refused"),
        pytest.param(
            [ev(event="error", exit_code=2, message="bad request")], id="error-instead-of-accepted"
        ),
        pytest.param([WAITING], id="waiting-before-accepted"),
        pytest.param([ev(event="done", result=RESULT)], id="done-before-accepted"),
        pytest.param([b"hello\n"], id="garbage-first-line"),
        pytest.param([ACCEPTED], id="closes-after-accepting"),
        pytest.param([ACCEPTED, WAITING], id="closes-while-waiting"),
        pytest.param([ACCEPTED, b'{"event": "do'], id="closes-mid-line"),
        pytest.param([ACCEPTED, b"not json\n"], id="garbage-after-accepted"),
        pytest.param([ACCEPTED, b"[" + b" " * 70_000 + b"]\n"], id="oversize-line"),
        pytest.param([ACCEPTED, ev(event="done")], id="done-without-result"),
        pytest.param([ACCEPTED, ev(event="error", exit_code=3)], id="error-without-message"),
        pytest.param([ACCEPTED, ev(event="error", message="m")], id="error-without-code"),
        pytest.param(
            [ACCEPTED, ev(event="error", exit_code="x", message="m")], id="error-code-not-a-number"
        ),
        pytest.param([10.0], id="never-accepts"),
        pytest.param([ACCEPTED, 10.0], id="silent-after-accepting"),
        pytest.param([ACCEPTED, 0.1, WAITING, 10.0], id="silent-after-waiting"),
    ],
)
def test_the_client_falls_back_to_fetching_alone(
    daemon: Scripted, script: list[bytes | float]
) -> None:
    daemon.script = script
    start = time.monotonic()
    assert ask(daemon) is None
    assert time.monotonic() - start < 8.0  # bounded by the 1 s timeouts, never hung


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([b"[]\n"], id="first-line-list"),
        pytest.param([b"null\n"], id="first-line-null"),
        pytest.param([ACCEPTED, b'"done"\n'], id="event-string"),
        pytest.param([ACCEPTED, b"42\n"], id="event-number"),
        pytest.param(
            [ACCEPTED, ev(event="error", exit_code=None, message="m")], id="exit-code-null"
        ),
    ],
)
def test_a_line_that_is_not_an_event_object_falls_back(
    daemon: Scripted, script: list[bytes | float]
) -> None:
    daemon.script = script
    assert ask(daemon) is None


def test_the_accept_timeout_is_the_bound_before_accepted(daemon: Scripted) -> None:
    daemon.script = [3.0]
    start = time.monotonic()
    assert ask(daemon, accept=0.3, silence=60.0) is None
    assert 0.25 <= time.monotonic() - start < 2.5


def test_the_silence_timeout_is_the_bound_after_accepted(daemon: Scripted) -> None:
    daemon.script = [ACCEPTED, 3.0]
    start = time.monotonic()
    assert ask(daemon, accept=60.0, silence=0.3) is None
    assert 0.25 <= time.monotonic() - start < 2.5


def test_no_socket_means_fetch_alone(sock_dir: Path) -> None:
    assert ask_daemon(sock_dir / "daemon.sock", SRC, UID) is None


def test_a_socket_nobody_listens_on_means_fetch_alone(sock_dir: Path) -> None:
    path = sock_dir / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nothing listens: connect is refused
    assert ask_daemon(path, SRC, UID) is None


def test_a_hit_notification_sends_one_hit_request(daemon: Scripted) -> None:
    notify_hit(daemon.path, SRC, UID)
    deadline = time.monotonic() + 5
    while not daemon.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.requests == [request(SRC, UID, op="hit")]


def test_a_hit_notification_without_a_daemon_is_silent(sock_dir: Path) -> None:
    notify_hit(sock_dir / "daemon.sock", SRC, UID)  # no socket: returns, raises nothing


def test_a_socket_nobody_listens_on_is_no_error_for_a_hit(sock_dir: Path) -> None:
    path = sock_dir / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    notify_hit(path, SRC, UID)  # connection refused: swallowed


def test_a_hit_notification_never_blocks_on_a_daemon_that_does_not_accept(sock_dir: Path) -> None:
    # A listener whose backlog is full (a hung daemon): a blocking connect would wait for it
    # for ever, the hit's Pod with it.
    path = sock_dir / "daemon.sock"
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        server.bind(str(path))
        server.listen(0)
        for _ in range(3):
            c = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(str(path))
        t = threading.Thread(target=notify_hit, args=(path, SRC, UID), daemon=True)
        t.start()
        t.join(3.0)
        assert not t.is_alive(), "notify_hit blocked on a daemon that does not accept"


# -- what the Pod's log says when it fetches alone -----------------------------------------


@pytest.mark.parametrize(
    ("script", "level", "says"),
    [
        pytest.param(
            [ev(event="refused", message="s3://x/m/r is not under --allow-source")],
            logging.WARNING,
            "s3://x/m/r is not under --allow-source; fetching alone with this Pod's credentials",
            id="refused-names-the-reason",
        ),
        pytest.param(
            [ev(event="error", exit_code=2, message="bad request")],
            logging.WARNING,
            "node daemon answered {'event': 'error', 'exit_code': 2, 'message': 'bad request'}; "
            "fetching alone",
            id="not-accepted-quotes-the-answer",
        ),
        pytest.param(
            [ACCEPTED],
            logging.WARNING,
            "node daemon stopped answering (connection closed); fetching alone",
            id="closed-says-so",
        ),
    ],
)
def test_falling_back_says_why_in_one_line(
    daemon: Scripted,
    caplog: pytest.LogCaptureFixture,
    script: list[bytes | float],
    level: int,
    says: str,
) -> None:
    daemon.script = script
    with caplog.at_level(logging.INFO, logger=fetchsocket.__name__):
        assert ask(daemon) is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(level, says)]


def test_an_unreachable_daemon_is_named_in_the_log(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = sock_dir / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    with caplog.at_level(logging.INFO, logger=fetchsocket.__name__):
        assert ask_daemon(path, SRC, UID) is None
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith(f"node daemon not reachable at {path} (")
    assert record.getMessage().endswith("Connection refused); fetching alone")
