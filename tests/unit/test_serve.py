"""The connection and request books of the daemon's listeners (weightcache/listeners/admission.py)
and the fetch socket's request check (weightcache/daemon/fetchsocket.py): pure, with literal
clocks."""

from __future__ import annotations

import json

import pytest

from weightcache.daemon import coordinator
from weightcache.daemon.fetchsocket import parse_request
from weightcache.listeners.admission import Conn, ConnectionLimits, Connections, Requests

LIMITS = ConnectionLimits(connections=3, idle=30.0, header=10.0)


def conn(since: float = 0.0) -> Conn:
    return Conn(close=lambda: None, idle_since=since)


def test_below_the_cap_every_connection_is_admitted() -> None:
    books = Connections(LIMITS)
    conns = [conn(t) for t in (0.0, 1.0, 2.0)]
    assert [books.admit(c) for c in conns] == [None, None, None]
    assert books.open == conns


def test_at_the_cap_the_longest_idle_makes_room() -> None:
    books = Connections(LIMITS)
    a, b, c = conn(5.0), conn(1.0), conn(3.0)
    for x in (a, b, c):
        books.admit(x)
    Connections.started(b)  # busy: never evicted, however old
    new = conn(9.0)
    assert books.admit(new) is c
    assert books.open == [a, b, new]


def test_at_the_cap_with_every_connection_busy_the_new_one_is_refused() -> None:
    books = Connections(LIMITS)
    conns = [conn() for _ in range(3)]
    for c in conns:
        books.admit(c)
        Connections.started(c)
    new = conn(9.0)
    assert books.admit(new) is new
    assert books.open == conns


def test_scrapes_at_their_cap_are_refused_and_probes_still_taken() -> None:
    """Admission by request, not by connection: a connection's path is unknown until its
    request is read, so only then can a scraper be told from the kubelet's probe."""
    reqs = Requests(ConnectionLimits(connections=8, idle=30.0, header=10.0, requests=2, probes=1))
    assert [reqs.take("/metrics") for _ in range(3)] == [True, True, False]
    assert reqs.take("/healthz") and not reqs.take("/readyz"), "one probe at once"
    reqs.done("/healthz")
    assert reqs.take("/readyz"), "a probe's slot is free again"
    reqs.done("/metrics")
    assert reqs.take("/metrics") and not reqs.take("/metrics")


def test_without_probe_slots_probes_count_with_the_other_requests() -> None:
    reqs = Requests(ConnectionLimits(connections=8, idle=30.0, header=10.0, requests=1))
    assert reqs.take("/healthz") and not reqs.take("/metrics")
    reqs.done("/healthz")
    unbounded = Requests(LIMITS)  # requests=0: only the connection cap bounds them
    assert all(unbounded.take("/x") for _ in range(100))


def test_idle_and_header_deadlines() -> None:
    books = Connections(LIMITS)
    idle, trickling, busy, fresh = conn(0.0), conn(0.0), conn(0.0), conn(25.0)
    for c in (idle, trickling, busy):
        books.admit(c)
    books.forget(busy)
    books.admit(fresh)
    Connections.received(trickling, 5.0)
    Connections.received(trickling, 14.0)  # later bytes do not move the header deadline
    assert books.expired(15.0) == []
    assert books.expired(15.1) == [trickling]  # 10 s after its first byte
    Connections.started(idle)
    assert books.expired(100.0) == [fresh]  # idle for 75 s; a busy one never expires
    Connections.finished(idle, 100.0)
    assert books.expired(129.0) == []
    assert books.expired(130.5) == [idle]
    assert books.open == []


def test_bytes_during_a_request_do_not_start_a_header_clock() -> None:
    books = Connections(LIMITS)
    c = conn(0.0)
    books.admit(c)
    Connections.started(c)
    Connections.received(c, 1.0)
    Connections.finished(c, 2.0)
    assert c.head_since is None
    assert books.expired(31.0) == []


UID = "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94"


def line(**fields: object) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def test_a_valid_request_passes_with_its_pod_uid_normalised() -> None:
    msg = parse_request(line(op="fetch", source="s3://b/m/r", name="m", revision="r",
                             pod_uid=UID.upper()))  # fmt: skip
    assert msg == {"op": "fetch", "source": "s3://b/m/r", "name": "m", "revision": "r",
                   "pod_uid": UID}  # fmt: skip
    assert parse_request(line(op="hit", source="s3://b/m/r", pod_uid=""))["pod_uid"] is None


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (line(op="fetch", source="s3://b/m/r", name=5), '"name" must be a string'),
        (line(op="fetch", source="s3://b/m/r", revision=["r"]), '"revision" must be'),
        (line(op="fetch", source="s3://b/m/r", pod_uid=7), '"pod_uid" must be'),
        (line(op="fetch", source="s3://b/m/r", pod_uid="../../.."), "Pod UID"),
        (line(op="fetch", source="s3://b/m/r", pod_uid="a" * 300), "Pod UID"),
        (line(op="fetch"), '"source" must be a string'),
        (line(op="fetch", source=None), '"source" must be a string'),
        (line(op="delete", source="s3://b/m/r"), 'unknown "op"'),
        (b"[" * 50_000, "nested too deeply"),
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object expected"),
        (b"", "not JSON"),
    ],
)
def test_malformed_requests_say_what_is_wrong(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        parse_request(raw)


def test_a_socket_replaced_while_it_is_made_is_one_usage_error(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A file swapped in at the socket's name between bind and chmod: exit 2 in one line,
    not a ValueError traceback, and nothing chmod-ed."""
    import asyncio

    from weightcache.errors import UsageError

    def swapped(path, mode, kind):  # type: ignore[no-untyped-def]
        path.unlink()
        path.write_text("planted")
        return real(path, mode, kind)

    real = coordinator.chmod_own
    monkeypatch.setattr(coordinator, "chmod_own", swapped)
    server = coordinator.SocketServer(
        tmp_path / "s", lambda line, send: None, ConnectionLimits(4, 1.0, 1.0), 4096
    )
    with pytest.raises(UsageError, match="was replaced"):
        asyncio.run(server.start())
    assert (tmp_path / "s").stat().st_mode & 0o777 != 0o666
