"""gs:// sources as the settings parse them (design §4, Revision sources): the same rules
as s3://, a scheme of their own for markers and --allow-source."""

from __future__ import annotations

import pytest

from weightcache.errors import UsageError
from weightcache.sourceurl import Source, SourcePrefix


def test_a_gs_source_parses_like_s3() -> None:
    src = Source.parse("gs://my-models.example.com/team/llama/v1/")
    assert (src.scheme, src.bucket, src.prefix) == ("gs", "my-models.example.com", "team/llama/v1")
    assert (src.name, src.revision, src.url) == (
        "llama",
        "v1",
        "gs://my-models.example.com/team/llama/v1",
    )


@pytest.mark.parametrize(
    "url", ["gs://", "gs://b/v1", "gs://Models/m/v1", "gs://models/a//v1", "gs://models/../v1"]
)
def test_bad_gs_sources_are_usage_errors(url: str) -> None:
    with pytest.raises(UsageError, match="gs://bucket/prefix/<name>/<revision>"):
        Source.parse(url)


@pytest.mark.parametrize(
    ("prefix", "source", "expected"),
    [
        ("gs://models", "gs://models/team/llama/v1", True),
        ("gs://models/", "gs://models/team/llama/v1", True),
        ("gs://models/team", "gs://models/teamB/llama/v1", False),
        ("s3://models", "gs://models/team/llama/v1", False),  # schemes differ
        ("gs://models", "s3://models/team/llama/v1", False),
    ],
)
def test_allow_source_matches_gs_prefixes_by_scheme(
    prefix: str, source: str, expected: bool
) -> None:
    assert SourcePrefix.parse(prefix).covers(Source.parse(source)) is expected


def test_gcsfs_errors_map_to_exit_codes() -> None:
    """What gcsfs raises after its own retries, as the exit codes of design §2.2."""
    from gcsfs.retry import HttpError

    from weightcache.errors import SourceError, TransientError
    from weightcache.transfer.backends.gcs import _error

    where = "gs://models/team/llama/v1"
    missing = _error(FileNotFoundError("b/models/o"), where)
    assert isinstance(missing, SourceError) and "not found" in str(missing)
    for denied in (OSError("Forbidden: b/models/o\nno access"), HttpError({"code": 401})):
        error = _error(denied, where)
        assert isinstance(error, SourceError), denied
        assert "GOOGLE_APPLICATION_CREDENTIALS" in str(error) and "workload identity" in str(error)
    for busy in (HttpError({"code": 429}), HttpError({"code": 503}), TimeoutError()):
        assert isinstance(_error(busy, where), TransientError), busy
    # a call that used up --timeout (asyncio's TimeoutError, whose text is empty)
    assert "no answer from GCS within --timeout" in str(_error(TimeoutError(), where))
