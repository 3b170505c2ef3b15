"""The peer protocol's headers treated as hostile (design §8, Peers), with Hypothesis: whatever
a peer or a client sends, each parse gives a well-formed value or one clean error (a
ValueError, a RetryRange, a WeightcacheError), never anything else, and what a node makes
of a peer's advertisement never stops its choice."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.config import PeerSettings
from weightcache.errors import WeightcacheError
from weightcache.swarm.choice import Local, RequestLimits, StoreView, choose
from weightcache.swarm.client import Peers
from weightcache.swarm.entry import NodeSwarm
from weightcache.swarm.pieces import Bitmap, piece_count, piece_size_for
from weightcache.swarm.server import parse_range, refusal
from weightcache.swarm.views import PeerViews
from weightcache.swarm.wire import FETCHING, LOAD, PIECE_SIZE, PIECES, REFUSAL_REASONS, STREAMING
from weightcache.transfer.httpclient import check_status
from weightcache.transfer.sources import RetryRange

MiB = 1 << 20
TOKEN = "t" * 32

#: Header values: garbage, near misses, numbers of any size, and base64 of any length.
values = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["all", "ALL", "", "0", "-1", "4096", " 262144 ", "1e3", "0x1000", "١٢"]),
    st.integers(-(2**70), 2**70).map(str),
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
)
advertisements = st.dictionaries(st.sampled_from([PIECES, PIECE_SIZE, FETCHING, STREAMING, LOAD]),
                                 values)  # fmt: skip
sizes = st.integers(0, 64 * MiB)


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    p = NodeSwarm(PeerSettings(("127.0.0.1", 9401), TOKEN))
    yield p
    p.close()


@settings(max_examples=300, deadline=None)
@given(size=sizes, advertised=st.lists(advertisements, min_size=1, max_size=3))
def test_any_advertisement_is_a_view_or_none_and_the_choice_goes_on(
    peers: Peers, size: int, advertised: list[dict[str, str]]
) -> None:
    piece = piece_size_for(size)
    count = piece_count(size, piece)
    views = PeerViews(peers, "0" * 64, size, piece)
    for i, headers in enumerate(advertised):
        views.heard(f"http://10.0.0.{i}:9401", headers, piece_answer=i % 2 == 0)
    seen, rank, members = views.current()
    for view in seen:
        assert {view.have.count, view.fetching.count} == {count} and view.load >= 0
        assert view.streaming is None or view.streaming.count == count
    local = Local(Bitmap(count), {}, rank, members)
    for request in choose(local, seen, StoreView(), RequestLimits(), random.Random(0)):
        assert 0 <= request.piece < count


@settings(max_examples=300, deadline=None)
@given(header=st.one_of(st.none(), st.text(max_size=40),
                        st.from_regex(r"\s*bytes=\d{0,25}-\d{0,25}\s*", fullmatch=True)),
       size=st.integers(1, 2**64))  # fmt: skip
def test_any_range_header_is_one_range_in_the_blob_or_a_value_error(
    header: str | None, size: int
) -> None:
    try:
        wanted = parse_range(header, size)
    except ValueError:
        assert header is not None
        return
    assert (wanted is None) is (header is None)
    if wanted is not None:
        start, end = wanted
        assert 0 <= start < end <= size


@settings(max_examples=300, deadline=None)
@given(header=st.one_of(st.none(), st.text(max_size=60),
                        st.sampled_from([f"Bearer {TOKEN}", f"bearer  {TOKEN} ", "Bearer",
                                         f"Basic {TOKEN}", f"Bearer {TOKEN}x"])))  # fmt: skip
def test_any_authorization_is_the_token_or_one_refusal_reason(header: str | None) -> None:
    reason = refusal(header, TOKEN)
    scheme, _, given_token = (header or "").strip().partition(" ")
    ok = scheme.lower() == "bearer" and given_token.strip() == TOKEN
    assert reason is None if ok else reason in REFUSAL_REASONS


class _Answer:
    """A peer's answer to a piece request, as check_status reads it."""

    def __init__(self, status: int, content_range: str | None, body: bytes) -> None:
        self.status, self.content_range, self.body = status, content_range, body

    def getheader(self, name: str, default: str = "") -> str:
        assert name == "Content-Range"
        return default if self.content_range is None else self.content_range

    def read(self, n: int) -> bytes:
        return self.body[:n]


@settings(max_examples=300, deadline=None)
@given(status=st.integers(100, 599),
       content_range=st.one_of(st.none(), values,
                               st.from_regex(r"bytes \d{1,12}-\d{1,12}/\d{1,12}", fullmatch=True)),
       body=st.sampled_from([b"", b"SlowDown", b"x" * 5000]),
       start=st.integers(0, 4 * MiB), length=st.integers(1, 4 * MiB))  # fmt: skip
def test_any_answer_to_a_piece_request_is_its_bytes_or_a_clean_error(
    status: int, content_range: str | None, body: bytes, start: int, length: int
) -> None:
    size = start + length + 1
    answer = _Answer(status, content_range, body)
    try:
        skip = check_status(answer, start, start + length, size, "peer")  # type: ignore[arg-type]
    except (RetryRange, WeightcacheError):
        return
    assert skip == 0
    assert status == 206 and content_range == f"bytes {start}-{start + length - 1}/{size}"
