"""az:// and abfs:// sources: parsing, and the pure decisions of transfer/azure.py (where a
source's account comes from, which refusal is retried, throttled or final)."""

from __future__ import annotations

import pytest

from weightcache.config import Source, SourcePrefix
from weightcache.errors import SourceError, UsageError
from weightcache.transfer.azure import connection_string_account, refused, split_location
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
