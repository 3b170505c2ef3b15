"""The container image recipe: lint-clean, non-root, pinned, and built from this repo's package."""

from __future__ import annotations

import contextlib
import email.parser
import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
LOCK = REPO / "requirements.lock"
BUILD_LOCK = REPO / "requirements-build.lock"
DOCKERIGNORE = REPO / ".dockerignore"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(instrs) if word == "FROM"]
    assert starts, "the Dockerfile has no FROM"
    return instrs[starts[-1] :]


def lock_pins(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (exact version, hashes) from a pip requirements file in --require-hashes form."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split("--hash=")
        req = Requirement(spec.strip())
        (specifier,) = req.specifier  # exactly one clause ...
        assert specifier.operator == "==", f"{path.name}: {req.name} is not pinned with =="
        hashes = [o.strip() for o in options]
        pins[canonicalize_name(req.name)] = (specifier.version, hashes)
    return pins


def pyproject_dependencies() -> list[Requirement]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(r) for r in data["project"]["dependencies"]]


def image_extras() -> set[str]:
    """The extras the Dockerfile installs the package with (`weightcache-*.whl)[a,b]`)."""
    found = re.findall(r"weightcache-\*\.whl\)?\[([\w,-]+)\]", DOCKERFILE.read_text())
    return {e.strip() for group in found for e in group.split(",")}


def image_requirements() -> list[Requirement]:
    """What the image promises to run: the dependencies and those of the installed extras."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    reqs = pyproject_dependencies()
    for extra in sorted(image_extras()):
        assert extra in extras, f"the Dockerfile installs extra [{extra}], which pyproject lacks"
        reqs += [Requirement(r) for r in extras[extra]]
    return reqs


def extras_the_package_asks_for() -> set[str]:
    """Extras named by the package's own hints (`pip install 'weightcache[gcs]'`): what a
    scheme needs at run time, so what an image that takes every scheme must hold."""
    hints: set[str] = set()
    for path in (REPO / "weightcache").rglob("*.py"):
        hints |= set(re.findall(r"pip install '?weightcache\[([\w-]+)\]", path.read_text()))
    return hints


def test_hadolint_is_clean(hadolint: str) -> None:
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"hadolint findings:\n{proc.stdout}{proc.stderr}"


def test_hadolint_catches_a_bad_dockerfile(hadolint: str, tmp_path: Path) -> None:
    """Negative control: the linter really runs (an unpinned, root, `latest` image is flagged)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install boto3\n")
    proc = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout and "DL3013" in proc.stdout, proc.stdout


def test_no_unjustified_lint_suppressions() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            justification = line.split("hadolint ignore", 1)[1].split(None, 1)
            above = lines[i - 1].strip() if i else ""
            assert len(justification) > 1 or (above.startswith("#") and len(above) > 10), (
                f"Dockerfile line {i + 1}: `hadolint ignore` needs a reason next to it"
            )


def test_multi_stage_with_a_shared_base() -> None:
    instrs = instructions(DOCKERFILE.read_text())
    froms = [rest for word, rest in instrs if word == "FROM"]
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    assert any(w == "COPY" and "--from=" in r for w, r in final_stage(instrs)), (
        "the runtime stage should copy the built environment from the build stage"
    )
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text())
    assert base is not None, "the base image should be one ARG both stages use"
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*(@sha256:[0-9a-f]{64})?", base.group(1))


def test_final_stage_runs_as_a_non_root_uid() -> None:
    users = [
        rest for word, rest in final_stage(instructions(DOCKERFILE.read_text())) if word == "USER"
    ]
    assert users, "the final stage has no USER instruction: it would run as root"
    user, _, group = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert user.isdigit() and int(user) != 0, f"USER {users[-1]} is not a numeric non-root uid"
    assert not group or (group.isdigit() and int(group) != 0)


def test_entrypoint_is_the_console_script() -> None:
    entrypoints = [
        rest
        for word, rest in final_stage(instructions(DOCKERFILE.read_text()))
        if word == "ENTRYPOINT"
    ]
    assert entrypoints and json.loads(entrypoints[-1]) == ["weightcache"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "weightcache" in scripts


def test_installs_this_repos_package_with_the_lock() -> None:
    """The image holds the package the tests install (`pip install .`), deps from the lock only."""
    instrs = instructions(DOCKERFILE.read_text())
    copies = " ".join(rest for word, rest in instrs if word == "COPY")
    for needed in ("pyproject.toml", "requirements.lock", "requirements-build.lock"):
        assert needed in copies, f"the Dockerfile never copies {needed}"
    assert re.search(r"(^|\s)weightcache\s+/src/weightcache\b", copies), "package source not copied"
    runs = [rest for word, rest in instrs if word == "RUN"]
    lock_installs = [r for r in runs if "-r /tmp/requirements.lock" in r]
    assert lock_installs and all("--require-hashes" in r for r in lock_installs)
    builds = [r for r in runs if re.search(r"pip (wheel|install)\b.*\s/src(\s|$)", r)]
    assert builds, "the package is not built from the copied source tree"
    assert all("--no-deps" in r for r in builds), "the package install must not re-resolve deps"
    readme = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("readme")
    if isinstance(readme, str):
        assert readme in copies, f"pyproject's readme {readme} is not copied into the build"


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]

    def to_regex(pattern: str) -> re.Pattern[str]:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif pattern[i] == "*":
                out += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                out += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                out += pattern[i : end + 1]
                i = end + 1
            else:
                out += re.escape(pattern[i])
                i += 1
        return re.compile(out + "(/.*)?")

    def excluded(path: str) -> bool:
        # Docker: the last matching pattern wins; `!` re-includes.
        verdict = False
        for p in patterns:
            negate = p.startswith("!")
            body = p[1:] if negate else p
            if to_regex(body.strip("/")).fullmatch(path):
                verdict = not negate
        return verdict

    for path in (
        "pyproject.toml",
        "README.md",
        "requirements.lock",
        "requirements-build.lock",
        "weightcache/__init__.py",
        "weightcache/cli.py",
    ):
        assert not excluded(path), f".dockerignore drops {path}, which the build needs"
    for path in (".git/config", "tests/unit/test_x.py", "weightcache/__pycache__/x.pyc"):
        assert excluded(path), f".dockerignore lets {path} into the build context"


def test_image_installs_every_extra_a_scheme_needs() -> None:
    """gs:// and az:// need extras; the image must read them without a rebuild."""
    asked = extras_the_package_asks_for()
    assert {"gcs", "azure"} <= asked, f"the hints this test reads have moved: {asked}"
    missing = asked - image_extras()
    assert not missing, f"the Dockerfile does not install the package with extras {missing}"


def test_lock_pins_every_dependency_within_pyproject_ranges() -> None:
    """Every requirement of the package and of the extras the image installs is locked."""
    pins = lock_pins(LOCK)
    for req in image_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements.lock does not pin {req.name} (needed by the image)"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {req.name}=={version}, outside pyproject's {req.specifier}"
        )
    for pkg, (version, hashes) in {**pins, **lock_pins(BUILD_LOCK)}.items():
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), (
            f"{pkg}=={version} has no usable sha256 hash"
        )


def locked_requirements(name: str, version: str, hashes: list[str], tmp: Path) -> list[str]:
    """The Requires-Dist of exactly `name==version`, as the image would install it.

    From the installed distribution when it is that version; otherwise from the wheel pip
    downloads for the image's platform, whose sha256 must be one the lock lists (so a pin
    that does not exist, or a hash that does not match it, fails here rather than in the
    image build). Fails, naming the package, when neither is possible.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution(name)
        if dist.version == version:
            return list(dist.requires or [])
    dest = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
         "--abi", "cp311", "--abi", "abi3", "--abi", "none", "--platform", "manylinux2014_x86_64",
         "--platform", "manylinux_2_17_x86_64", "--platform", "any", "-d", str(dest),
         f"{name}=={version}"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(
            f"requirements.lock pins {name}=={version}, which is not installed here and pip "
            f"cannot download it, so its dependencies cannot be checked:\n{proc.stderr[-2000:]}"
        )
    (wheel,) = dest.glob("*.whl")
    digest = "sha256:" + hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert digest in hashes, f"{wheel.name} has {digest}, not one of the lock's {hashes}"
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.BytesParser().parsebytes(zf.read(meta))
    return metadata.get_all("Requires-Dist") or []


def test_lock_is_closed_under_dependencies(tmp_path: Path) -> None:
    """Every dependency of every locked package is locked too, at a version it accepts,
    including what an extra asks for (`google-api-core[grpc]` needs grpcio-status).

    Requirements come from the metadata of exactly the locked version (see
    `locked_requirements`), never from a different version that happens to be installed.
    """
    pins = lock_pins(LOCK)
    requires = {n: locked_requirements(n, v, h, tmp_path) for n, (v, h) in pins.items()}
    extras: dict[str, set[str]] = {name: {""} for name in pins}  # "" is the plain install
    for req in image_requirements():
        extras[canonicalize_name(req.name)] |= req.extras
    todo = [(name, extra) for name, asked in extras.items() for extra in asked]
    while todo:
        name, extra = todo.pop()
        for raw in requires[name]:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            dep, version = canonicalize_name(req.name), pins[name][0]
            assert dep in pins, f"{name}=={version} needs {req}, which requirements.lock lacks"
            assert req.specifier.contains(pins[dep][0], prereleases=True), (
                f"{name}=={version} needs {req}; the lock has {dep}=={pins[dep][0]}"
            )
            todo += [(dep, e) for e in req.extras - extras[dep]]
            extras[dep] |= req.extras
