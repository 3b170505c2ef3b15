"""The models file parser (weightcache/daemon/models.py, design §2.3): a file that cannot be
read or is not a mapping with a `models` list is a UsageError (exit 2); a bad entry becomes
one problem sentence and is skipped while the valid ones are kept; pins and the digest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightcache.daemon.models import DesiredState, ModelSpec, load, parse_entry
from weightcache.errors import UsageError

SRC = "s3://models/team/llama/v1"


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "models.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def labels(state: DesiredState) -> list[str]:
    return [m.source.label for m in state.models]


# -- the file as a whole ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param("models: [\n", "not valid YAML", id="unclosed-flow"),
        pytest.param("models:\n\t- source: x\n", "not valid YAML", id="tab-indent"),
        pytest.param(b"models:\n  - source: s3://b\xff\xfe/m/r\n", "not valid YAML", id="not-utf8"),
        pytest.param("- source: s3://models/m/r\n", "must be a mapping", id="top-level-list"),
        pytest.param("just a string\n", "must be a mapping", id="top-level-scalar"),
        pytest.param("models: {source: s3://models/m/r}\n", "'models' list", id="models-map"),
        pytest.param("models: s3://models/m/r\n", "'models' list", id="models-string"),
        pytest.param("models: 3\n", "'models' list", id="models-int"),
    ],
)
def test_a_file_that_is_not_a_models_mapping_is_a_usage_error(
    tmp_path: Path, text: str | bytes, why: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(UsageError, match=why) as e:
        load(path)
    assert str(path) in str(e.value)  # says which file to fix
    assert "\n" not in str(e.value), "one line on stderr, the place in the file included"


def test_where_the_yaml_breaks_is_said_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  - source: s3://models/m/r\n  - source: {\n")
    with pytest.raises(UsageError) as e:
        load(path)
    assert "\n" not in str(e.value) and "line 4" in str(e.value), str(e.value)


def test_a_file_larger_than_a_config_map_is_refused_unread(tmp_path: Path) -> None:
    """A ConfigMap holds at most 1 MiB: a larger file is the wrong one (a model shard, a
    log), and parsing 10 MiB of YAML took the daemon ~15 s of CPU at every --interval."""
    path = write(tmp_path, b"models:\n" + b"#" * (10 << 20))
    with pytest.raises(UsageError, match=r"over 1MiB.*--models") as e:
        load(path)
    assert str(path) in str(e.value)


def test_a_missing_file_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(UsageError, match="cannot read the models file") as e:
        load(path)
    assert str(path) in str(e.value)


def test_a_directory_instead_of_a_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the models file"):
        load(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("# nothing yet\n", id="comment-only"),
        pytest.param("models: []\n", id="models-empty-list"),
    ],
)
def test_an_empty_desired_state_is_valid(tmp_path: Path, text: str) -> None:
    state = load(write(tmp_path, text))
    assert (state.models, state.problems, state.pinned) == ((), (), frozenset())


def test_a_models_key_with_no_entries_is_an_empty_desired_state(tmp_path: Path) -> None:
    state = load(write(tmp_path, "models:\n  # - source: s3://models/team/llama/v1\n"))
    assert (state.models, state.problems) == ((), ())


def test_an_unknown_top_level_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="model"):
        load(write(tmp_path, f"model:\n  - source: {SRC}\n    pin: true\n"))


def test_a_valid_file_keeps_its_entries_in_order_with_their_pins(tmp_path: Path) -> None:
    text = (
        "models:\n"
        f"  - source: {SRC}\n"
        "    pin: true\n"
        "  - source: s3://models/team/qwen/2026-10-01\n"
        "  - source: s3://models/team/qwen/2026-10-01\n"
        "    name: qwen-alias\n"
        "    revision: stable\n"
        "    pin: false\n"
    )
    state = load(write(tmp_path, text))
    assert state.problems == ()
    assert labels(state) == ["llama/v1", "qwen/2026-10-01", "qwen-alias/stable"]
    assert [m.pin for m in state.models] == [True, False, False]
    assert state.pinned == frozenset({("llama", "v1")})
    assert state.models[2].source.url == "s3://models/team/qwen/2026-10-01"


def test_the_digest_follows_the_content(tmp_path: Path) -> None:
    one = load(write(tmp_path, f"models:\n  - source: {SRC}\n"))
    same = load(write(tmp_path, f"models:\n  - source: {SRC}\n"))
    other = load(write(tmp_path, f"models:\n  - source: {SRC}\n    pin: true\n"))
    assert len(one.digest) == 16 and int(one.digest, 16) >= 0  # xxh64, hex
    assert one.digest == same.digest
    assert other.digest != one.digest


def test_a_large_file_keeps_every_entry(tmp_path: Path) -> None:
    n = 200
    text = "models:\n" + "".join(
        f"  - {{source: s3://models/team/m{i}/r{i}, pin: {str(i % 2 == 0).lower()}}}\n"
        for i in range(n)
    )
    state = load(write(tmp_path, text))
    assert state.problems == ()
    assert labels(state) == [f"m{i}/r{i}" for i in range(n)]
    assert len(state.pinned) == n // 2


# -- entries: each bad one is one problem, the rest converge -----------------------------------


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        pytest.param(f"{SRC}", "needs at least 'source", id="bare-string"),
        pytest.param("[a, b]", "needs at least 'source", id="list"),
        pytest.param("{name: llama}", "needs at least 'source", id="no-source"),
        pytest.param("null", "needs at least 'source", id="null"),
        pytest.param(
            f"{{source: {SRC}, pinned: true}}", r"unknown key\(s\) \['pinned'\]", id="unknown-key"
        ),
        pytest.param(  # keys of two types: sorting them must not raise TypeError
            f"{{source: {SRC}, 1: x, b: y}}", r"unknown key\(s\) \['1', 'b'\]", id="mixed-keys"
        ),
        pytest.param(
            f"{{source: {SRC}, pin: 'true'}}", "'pin' must be true or false", id="pin-string"
        ),
        pytest.param(f"{{source: {SRC}, pin: 1}}", "'pin' must be true or false", id="pin-int"),
        pytest.param(f"{{source: {SRC}, pin: null}}", "'pin' must be true or false", id="pin-null"),
        pytest.param("{source: s3://models/llama}", "invalid source", id="source-one-segment"),
        pytest.param("{source: ftp://models/team/llama/v1}", "invalid source", id="not-a-scheme"),
        pytest.param("{source: s3://models/team/../v1}", "invalid source", id="dotdot"),
        pytest.param("{source: s3://Models/team/llama/v1}", "invalid source", id="bad-bucket"),
        pytest.param("{source: 42}", "invalid source", id="source-int"),
        pytest.param("{source: null}", "invalid source", id="source-null"),
        pytest.param(f"{{source: {SRC}, name: '../etc'}}", "invalid model name", id="name-path"),
        pytest.param(f"{{source: {SRC}, name: [a]}}", "'name' .* is not text", id="name-list"),
        pytest.param(f"{{source: {SRC}, name: .hidden}}", "invalid model name", id="name-dot"),
        pytest.param(f"{{source: {SRC}, revision: 'a b'}}", "invalid revision", id="rev-space"),
        pytest.param(
            f"{{source: {SRC}, revision: {{a: 1}}}}", "'revision' .* is not text", id="rev-map"
        ),
        pytest.param(
            "{source: 's3://models/team/llama/.weightcache'}", "invalid revision", id="rev-reserved"
        ),
    ],
)
def test_a_bad_entry_is_one_problem_and_the_others_converge(
    tmp_path: Path, entry: str, why: str
) -> None:
    text = f"models:\n  - source: s3://models/team/ok/r1\n  - {entry}\n  - source: {SRC}\n"
    path = write(tmp_path, text)
    state = load(path)
    assert labels(state) == ["ok/r1", "llama/v1"]
    assert len(state.problems) == 1, state.problems
    problem = state.problems[0]
    assert problem.startswith(f"{path} entry 2: "), problem
    assert "\n" not in problem
    assert re.search(why, problem), problem


def test_an_entry_listed_twice_keeps_the_first(tmp_path: Path) -> None:
    # Same name/revision from two sources: one name/revision holds one content.
    text = (
        "models:\n"
        f"  - source: {SRC}\n"
        f"  - source: {SRC}\n"
        "    pin: true\n"
        "  - source: s3://models/other/llama/v1\n"
        "  - source: s3://models/other/llama/v2\n"
    )
    path = write(tmp_path, text)
    state = load(path)
    assert labels(state) == ["llama/v1", "llama/v2"]
    assert state.models[0] == ModelSpec(state.models[0].source, pin=False)
    assert state.models[0].source.url == SRC
    assert state.pinned == frozenset()  # the pin was on the skipped duplicate
    assert state.problems == (
        f"{path} entry 2: llama/v1 is listed twice; skipped",
        f"{path} entry 3: llama/v1 is listed twice; skipped",
    )


def test_a_rejected_entry_does_not_claim_its_name(tmp_path: Path) -> None:
    text = f"models:\n  - {{source: {SRC}, pin: 'yes'}}\n  - {{source: {SRC}, pin: true}}\n"
    state = load(write(tmp_path, text))
    assert labels(state) == ["llama/v1"]
    assert state.pinned == frozenset({("llama", "v1")})
    assert len(state.problems) == 1 and "entry 1" in state.problems[0]


@pytest.mark.parametrize(
    ("entry", "label"),
    [
        # An unquoted YAML date is what design §2.3 shows: it reads back as written.
        pytest.param(f"{{source: {SRC}, revision: 2026-10-01}}", "llama/2026-10-01", id="date"),
        pytest.param(f"{{source: {SRC}, name: qwen, revision: r2}}", "qwen/r2", id="both"),
        pytest.param("{source: '  s3://models/team/llama/v1/  '}", "llama/v1", id="padded-url"),
    ],
)
def test_overrides_and_scalars_that_read_back_as_written(
    tmp_path: Path, entry: str, label: str
) -> None:
    state = load(write(tmp_path, f"models:\n  - {entry}\n"))
    assert state.problems == ()
    assert labels(state) == [label]


@pytest.mark.parametrize("written", ["1.10", "010", "7", "true"])
def test_a_number_revision_is_refused_not_renamed(tmp_path: Path, written: str) -> None:
    """YAML reads 1.10 as 1.1 and 010 as 8: the daemon would pin a revision nobody asked for."""
    state = load(write(tmp_path, f"models:\n  - {{source: {SRC}, revision: {written}}}\n"))
    assert labels(state) == []
    assert len(state.problems) == 1 and "quote it" in state.problems[0]
    quoted = load(write(tmp_path, f"models:\n  - {{source: {SRC}, revision: '{written}'}}\n"))
    assert labels(quoted) == [f"llama/{written}"]


# -- parse_entry on Python values (what yaml.safe_load gives) ----------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(None, id="none"),
        pytest.param(SRC, id="str"),
        pytest.param([SRC], id="list"),
        pytest.param({"name": "m"}, id="no-source"),
        pytest.param({"source": SRC, "extra": 1}, id="extra-key"),
        pytest.param({"source": SRC, "pin": "false"}, id="pin-str"),
        pytest.param({"source": SRC, "pin": 0}, id="pin-zero"),
        pytest.param({"source": SRC, "require_sha256": "yes"}, id="require-sha256-str"),
        # Empty, not absent: refused rather than replaced by the URL's segment.
        pytest.param({"source": SRC, "name": ""}, id="empty-name"),
        pytest.param({"source": SRC, "revision": " "}, id="blank-revision"),
    ],
)
def test_parse_entry_raises_usage_error(raw: object) -> None:
    with pytest.raises(UsageError):
        parse_entry(raw)


def test_an_entry_without_a_source_says_what_to_write() -> None:
    with pytest.raises(UsageError) as e:
        parse_entry({"name": "llama"})
    assert str(e.value) == "each entry needs at least 'source: s3://bucket/prefix/<name>/<rev>'"


def test_parse_entry_defaults_to_unpinned_and_the_url_segments() -> None:
    spec = parse_entry({"source": SRC})
    assert (spec.pin, spec.source.name, spec.source.revision) == (False, "llama", "v1")
    assert parse_entry({"source": SRC, "pin": True}).pin is True


def test_an_entry_may_require_sha256_verified_bytes() -> None:
    assert parse_entry({"source": SRC}).require_sha256 is False
    assert parse_entry({"source": SRC, "require_sha256": True}).require_sha256 is True
