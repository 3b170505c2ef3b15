"""The models file is untrusted input (weightcache/daemon/models.py): whatever it holds, `load`
ends in a valid desired state or one short UsageError, without following aliases, recursing
without bound, waiting on a FIFO, or quoting back what it parsed."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.daemon.models import DesiredState, load
from weightcache.errors import UsageError

SRC = "s3://models/team/llama/v1"
#: What a one-line error may take: a path, a reason, a place in the file.
SHORT = 600


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "models.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def refused(path: Path, why: str) -> str:
    with pytest.raises(UsageError, match=why) as e:
        load(path)
    message = str(e.value)
    assert str(path) in message and "\n" not in message and len(message) < SHORT, message
    return message


def alias_bomb(levels: int) -> str:
    """Each entry's pin lists the one before it nine times: 9**levels leaves from a few lines."""
    lines = ["models:", "  - {source: s3://m/a/r0, pin: &a0 [x, x, x, x, x, x, x, x, x]}"]
    for i in range(1, levels + 1):
        pins = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"  - {{source: s3://m/a/r{i}, pin: &a{i} [{pins}]}}")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    """Quoted back in a message (or expanded), a few more levels take the daemon's memory
    and hold the GIL for tens of seconds (its event loop stops answering /healthz)."""
    refused(write(tmp_path, alias_bomb(6)), "anchors and aliases")


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(f"models:\n  - &e {{source: {SRC}}}\n", id="anchor-alone"),
        pytest.param(f"models:\n  - source: &s {SRC}\n  - {{source: *s, name: b}}\n", id="alias"),
        pytest.param(f"models:\n  - &b {{pin: true}}\n  - {{source: {SRC}, <<: *b}}\n", id="merge"),
    ],
)
def test_any_anchor_or_alias_is_refused(tmp_path: Path, text: str) -> None:
    refused(write(tmp_path, text), "anchors and aliases")


@pytest.mark.parametrize("opening", ["[", "{a: ", "- "])
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path: Path, opening: str) -> None:
    depth = 100_000
    if opening == "- ":  # a compact block sequence: `- - - x`
        text = "- " * 2000 + "x\n"
    else:
        text = opening * depth + ("]" if opening == "[" else "}") * depth
    refused(write(tmp_path, text), "nested deeper than")


def test_a_sensible_depth_is_accepted(tmp_path: Path) -> None:
    state = load(write(tmp_path, f"models:\n  - source: {SRC}\n    pin: true\n"))
    assert state.pinned == frozenset({("llama", "v1")})


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    os.mkfifo(path)  # no writer: a plain open() blocks for good
    refused(path, "cannot read the models file .* not a regular file")


def test_a_device_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").symlink_to("/dev/zero")
    refused(tmp_path / "models.yaml", "not a regular file")


def test_a_symlink_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    """A ConfigMap volume is symlinks (models.yaml -> ..data/models.yaml)."""
    (tmp_path / "real.yaml").write_text(f"models:\n  - source: {SRC}\n")
    (tmp_path / "models.yaml").symlink_to("real.yaml")
    assert [m.source.label for m in load(tmp_path / "models.yaml").models] == ["llama/v1"]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("models:\n  - {source: s3://m/a/b, revision: 2026-13-45}\n", id="bad-date"),
        pytest.param("models:\n  - {source: s3://m/a/b, revision: " + "1" * 5000 + "}\n", id="int"),
        pytest.param("models:\n  - {source: s3://m/a/b, pin: !!float x}\n", id="bad-float"),
        pytest.param("models:\n  - {source: s3://m/a/b, pin: !!timestamp x}\n", id="bad-time"),
    ],
)
def test_a_scalar_yaml_cannot_build_is_a_usage_error(tmp_path: Path, text: str) -> None:
    refused(write(tmp_path, text), "not valid YAML")


LONG_LIST = ", ".join(["x" * 50] * 5000)


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(f"{{source: {SRC}, pin: [{LONG_LIST}]}}", id="pin"),
        pytest.param(f"{{source: {SRC}, name: [{LONG_LIST}]}}", id="name"),
        pytest.param(f"{{source: s3://{'x' * 200_000}}}", id="source"),
        pytest.param(f"source: {SRC}\n    ? {'k' * 200_000}\n    : 1", id="key"),
    ],
)
def test_a_problem_never_quotes_back_a_large_value(tmp_path: Path, entry: str) -> None:
    state = load(write(tmp_path, f"models:\n  - {entry}\n"))
    assert len(state.problems) == 1 and len(state.problems[0]) < SHORT, state.problems[0][:SHORT]


def test_many_bad_entries_are_summed_up(tmp_path: Path) -> None:
    """Each change of the file logs its problems: tens of thousands of lines would not help."""
    text = "models:\n" + "".join(f"  - {{source: {SRC}, pin: {i}}}\n" for i in range(5000))
    problems = load(write(tmp_path, text)).problems
    assert len(problems) <= 21, len(problems)
    assert "and 4980 more" in problems[-1], problems[-1]


# -- whatever the text, a clean answer ---------------------------------------------------------

#: Pieces of YAML, so that generated text reaches the composer and the constructor, not only
#: the scanner's first complaint.
TOKENS = st.sampled_from([
    "models:", "- ", "source: ", SRC, "s3://b/p/m/r", "pin: ", "true", "1.10", "2026-13-45",
    "name: ", "revision: ", "&a ", "*a", "<<: ", "[", "]", "{", "}", ", ", ": ", "? ", "!!binary ",
    "!!set ", "!!omap ", "!!python/object ", "!!timestamp ", "!!float ", "!!int ", "'", '"',
    "\n", "\n  ", "\n    ", "---\n", "...\n", "#", "|\n  ", ">\n  ", "\t", "~", "null", "x",
    "9" * 5000, "\\", "%YAML 1.1\n", "\ufeff", "\x00", "\x85",
])  # fmt: skip
TEXTS = st.one_of(st.text(max_size=400), st.lists(TOKENS, max_size=60).map("".join))


@settings(
    max_examples=400,
    deadline=timedelta(seconds=5),  # far above a small file's parse: only runaway work hits it
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=TEXTS)
def test_any_text_is_a_valid_state_or_one_short_usage_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text.encode("utf-8", "surrogatepass"))
    try:
        state = load(path)
    except UsageError as e:
        message = str(e)
        assert "\n" not in message and len(message) < SHORT and str(path) in message, message
        return
    assert isinstance(state, DesiredState)
    for problem in state.problems:
        assert "\n" not in problem and len(problem) < SHORT, problem
    for spec in state.models:
        assert spec.source.name and spec.source.revision and isinstance(spec.pin, bool)
