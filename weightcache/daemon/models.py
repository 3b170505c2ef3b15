"""The models file (design §2.3): the daemon's desired state, usually a mounted ConfigMap.

```yaml
models:
  - source: s3://models/qwen3-70b/2026-10-01
    name: qwen3-70b        # optional
    revision: 2026-10-01   # optional
    pin: true              # never evicted while listed
    require_sha256: true   # optional: only bytes a sha256 verifies
```
A bad entry is reported and skipped; the valid ones still converge.

The file is untrusted input (anyone who can edit the ConfigMap writes it): it is read only
if it is a regular file of at most MAX_BYTES, without waiting on a FIFO; anchors, aliases
and nesting deeper than MAX_DEPTH are refused while PyYAML composes the document, before
they expand or recurse; and messages never quote back more than MAX_MESSAGE characters.
"""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightcache.cache.layout import check_revision
from weightcache.errors import UsageError
from weightcache.smallfile import open_regular
from weightcache.sourceurl import Source

_KEYS = {"source", "name", "revision", "pin", "require_sha256"}
#: A ConfigMap holds at most 1 MiB: a larger file is the wrong one (a model shard, a log),
#: and is refused unread rather than parsed at every --interval.
MAX_BYTES = 1 << 20
#: Levels of nesting: the document, `models`, an entry, its values, with room to spare.
#: Deeper is refused before PyYAML's recursive composer reaches Python's recursion limit.
MAX_DEPTH = 8
#: Characters of one problem or error line: a value quoted in it is cut to fit.
MAX_MESSAGE = 300
#: Bad entries listed one by one when the file changes; the others are counted.
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class ModelSpec:
    source: Source
    pin: bool = False
    require_sha256: bool = False  # refuse bytes no sha256 verifies (`--require-sha256`)


@dataclass(frozen=True)
class DesiredState:
    models: tuple[ModelSpec, ...]
    problems: tuple[str, ...] = field(default=())  # one sentence per rejected entry
    digest: str = ""  # xxh64 of the file, to notice changes cheaply

    @property
    def pinned(self) -> frozenset[tuple[str, str]]:
        return frozenset((m.source.name, m.source.revision) for m in self.models if m.pin)


def load(path: Path) -> DesiredState:
    """Read and validate the models file. A missing or unparsable file is a UsageError;
    bad entries only become `problems`."""
    return parse(path, read(path))


def digest(data: bytes) -> str:
    """xxh64 of the file's bytes: a reader compares it to skip parsing them again."""
    import xxhash

    return xxhash.xxh64(data).hexdigest()


def parse(path: Path, data: bytes) -> DesiredState:
    """Validate the bytes `read(path)` returned (`path` names the file in messages). A
    file that is not a models mapping is a UsageError; bad entries become `problems`."""
    import yaml

    try:
        doc = yaml.load(data, Loader=_loader()) or {}
    except Exception as e:  # whatever the parser raises, the text caused it: PyYAML
        # raises ValueError for a date like 2026-13-45 or an integer of 5,000 digits
        raise UsageError(f"the models file {path} is not valid YAML: {_yaml_problem(e)}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("models") or [], list):
        raise UsageError(f"the models file {path} must be a mapping with a 'models' list")
    if set(doc) - {"models"}:  # a misspelt `models:` would silently drop every pin
        unknown = _short(str(sorted(map(str, set(doc) - {"models"}))))
        raise UsageError(
            f"the models file {path} has unknown top-level key(s) {unknown}; "
            "the only one is 'models'"
        )
    models: list[ModelSpec] = []
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, raw in enumerate(doc.get("models") or [], 1):
        try:
            spec = parse_entry(raw)
        except UsageError as e:
            problems.append(f"{path} entry {i}: {_short(str(e))}")
            continue
        key = (spec.source.name, spec.source.revision)
        if key in seen:
            problems.append(f"{path} entry {i}: {key[0]}/{key[1]} is listed twice; skipped")
            continue
        seen.add(key)
        models.append(spec)
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        problems[MAX_PROBLEMS:] = [f"{path}: and {more} more bad entries, not listed"]
    return DesiredState(tuple(models), tuple(problems), digest(data))


def read(path: Path) -> bytes:
    """The file's bytes, at most MAX_BYTES of them. Raises UsageError."""
    try:
        fd = open_regular(path, follow_symlinks=True)  # a ConfigMap's file is a symlink
    except ValueError as e:
        raise UsageError(
            f"cannot read the models file {path}: it is not a regular file (a FIFO, a "
            "device or a directory); check that --models names the models file"
        ) from e
    except OSError as e:
        raise UsageError(f"cannot read the models file {path}: {e.strerror}") from e
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read the models file {path}: {e.strerror}") from e
    if len(data) > MAX_BYTES:
        raise UsageError(
            f"the models file {path} is over 1MiB, more than a ConfigMap holds; check that "
            "--models names the models file"
        )
    return data


@functools.cache
def _loader() -> Any:
    """PyYAML's SafeLoader, refusing anchors, aliases and deep nesting as it composes the
    document: an alias bomb of a few hundred bytes expands to gigabytes, and a deeply
    nested one is a RecursionError. Built on first use, as yaml is imported."""
    import yaml
    from yaml.composer import ComposerError

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()  # type: ignore[no-untyped-call]
            if getattr(event, "anchor", None) is not None:  # `&name` or `*name`
                raise ComposerError(
                    None,
                    None,
                    "anchors and aliases (& and *) are not allowed; write each entry out",
                    event.start_mark,
                )
            if self.depth >= MAX_DEPTH:
                raise ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark
                )
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def _yaml_problem(e: Exception) -> str:
    """What PyYAML found wrong and where, on one short line (its message spans several)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return _short(f"{problem} at line {mark.line + 1}, column {mark.column + 1}")
    return _short(" ".join(str(e).split()))


def _short(text: str) -> str:
    """`text` cut to MAX_MESSAGE characters: a message may quote what the file holds."""
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def parse_entry(raw: Any) -> ModelSpec:
    if not isinstance(raw, dict) or "source" not in raw:
        raise UsageError("each entry needs at least 'source: s3://bucket/prefix/<name>/<rev>'")
    unknown = set(raw) - _KEYS
    if unknown:
        raise UsageError(f"unknown key(s) {sorted(map(str, unknown))}; allowed: {sorted(_KEYS)}")
    pin, strict = raw.get("pin", False), raw.get("require_sha256", False)
    for key, flag in (("pin", pin), ("require_sha256", strict)):
        if not isinstance(flag, bool):
            raise UsageError(f"'{key}' must be true or false, not {flag!r}")
    name, revision = _text(raw, "name"), _text(raw, "revision")
    source = Source.parse(str(raw["source"]), name, revision)
    if not source.pinned:  # a prefetch keeps one content per entry: no moving branch
        raise UsageError(
            f"{source.url}: an hf:// entry names its commit (hf://org/repo@<40 hex digits>), "
            "not a branch or tag"
        )
    check_revision(source.name, source.revision)
    return ModelSpec(source, pin, strict)


def _text(raw: dict[str, Any], key: str) -> str | None:
    """A name or revision as written. YAML reads `1.10` as the float 1.1 and `010` as 8:
    refused rather than renamed (quote them). An unquoted date reads back as written."""
    value = raw.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        return value.isoformat()
    raise UsageError(f"'{key}' {value!r} is not text as YAML reads it; quote it: {key}: \"...\"")
