"""Fixtures for the image tests: the Dockerfile built with podman, containers run as rendered.

The image is built by `.ci/image` (rootful podman, a bookworm stand-in for the official
python base, the host's CA bundle for pip). Every test here skips, with the reason, only when
podman cannot run on this machine; a build that fails is a failure.

`podman_args` turns a container of the rendered manifests into `podman run` arguments: its
user, read-only root, capabilities, no-new-privileges, memory limit, environment, volumes and
command line, so a container runs here the way the kubelet would run it. A securityContext
field it does not know fails the test rather than being dropped silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.packaging.conftest import DAEMONSET, INITCONTAINER, Container, Rendered, kustomize

REPO = Path(__file__).resolve().parents[2]

#: Downward-API values, as the kubelet would fill them in.
FIELD_REFS = {
    "metadata.uid": "0b7a3a5e-6b1c-4d0e-9a55-1c2d3e4f5a6b",
    "metadata.namespace": "weightcache",
    "metadata.name": "weightcache-test",
    "spec.nodeName": "gpu-node-0",
}

_MEMORY_UNITS = {"Ki": "k", "Mi": "m", "Gi": "g"}


def _podman_problem() -> str | None:
    """Why podman cannot run containers here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (Debian: apt-get install podman runc; see .ci/image)"
    if os.geteuid() != 0:
        return "the image tests need rootful podman (run as root)"
    proc = subprocess.run(
        ["podman", "info"], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        return f"podman cannot run here: {proc.stderr.strip()[:300]}"
    return None


@pytest.fixture(scope="session")
def image() -> str:
    """The image built from this tree by `.ci/image` (its layer cache makes reruns quick)."""
    problem = _podman_problem()
    if problem is not None:
        pytest.skip(problem)
    proc = subprocess.run(
        [str(REPO / ".ci" / "image")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, f".ci/image failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def initcontainer_rendered() -> Rendered:
    return Rendered("initcontainer", kustomize(INITCONTAINER))


@pytest.fixture(scope="session")
def daemonset_rendered() -> Rendered:
    return Rendered("daemonset", kustomize(DAEMONSET))


def effective(container: Container, name: str) -> Any:
    """A securityContext field as the kubelet applies it: the container's, else the Pod's."""
    own = container.spec.get("securityContext", {})
    if name in own:
        return own[name]
    return container.pod_spec.get("securityContext", {}).get(name)


def expand(arg: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion in command and args ($$ escapes, unknown stays)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


@dataclass
class PodSandbox:
    """What the kubelet would provide: host directories for volumes, Secret values."""

    root: Path
    host_paths: dict[str, Path] = field(default_factory=dict)  # volume name -> host dir
    config_maps: dict[str, Path] = field(default_factory=dict)  # volume name -> dir of files
    secrets: dict[str, str] = field(default_factory=dict)  # envFrom / secretKeyRef values

    def empty_dir(self, name: str) -> Path:
        path = self.root / "emptydir" / name
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, 65532, 65532)
        return path


def security_args(c: Container) -> list[str]:
    """podman flags for the container's effective securityContext; unknown fields fail."""
    uid, gid = effective(c, "runAsUser"), effective(c, "runAsGroup")
    assert uid is not None, f"{c.where}: no runAsUser; the image's USER would apply"
    args = ["--user", f"{uid}:{gid if gid is not None else uid}"]
    if effective(c, "runAsNonRoot"):
        assert int(uid) != 0, f"{c.where}: runAsNonRoot with uid 0 would not start"
    if effective(c, "readOnlyRootFilesystem"):
        # Exactly the Pod's volumes are writable: no tmpfs on /tmp, /run unless it mounts one.
        args += ["--read-only", "--read-only-tmpfs=false"]
    if effective(c, "allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = effective(c, "capabilities") or {}
    args += [f"--cap-drop={cap}" for cap in caps.get("drop", [])]
    args += [f"--cap-add={cap}" for cap in caps.get("add", [])]
    assert not effective(c, "privileged"), f"{c.where}: privileged"
    seccomp = (effective(c, "seccompProfile") or {}).get("type", "RuntimeDefault")
    assert seccomp == "RuntimeDefault", f"{c.where}: seccomp {seccomp}"  # podman's default
    known = {
        "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "capabilities",
        "allowPrivilegeEscalation", "privileged", "seccompProfile",
    }  # fmt: skip
    unknown = set(c.spec.get("securityContext", {})) - known
    assert not unknown, f"{c.where}: securityContext fields this test cannot apply: {unknown}"
    return args


def env_args(c: Container, sandbox: PodSandbox) -> tuple[list[str], dict[str, str]]:
    """`--env` flags (envFrom Secrets first, then env, as the kubelet orders them)."""
    env: dict[str, str] = {}
    for source in c.spec.get("envFrom", []):
        assert "secretRef" in source, f"{c.where}: envFrom {source} not supported here"
        env.update(sandbox.secrets)
    for e in c.spec.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = FIELD_REFS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["key"] in sandbox.secrets, f"{c.where}: give the test Secret key {ref}"
            env[e["name"]] = sandbox.secrets[ref["key"]]
        else:
            raise AssertionError(f"{c.where}: env {e} not supported here")
    return [f"--env={k}={v}" for k, v in env.items()], env


def volume_args(c: Container, sandbox: PodSandbox) -> list[str]:
    args = []
    for m in c.spec.get("volumeMounts", []):
        volume = c.volume(m["name"])
        if "hostPath" in volume:
            host = sandbox.host_paths[m["name"]]
        elif "configMap" in volume:
            host = sandbox.config_maps[m["name"]]
        elif "emptyDir" in volume:
            if volume["emptyDir"].get("medium") == "Memory":
                args.append(f"--tmpfs={m['mountPath']}")
                continue
            host = sandbox.empty_dir(m["name"])
        else:
            raise AssertionError(f"{c.where}: volume {volume} not supported here")
        options = ["ro" if m.get("readOnly") else "rw"]
        if m.get("mountPropagation") == "HostToContainer":
            options.append("rslave")
        args.append(f"--volume={host}:{m['mountPath']}:{','.join(options)}")
    return args


def memory_args(c: Container) -> list[str]:
    limit = str(c.spec.get("resources", {}).get("limits", {}).get("memory", ""))
    for suffix, unit in _MEMORY_UNITS.items():
        if limit.endswith(suffix):
            return [f"--memory={limit.removesuffix(suffix)}{unit}"]
    return []


def podman_args(c: Container, sandbox: PodSandbox, image: str, name: str) -> list[str]:
    """`podman run` arguments (without `run`) for this container in this sandbox."""
    env_flags, env = env_args(c, sandbox)
    command = c.spec.get("command") or []
    args = [expand(a, env) for a in c.spec.get("args", [])]
    entry = ["--entrypoint", command[0]] if command else []
    return [
        f"--name={name}",
        "--network=host",
        *security_args(c),
        *memory_args(c),
        *env_flags,
        *volume_args(c, sandbox),
        *entry,
        image,
        *(expand(a, env) for a in command[1:]),
        *args,
    ]


@dataclass
class Podman:
    """Runs and cleans up containers named after this test."""

    names: list[str] = field(default_factory=list)

    def name(self) -> str:
        self.names.append(f"weightcache-test-{uuid.uuid4().hex[:10]}")
        return self.names[-1]

    def run(self, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", "run", "--rm", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def start(self, args: list[str]) -> str:
        proc = subprocess.run(
            ["podman", "run", "--detach", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"podman run failed:\n{proc.stderr}"
        return proc.stdout.strip()

    def logs(self, name: str) -> str:
        proc = subprocess.run(
            ["podman", "logs", name], capture_output=True, text=True, timeout=60, check=False
        )
        return proc.stdout + proc.stderr

    def cleanup(self) -> None:
        for name in self.names:
            subprocess.run(
                ["podman", "rm", "--force", "--time=5", name],
                capture_output=True,
                timeout=60,
                check=False,
            )


@pytest.fixture
def podman(image: str) -> Iterator[Podman]:
    runner = Podman()
    yield runner
    runner.cleanup()


def node_dir(path: Path) -> Path:
    """A hostPath directory prepared as docs/deploy.md says: owned by 65532."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 65532, 65532)
    return path
