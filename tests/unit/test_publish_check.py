"""publish's check that the store holds what it uploaded (weightcache/ops/publish.py):
one listing after the uploads; a store that lists other sizes, or no S3 store at all, is
exit 3; credentials that may upload but not list skip the check with a warning."""

from __future__ import annotations

import logging

import pytest

from weightcache.errors import AccessDenied, SourceError
from weightcache.ops.publish import check_landed
from weightcache.sourceurl import Source

DEST = Source.parse("s3://models/team/m/r1")
SIZES = {"a.bin": 10, "config.json": 2}


class Listed:
    """A store whose listing of the prefix is `listed`, or raises it."""

    def __init__(self, listed: dict[str, int] | Exception) -> None:
        self.listed = listed

    def list_sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        assert (bucket, prefix) == ("models", "team/m/r1")
        if isinstance(self.listed, Exception):
            raise self.listed
        return self.listed


def test_every_file_listed_at_its_size_passes() -> None:
    check_landed(Listed({**SIZES, "SHA256SUMS": 99}), DEST, SIZES)


@pytest.mark.parametrize("listed", [{}, {"a.bin": 10, "config.json": 3}], ids=["none", "size"])
def test_a_file_not_listed_at_its_size_is_a_source_error(listed: dict[str, int]) -> None:
    with pytest.raises(SourceError, match="does not list it at its size"):
        check_landed(Listed(listed), DEST, SIZES)


def test_credentials_that_may_not_list_skip_the_check_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    denied = AccessDenied("LIST s3://models/team/m/r1/: access denied (AccessDenied)")
    with caplog.at_level(logging.WARNING):
        check_landed(Listed(denied), DEST, SIZES)
    assert "not checked" in caplog.text and "access denied" in caplog.text, caplog.text


def test_a_listing_that_is_no_listing_is_still_an_error() -> None:
    with pytest.raises(SourceError, match="not ListObjectsV2"):
        check_landed(Listed(SourceError("... not ListObjectsV2 XML ...")), DEST, SIZES)
