"""az:// and abfs:// sources: parsing, and the pure decisions of transfer/backends/azure.py (where a
source's account comes from, which refusal is retried, throttled or final)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
from typing import Any

import pytest

from weightcache.errors import IntegrityError, SourceError, TransientError, UsageError
from weightcache.sourceurl import Source, SourcePrefix
from weightcache.transfer.backends import azure
from weightcache.transfer.backends.azure import (
    _AzureRange,
    connection_string_account,
    refused,
    split_location,
)
from weightcache.transfer.pacing import Backoff, Retries
from weightcache.transfer.sources import RetryRange

ABFS = "abfs://models@acct01.dfs.core.windows.net"


@pytest.mark.parametrize(
    ("url", "scheme", "bucket", "prefix"),
    [
        ("az://models/team/llama/v1", "az", "models", "team/llama/v1"),
        ("az://my-models/llama/v1/", "az", "my-models", "llama/v1"),
        (f"{ABFS}/team/llama/v1", "abfs", "models@acct01.dfs.core.windows.net", "team/llama/v1"),
    ],
)
def test_source_parse_azure(url: str, scheme: str, bucket: str, prefix: str) -> None:
    src = Source.parse(url)
    assert (src.scheme, src.bucket, src.prefix) == (scheme, bucket, prefix)
    assert (src.name, src.revision) == ("llama", "v1")
    assert src.url == url.rstrip("/")  # what the marker records


@pytest.mark.parametrize(
    "url",
    [
        "az://models/only-one",
        "az://Models/llama/v1",  # container names are lowercase
        "az://ab/llama/v1",  # 3 to 63 characters
        "az://my--models/llama/v1",  # no two hyphens in a row
        "az://models@acct01.dfs.core.windows.net/llama/v1",  # the host form is abfs://
        "abfs://models/llama/v1",  # abfs:// names its account's host
        "abfs://models@acct01.blob.core.windows.net/llama/v1",
        "abfs://models@ACCT.dfs.core.windows.net/llama/v1",
        "az://models/a/../v1",
    ],
)
def test_source_parse_azure_invalid(url: str) -> None:
    with pytest.raises(UsageError) as info:
        Source.parse(url)
    assert "az://container/prefix/<name>/<revision>" in str(info.value)


def test_allow_source_covers_a_container_by_scheme_and_segments() -> None:
    whole = SourcePrefix.parse("az://models")
    team = SourcePrefix.parse("az://models/team")
    assert whole.covers(Source.parse("az://models/x/llama/v1"))
    assert team.covers(Source.parse("az://models/team/llama/v1"))
    assert not team.covers(Source.parse("az://models/teamB/llama/v1"))
    assert not whole.covers(Source.parse("s3://models/x/llama/v1"))
    assert not whole.covers(Source.parse(f"{ABFS}/x/llama/v1"))
    assert str(team) == "az://models/team"


def test_split_location() -> None:
    assert split_location("models") == ("models", None)
    assert split_location("models@acct01.dfs.core.windows.net") == ("models", "acct01")


def test_connection_string_account() -> None:
    conn = "DefaultEndpointsProtocol=https;AccountName=acct01;AccountKey=k=="
    env = {"AZURE_STORAGE_CONNECTION_STRING": conn}
    assert connection_string_account(env) == "acct01"
    assert connection_string_account({}) is None
    assert connection_string_account({"AZURE_STORAGE_CONNECTION_STRING": "BlobEndpoint=x"}) is None


@pytest.mark.parametrize(
    ("status", "code", "kind", "throttle"),
    [
        (503, "ServerBusy", RetryRange, True),
        (429, "", RetryRange, True),
        (500, "OperationTimedOut", RetryRange, True),
        (500, "InternalError", RetryRange, False),
        (408, "", RetryRange, False),
        (403, "AuthenticationFailed", SourceError, None),
        (404, "BlobNotFound", SourceError, None),
        (404, "ContainerNotFound", SourceError, None),
        (416, "InvalidRange", SourceError, None),
        (400, "InvalidQueryParameterValue", SourceError, None),
    ],
)
def test_refusals(status: int, code: str, kind: type, throttle: bool | None) -> None:
    error = refused("az://models/a/m/r1/x.bin", status, code)
    assert isinstance(error, kind)
    assert "az://models/a/m/r1/x.bin" in str(error) or kind is RetryRange
    if isinstance(error, RetryRange):
        assert error.throttle is throttle
    if status == 403:
        assert "AZURE_STORAGE_CONNECTION_STRING" in str(
            error
        ) and "Storage Blob Data Reader" in str(error)


class _Blob:
    """An AzureBlob's `submit` over bytes in memory: each GET's future is done at once,
    except those listed in `hold` (never answered)."""

    where = "az://models/m/r1/x.bin"

    def __init__(self, data: bytes, total: int | None = None, short: int = 0) -> None:
        self.data, self.total, self.short = data, total, short
        self.asked: list[tuple[int, int]] = []
        self.futures: list[cf.Future[tuple[bytes, int]]] = []
        self.hold: set[int] = set()

    def submit(self, offset: int, length: int) -> cf.Future[tuple[bytes, int]]:
        self.asked.append((offset, length))
        future: cf.Future[tuple[bytes, int]] = cf.Future()
        if offset not in self.hold:
            body = self.data[offset : offset + length - self.short]
            future.set_result((body, len(self.data) if self.total is None else self.total))
        self.futures.append(future)
        return future


def _read_all(reader: _AzureRange, step: int) -> bytes:
    out = bytearray()
    buf = memoryview(bytearray(step))
    while n := reader.readinto(buf):
        out += buf[:n]
    return bytes(out)


@pytest.mark.parametrize("step", [1, 3, 10, 64])
def test_a_range_is_read_in_chunks_one_ahead(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    monkeypatch.setattr(azure, "CHUNK", 10)
    data = bytes(range(100))
    blob = _Blob(data)
    reader = _AzureRange(blob, 5, 47, 100, 1.0)  # type: ignore[arg-type]
    assert blob.asked == [(5, 10)]  # the first GET leaves before the first read
    assert _read_all(reader, step) == data[5:47]
    assert blob.asked == [(5, 10), (15, 10), (25, 10), (35, 10), (45, 2)]


def test_a_blob_of_another_size_is_an_integrity_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(azure, "CHUNK", 10)
    reader = _AzureRange(_Blob(bytes(100), total=101), 0, 30, 100, 1.0)  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match="101 bytes now but was 100"):
        reader.readinto(memoryview(bytearray(10)))


def test_a_short_chunk_is_retried_not_stitched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(azure, "CHUNK", 10)
    reader = _AzureRange(_Blob(bytes(100), short=1), 0, 30, 100, 1.0)  # type: ignore[arg-type]
    with pytest.raises(RetryRange, match="9 bytes of a 10-byte range"):
        reader.readinto(memoryview(bytearray(10)))


def test_a_chunk_that_never_comes_is_retried_and_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(azure, "CHUNK", 10)
    blob = _Blob(bytes(100))
    blob.hold = {10}
    reader = _AzureRange(blob, 0, 30, 100, 0.05)  # type: ignore[arg-type]
    assert reader.readinto(memoryview(bytearray(10))) == 10
    with pytest.raises(RetryRange, match="no answer"):
        reader.readinto(memoryview(bytearray(10)))
    assert blob.futures[1].cancelled()
    reader.close()
    assert all(f.done() for f in blob.futures)


def test_a_control_call_logs_each_attempt_and_gives_up_in_the_shared_wording(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An account that resets every connection: each attempt logged (the first a warning),
    then one TransientError counting them; a refusal is not retried."""
    monkeypatch.setattr(azure, "_filesystem", lambda account: object())
    failures: list[BaseException] = []

    def submit(fs: Any, coro: Any) -> cf.Future[Any]:
        coro.close()
        future: cf.Future[Any] = cf.Future()
        future.set_exception(failures.pop(0) if failures else ConnectionResetError("reset"))
        return future

    async def listing() -> None:
        return None

    monkeypatch.setattr(azure, "_submit", submit)
    revision = azure.AzureRevision("az://c/m/r", "c", "m/r", 600.0)
    revision._retries = Retries(600.0, 3, Backoff(base=0.0, cap=0.0))
    where = "az://c/m/r/"
    with caplog.at_level(logging.DEBUG, "weightcache"), pytest.raises(TransientError) as raised:
        revision._call(where, listing)
    assert str(raised.value) == (
        f"giving up on {where} after 3 attempts in 0s, last: ConnectionResetError: reset; "
        "check that the storage account is reachable"
    )
    assert [(r.levelno, r.getMessage().split(" (")[0]) for r in caplog.records] == [
        (logging.WARNING, f"{where}: attempt 1/3 failed"),
        (logging.DEBUG, f"{where}: attempt 2/3 failed"),
    ]
    failures.append(azure.refused(where, 404, "ContainerNotFound"))
    with pytest.raises(SourceError):
        revision._call(where, listing)
