"""manifest.parse over arbitrary input (Hypothesis): whatever the bytes, the result is a
valid Manifest or a WeightcacheError with the exit code of a bad manifest, never another
exception."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.cache import manifest
from weightcache.cache.manifest import Manifest, check_path
from weightcache.errors import WeightcacheError

WHERE = "s3://models/m/r/SHA256SUMS"
_HEX = st.text("0123456789abcdefABCDEF", min_size=63, max_size=65)
_NAME = st.text(st.characters(codec="utf-8"), max_size=40)
#: Lines near the grammar (sha256sum's two forms, the BSD tag form), so that the valid
#: branch is reached, not only the rejections of random noise.
_LINE = st.one_of(
    st.builds(lambda h, sep, name: f"{h} {sep}{name}", _HEX, st.sampled_from(" *"), _NAME),
    st.builds(lambda h, name: f"SHA256 ({name}) = {h}", _HEX, _NAME),
    _NAME,
)
_TEXT = st.lists(_LINE, max_size=8).flatmap(
    lambda lines: st.sampled_from(["\n", "\r\n"]).map(lambda end: end.join(lines).encode())
)


def _check(data: bytes) -> None:
    try:
        parsed = manifest.parse(data, WHERE)
    except WeightcacheError as e:
        assert e.exit_code in (3, 4), e
        assert str(e).startswith(WHERE) or WHERE in str(e), e
        assert "\n" not in str(e), e  # one line on stderr
        return
    _assert_valid(parsed, data)


def _assert_valid(parsed: Manifest, data: bytes) -> None:
    assert parsed.entries
    assert parsed.digest == hashlib.sha256(data).hexdigest()
    paths = [e.path for e in parsed.entries]
    assert len(set(paths)) == len(paths)
    for entry in parsed.entries:
        assert len(entry.sha256) == 64 and entry.sha256 == entry.sha256.lower()
        int(entry.sha256, 16)
        assert check_path(entry.path, WHERE) == entry.path
        assert not entry.path.startswith("./")


#: The same examples on every run and machine (no example database written to the tree).
SETTINGS = settings(max_examples=200, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@SETTINGS
@given(st.binary(max_size=600))
def test_arbitrary_bytes_are_a_manifest_or_a_clean_error(data: bytes) -> None:
    _check(data)


@SETTINGS
@given(_TEXT)
def test_lines_near_the_format_are_a_manifest_or_a_clean_error(data: bytes) -> None:
    _check(data)
