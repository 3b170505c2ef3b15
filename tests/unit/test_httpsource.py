"""The pure decisions of http(s):// sources (design §4, Revision sources): what a web
server's answer to a ranged GET means, which paths a SHA256SUMS names, and how a blob
that can only be sent whole is read."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path
from typing import cast

import pytest

from tests.support.pauses import interrupted_in_pause, long_backoff
from tests.support.webservers import silent_server
from weightcache.errors import IntegrityError, Interrupted, SourceError, TransientError, UsageError
from weightcache.transfer import httpclient
from weightcache.transfer.backends.file import FileBlob
from weightcache.transfer.backends.http import (
    TOKEN_ENV,
    HttpBlob,
    HttpRevision,
    auth_headers,
    check_http_status,
    manifest_paths,
)
from weightcache.transfer.httpclient import HttpRanges, check_status
from weightcache.transfer.pacing import Retries
from weightcache.transfer.sources import RetryRange, part_size_for

URL = "http://h/m/v1/model.bin"


class _Answer:
    """The status and headers of a response (what the checks read), with a small body."""

    def __init__(self, status: int, **headers: str) -> None:
        self.status = status
        self._headers = {k.replace("_", "-").lower(): v for k, v in headers.items()}

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self._headers.get(name.lower(), default)

    def read(self, n: int = -1) -> bytes:
        return b""


def check(status: int, start: int = 0, end: int = 10, size: int = 100, **headers: str) -> int:
    answer = cast(http.client.HTTPResponse, _Answer(status, **headers))
    return check_http_status(answer, start, end, size, URL)


def test_a_206_must_be_exactly_the_range_asked_for() -> None:
    assert check(206, 10, 20, Content_Range="bytes 10-19/100") == 0
    with pytest.raises(IntegrityError, match="is 99 bytes now but was 100"):
        check(206, 10, 20, Content_Range="bytes 10-19/99")
    with pytest.raises(SourceError, match="asked for bytes 10-19"):
        check(206, 10, 20, Content_Range="bytes 0-19/100")
    with pytest.raises(SourceError, match="Content-Range ''"):
        check(206, 10, 20)


def test_sizes_in_other_digits_than_ascii_are_no_sizes_not_a_traceback() -> None:
    """str.isdigit() says yes to `²`, which int() refuses: a hostile server's header."""
    with pytest.raises(SourceError, match="Content-Range 'bytes 10-19/²'"):
        check(206, 10, 20, Content_Range="bytes 10-19/²")
    assert check(200, 40, 60, Content_Length="²") == 40  # no size said: the hash decides
    for header in ("²", "1²"):
        answer = cast(http.client.HTTPResponse, _Answer(206, Content_Range=f"bytes 0-9/{header}"))
        with pytest.raises(RetryRange, match="got Content-Range"):
            check_status(answer, 0, 10, 100, URL)


def test_the_store_s_206_must_be_the_range_asked_for_or_it_is_read_again() -> None:
    """An S3 store's (or a peer's) 206 of other bytes would land at the offset asked for."""

    def store(**headers: str) -> int:
        return check_status(cast(http.client.HTTPResponse, _Answer(206, **headers)), 10, 20,
                            100, URL)  # fmt: skip

    assert store(Content_Range="bytes 10-19/100") == 0
    for got in ("bytes 11-20/100", "bytes 10-29/100", ""):
        with pytest.raises(RetryRange, match=f"got Content-Range '{got}'"):
            store(Content_Range=got) if got else store()
    with pytest.raises(IntegrityError, match="is 99 bytes now"):
        store(Content_Range="bytes 10-19/99")


class _Endless(_Answer):
    """A body that never ends (or one that says it is huge), read in what is asked."""

    def __init__(self, **headers: str) -> None:
        super().__init__(200, **headers)
        self.asked: list[int] = []

    def read1(self, n: int = -1) -> bytes:
        assert n >= 0, "an unbounded read of an endless body"
        self.asked.append(n)
        return b"x" * n

    def close(self) -> None: ...

    def isclosed(self) -> bool:
        return True


def test_a_small_answer_over_its_bound_is_refused_not_read_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SHA256SUMS (or a listing page) that never ends grew a fetch to 12 GB."""
    monkeypatch.setattr(httpclient, "SMALL_BODY_MAX", 1000)
    endless = _Endless()
    with pytest.raises(SourceError, match="GET x: the answer is over"):
        httpclient.read_small_body(cast(http.client.HTTPResponse, endless), "GET x")
    assert endless.asked == [1001]
    huge = _Endless(Content_Length=str(50 << 30))
    with pytest.raises(SourceError, match="GET x: the answer is over"):
        httpclient.read_small_body(cast(http.client.HTTPResponse, huge), "GET x")
    assert huge.asked == []  # refused by its length, unread
    parts = [b"01234", b"56789", b""]
    small = _Endless(Content_Length="10")
    small.read1 = lambda n=-1: parts.pop(0)  # type: ignore[method-assign]
    assert httpclient.read_small_body(cast(http.client.HTTPResponse, small), "GET x") == (
        b"0123456789"
    )
    cut = [b"01234", b""]  # the connection closed half way: read1 returns b"" as at the end
    short = _Endless(Content_Length="10")
    short.read1 = lambda n=-1: cut.pop(0)  # type: ignore[method-assign]
    with pytest.raises(http.client.IncompleteRead, match="5 more expected"):
        httpclient.read_small_body(cast(http.client.HTTPResponse, short), "GET x")


def test_a_small_answer_that_trickles_is_cut_as_a_stall() -> None:
    """A SHA256SUMS sent a byte a second never ended: each read beat the socket timeout."""
    trickle = _Endless()
    trickle.read1 = lambda n=-1: b"x"  # type: ignore[method-assign]
    with pytest.raises(TimeoutError, match="a trickle"):
        httpclient.read_small_body(cast(http.client.HTTPResponse, trickle), "GET x", stall=0.0)
    steady = [b"y" * 2048] * 3 + [b""]
    flowing = _Endless()
    flowing.read1 = lambda n=-1: steady.pop(0)  # type: ignore[method-assign]
    body = httpclient.read_small_body(cast(http.client.HTTPResponse, flowing), "GET x", stall=0.0)
    assert body == b"y" * 6144


def test_a_200_is_the_whole_file_whose_prefix_is_skipped() -> None:
    assert check(200, 0, 100, Content_Length="100") == 0
    assert check(200, 40, 60, Content_Length="100") == 40
    with pytest.raises(IntegrityError, match="is 120 bytes now"):
        check(200, 40, 60, Content_Length="120")
    with pytest.raises(IntegrityError, match="shorter now"):
        check(416, 40, 60)


@pytest.mark.parametrize(("status", "throttle"), [(429, True), (503, True), (500, False),
                                                  (502, False), (408, False)])  # fmt: skip
def test_transient_answers_are_retried_and_429_503_slow_down(status: int, throttle: bool) -> None:
    with pytest.raises(RetryRange) as info:
        check(status)
    assert info.value.throttle is throttle


def test_refusals_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTCACHE_HTTP_TOKEN", raising=False)
    with pytest.raises(SourceError, match="no token: set WEIGHTCACHE_HTTP_TOKEN"):
        check(401)
    monkeypatch.setenv("WEIGHTCACHE_HTTP_TOKEN", "t")
    with pytest.raises(SourceError, match="the token in WEIGHTCACHE_HTTP_TOKEN"):
        check(403)
    with pytest.raises(SourceError, match="404, no such file"):
        check(404)
    with pytest.raises(SourceError, match="to https://x/y; redirects are not followed"):
        check(301, Location="https://x/y")


@pytest.mark.parametrize("token", ["abc\ndef", "abc def", "abc\u00e9"])
def test_a_token_no_header_can_carry_is_a_usage_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    monkeypatch.setenv(TOKEN_ENV, token)
    with pytest.raises(UsageError, match=TOKEN_ENV):
        auth_headers()
    monkeypatch.setenv(TOKEN_ENV, "  abc.def_1~+/=\n")  # a Secret's trailing newline
    assert auth_headers() == {"Authorization": "Bearer abc.def_1~+/="}


def test_manifest_paths_are_the_named_files_in_order() -> None:
    h = "ab" * 32
    data = f"{h}  b.bin\n{h} *./sub/a b.json\r\nnot a line\n{h}  ../escape\n\n{h}  c".encode()
    assert manifest_paths(data) == ["b.bin", "sub/a b.json", "c"]
    # Never asked of the server (the fetch refuses the manifest for them, exit 3).
    assert manifest_paths(f"{h}  a\x00b\n{h}  tab\there\n".encode()) == []


def test_a_blob_sent_only_whole_is_read_in_one_part() -> None:
    http = HttpRanges()
    blob = HttpBlob(http, URL, "http://h/m/v1")
    assert part_size_for(blob, 100 << 20, 16 << 20) == 16 << 20
    http.whole_only.add("http://h/m/v1")
    assert blob.whole_only
    assert part_size_for(blob, 100 << 20, 16 << 20) == 100 << 20
    assert part_size_for(blob, 0, 16 << 20) == 1
    assert part_size_for(FileBlob(Path("/nowhere")), 100, 16) == 16


def test_a_missing_file_ends_the_listing_within_a_few_windows_of_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest of a million lines whose first file is missing sent 71,042 HEADs (every
    one queued at once) before it failed."""
    from weightcache.transfer.backends.http import HEADS_IN_FLIGHT, HttpRevision

    revision = HttpRevision(cast(HttpRanges, None), "http://127.0.0.1:1/m/r", 30.0)
    h = "ab" * 32
    manifest = "".join(f"{h}  f{i}\n" for i in range(10_000)).encode()
    monkeypatch.setattr(revision, "_read_manifest", lambda: manifest)
    asked: list[str] = []

    def head(relpath: str) -> int:
        asked.append(relpath)
        raise SourceError(f"HEAD {relpath}: HTTP 404, no such file on the server")

    monkeypatch.setattr(revision, "_head", head)
    with pytest.raises(SourceError, match="HTTP 404"):
        revision.list_sizes()
    assert len(asked) <= 4 * HEADS_IN_FLIGHT, len(asked)


def test_a_silent_server_is_given_up_on_within_the_timeout_and_once() -> None:
    """--timeout bounds the control plane: the listing and the manifest's read (two threads
    of a fetch) end within it, and the second reader takes the first one's failure rather
    than trying again for as long (a fetch with --timeout 5s took 6 minutes)."""
    with silent_server() as server:
        revision = HttpRevision(HttpRanges(), f"{server.url}/m/r", timeout=1.0)
        began = time.monotonic()
        with pytest.raises(TransientError, match=r"SHA256SUMS after 1 attempt in 1s.*--timeout"):
            revision.list_sizes()
        assert time.monotonic() - began < 3.0
        began = time.monotonic()
        with pytest.raises(TransientError):
            revision.read_bytes("SHA256SUMS")
        assert time.monotonic() - began < 0.5
        assert server.accepted == 1


def test_interrupt_ends_a_listing_waiting_on_a_silent_server() -> None:
    """SIGTERM during the control plane: the request in flight ends at once (its socket
    shut down) and no other starts; without it the fetch held on for its whole timeout."""
    with silent_server() as server:
        http = HttpRanges()
        revision = HttpRevision(http, f"{server.url}/m/r", timeout=60.0)
        raised: list[BaseException] = []

        def listing() -> None:
            try:
                revision.list_sizes()
            except BaseException as e:
                raised.append(e)

        thread = threading.Thread(target=listing)
        thread.start()
        deadline = time.monotonic() + 5
        while server.accepted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the GET sent, waiting for its answer
        http.interrupt()
        thread.join(5.0)
        assert not thread.is_alive()
        assert [type(e) for e in raised] == [Interrupted]
        assert server.accepted == 1
        with pytest.raises(Interrupted):  # and nothing new starts
            http.request("GET", f"{server.url}/m/r/x", {}, 5.0, None)


def test_interrupt_ends_the_pause_between_two_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while a request is waiting to be sent again (a 503, then its backoff): the
    wait ends at once, Interrupted, and no other attempt is made."""
    http = HttpRanges()
    revision = HttpRevision(http, "http://h/m/r", timeout=600.0)
    revision._retries = Retries(600.0, 6, long_backoff())
    failed = threading.Event()
    attempts: list[str] = []

    def request(*args: object, **kwargs: object) -> object:
        attempts.append(str(args[1]))
        failed.set()
        raise RetryRange("HTTP 503")

    monkeypatch.setattr(http, "request", request)
    raised = interrupted_in_pause(lambda: revision.read_bytes("SHA256SUMS"), failed, http.interrupt)
    assert [type(e) for e in raised] == [Interrupted] and len(attempts) == 1
