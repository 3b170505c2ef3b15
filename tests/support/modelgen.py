"""Write test model directories: random weight shards, small JSON files and a SHA256SUMS.

A model here is what `weightcache publish` would upload: a flat directory of files plus a
coreutils-format manifest (`<64 hex>  <relative path>` per line). Contents are random but
reproducible: every file's bytes derive from a seed, so two revisions that should share a
shard share it byte for byte, and a failing test can be rerun on the same data.

The broken-manifest helpers return manifest *text* (not files) so a test can upload it next
to good objects with boto3 and check that the CLI rejects it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "SHA256SUMS"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelFile:
    """One file of a test model: its path relative to the model root, size and sha256."""

    relpath: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Model:
    """A model directory on disk and what its manifest says about it."""

    root: Path
    files: tuple[ModelFile, ...]
    manifest_text: str = field(repr=False)

    @property
    def total_size(self) -> int:
        """Bytes of all listed files (the manifest itself excluded)."""
        return sum(f.size for f in self.files)

    @property
    def hashes(self) -> dict[str, str]:
        """relpath -> sha256 hex."""
        return {f.relpath: f.sha256 for f in self.files}

    @property
    def sizes(self) -> dict[str, int]:
        return {f.relpath: f.size for f in self.files}

    def file(self, relpath: str) -> ModelFile:
        for f in self.files:
            if f.relpath == relpath:
                return f
        raise KeyError(relpath)

    def shard_names(self) -> list[str]:
        return [f.relpath for f in self.files if f.relpath.endswith(".safetensors")]


def random_bytes(size: int, seed: int | str | None) -> Iterable[bytes]:
    """`size` random bytes in chunks of at most 1 MiB; reproducible when `seed` is given."""
    rng = random.Random(seed) if seed is not None else None
    remaining = size
    while remaining > 0:
        n = min(_CHUNK, remaining)
        yield rng.randbytes(n) if rng is not None else os.urandom(n)
        remaining -= n


def write_random_file(path: Path, size: int, seed: int | str | None) -> str:
    """Write `size` random bytes to `path` and return their sha256 hex."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in random_bytes(size, seed):
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_line(sha256_hex: str, relpath: str) -> str:
    """One coreutils `sha256sum` line (text mode: two spaces), without the newline."""
    return f"{sha256_hex}  {relpath}"


def render_manifest(entries: Iterable[tuple[str, str]]) -> str:
    """Manifest text for (sha256 hex, relpath) pairs, one line each, newline-terminated."""
    return "".join(manifest_line(h, p) + "\n" for h, p in entries)


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def make_model(
    root: Path,
    shard_sizes: Sequence[int],
    *,
    seed: int | str | None = 0,
    shard_seeds: Sequence[int | str | None] | None = None,
    small_files: bool = True,
    extra_files: Mapping[str, bytes] | None = None,
    manifest: bool = True,
) -> Model:
    """Write a model directory and return its description.

    Shard `i` is `shard_sizes[i]` random bytes from `shard_seeds[i]` (default: derived from
    `seed` and `i`), so two models built with the same shard seed share that shard exactly.
    `small_files` adds a config.json and tokenizer.json derived from `seed`. `extra_files`
    are written verbatim (relative paths, subdirectories allowed). With `manifest`, a
    SHA256SUMS listing every file (sorted by path) is written at the root.
    """
    if shard_seeds is not None and len(shard_seeds) != len(shard_sizes):
        raise ValueError("shard_seeds must have one seed per shard")
    root.mkdir(parents=True, exist_ok=True)
    files: list[ModelFile] = []
    count = len(shard_sizes)
    for i, size in enumerate(shard_sizes):
        name = shard_name(i, count)
        shard_seed = shard_seeds[i] if shard_seeds is not None else _derive(seed, f"shard{i}")
        files.append(ModelFile(name, size, write_random_file(root / name, size, shard_seed)))
    contents: dict[str, bytes] = {}
    if small_files:
        contents.update(_small_files(seed))
    contents.update(extra_files or {})
    for relpath, data in contents.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append(ModelFile(relpath, len(data), sha256_bytes(data)))
    files.sort(key=lambda f: f.relpath)
    text = render_manifest((f.sha256, f.relpath) for f in files)
    if manifest:
        (root / MANIFEST).write_text(text)
    return Model(root=root, files=tuple(files), manifest_text=text)


def _derive(seed: int | str | None, what: str) -> str | None:
    return None if seed is None else f"{seed}/{what}"


def _small_files(seed: int | str | None) -> dict[str, bytes]:
    rng = random.Random(_derive(seed, "small"))
    config = {
        "architectures": ["TestForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
        "seed_marker": rng.getrandbits(64),
    }
    vocab = {f"tok{i}": i for i in range(200)}
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab}, "salt": rng.random()}
    return {
        "config.json": (json.dumps(config, indent=2) + "\n").encode(),
        "tokenizer.json": (json.dumps(tokenizer) + "\n").encode(),
    }


# --- broken manifests -------------------------------------------------------------------


def manifest_with_malformed_line(model: Model, kind: str = "short-hash") -> str:
    """The model's manifest with one line broken in the way `kind` names.

    Kinds: "short-hash" (63 hex digits), "non-hex" (a `z` in the hash), "one-space"
    (a single space as separator), "no-path" (hash only), "garbage" (a prose line).
    """
    first, *rest = model.files
    h, p = first.sha256, first.relpath
    broken = {
        "short-hash": f"{h[:-1]}  {p}",
        "non-hex": f"z{h[1:]}  {p}",
        "one-space": f"{h} {p}",
        "no-path": h,
        "garbage": "this is not a manifest line",
    }[kind]
    return broken + "\n" + render_manifest((f.sha256, f.relpath) for f in rest)


def manifest_with_duplicate(model: Model, same_hash: bool = False) -> str:
    """The model's manifest with its first path listed twice (with a different hash unless
    `same_hash`)."""
    first = model.files[0]
    other = first.sha256 if same_hash else sha256_bytes(b"something else")
    return model.manifest_text + manifest_line(other, first.relpath) + "\n"


def manifest_with_extra_entry(model: Model, relpath: str, data: bytes = b"x") -> str:
    """The model's manifest plus a line for `relpath` (a path that may be unsafe or absent)."""
    return model.manifest_text + manifest_line(sha256_bytes(data), relpath) + "\n"
