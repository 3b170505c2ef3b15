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
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightcache.cache.layout import check_revision
from weightcache.errors import UsageError
from weightcache.sourceurl import Source

_KEYS = {"source", "name", "revision", "pin", "require_sha256"}
#: A ConfigMap holds at most 1 MiB: a larger file is the wrong one (a model shard, a log),
#: and is refused unread rather than parsed at every --interval.
MAX_BYTES = 1 << 20


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
    import xxhash
    import yaml

    data = _read(path)
    try:
        doc = yaml.safe_load(data) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"the models file {path} is not valid YAML: {_yaml_problem(e)}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("models") or [], list):
        raise UsageError(f"the models file {path} must be a mapping with a 'models' list")
    if set(doc) - {"models"}:  # a misspelt `models:` would silently drop every pin
        raise UsageError(
            f"the models file {path} has unknown top-level key(s) "
            f"{sorted(map(str, set(doc) - {'models'}))}; the only one is 'models'"
        )
    models: list[ModelSpec] = []
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, raw in enumerate(doc.get("models") or [], 1):
        try:
            spec = parse_entry(raw)
        except UsageError as e:
            problems.append(f"{path} entry {i}: {e}")
            continue
        key = (spec.source.name, spec.source.revision)
        if key in seen:
            problems.append(f"{path} entry {i}: {key[0]}/{key[1]} is listed twice; skipped")
            continue
        seen.add(key)
        models.append(spec)
    return DesiredState(tuple(models), tuple(problems), xxhash.xxh64(data).hexdigest())


def _read(path: Path) -> bytes:
    """The file's bytes, at most MAX_BYTES of them. Raises UsageError."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read the models file {path}: {e.strerror}") from e
    if len(data) > MAX_BYTES:
        raise UsageError(
            f"the models file {path} is over 1MiB, more than a ConfigMap holds; check that "
            "--models names the models file"
        )
    return data


def _yaml_problem(e: Exception) -> str:
    """What PyYAML found wrong and where, on one line (its message spans several)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(e).split())


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
