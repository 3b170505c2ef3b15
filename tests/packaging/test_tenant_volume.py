"""initcontainer/components/tenant-volume: inference Pods in a namespace at the `restricted`
Pod Security level reach the node's cache through a local PersistentVolume bound to that
namespace's claim, read-only, on exactly the nodes the DaemonSet runs on."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.packaging.conftest import DAEMONSET, INITCONTAINER, Rendered, kustomize, require_tool

COMPONENT = INITCONTAINER / "components" / "tenant-volume"

#: Pod Security `restricted`: the volume types a Pod may use (everything else, hostPath
#: first, is refused), https://kubernetes.io/docs/concepts/security/pod-security-standards/
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def tenant_overlay(directory: Path, namespace: str | None) -> Path:
    """The overlay docs/deploy.md gives, for `namespace` (None: the parameter forgotten)."""
    (directory / "initcontainer").symlink_to(INITCONTAINER)
    doc: dict[str, Any] = {
        "resources": ["initcontainer"],
        "components": ["initcontainer/components/tenant-volume"],
    }
    if namespace is not None:
        doc["configMapGenerator"] = [{
            "name": "weightcache-tenant",
            "literals": [f"namespace={namespace}"],
            "options": {"annotations": {"config.kubernetes.io/local-config": "true"}},
        }]  # fmt: skip
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return directory


@pytest.fixture(scope="module")
def tenant(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    directory = tenant_overlay(tmp_path_factory.mktemp("tenant"), "team-a")
    return Rendered("initcontainer+tenant-volume", kustomize(directory))


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What Pod Security `restricted` refuses in this Pod spec (the checks these manifests
    can trip: volumes, host namespaces, privilege, capabilities, user, seccomp)."""
    found = []
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(key)
    pod_sc = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        sc = c.get("securityContext", {})
        where = c["name"]
        if sc.get("privileged"):
            found.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}: capabilities")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            found.append(f"{where}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"{where}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{where}: hostPort")
    return found


def test_the_example_needs_a_privileged_namespace_without_it(initcontainer: Rendered) -> None:
    """The reason for the component: the plain example mounts a hostPath."""
    pod = initcontainer.one("Deployment")["spec"]["template"]["spec"]
    assert any("weight-cache" in v for v in _restricted_violations(pod))


def test_the_pods_pass_restricted_pod_security(tenant: Rendered) -> None:
    pod = tenant.one("Deployment")["spec"]["template"]["spec"]
    assert _restricted_violations(pod) == []
    (cache,) = [v for v in pod["volumes"] if v["name"] == "weight-cache"]
    assert cache == {
        "name": "weight-cache",
        "persistentVolumeClaim": {"claimName": "weightcache", "readOnly": True},
    }
    for c in pod["initContainers"] + pod["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] == "weight-cache":
                assert m.get("readOnly") is True, c["name"]


def test_the_volume_is_the_daemons_cache_on_its_nodes(tenant: Rendered) -> None:
    """Path and nodes as the DaemonSet's, read-only, bound to this namespace's claim only,
    and never deleted with the claim."""
    daemonset = Rendered("daemonset", kustomize(DAEMONSET))
    ds = daemonset.one("DaemonSet")["spec"]["template"]["spec"]
    (host,) = [v["hostPath"] for v in ds["volumes"] if v["name"] == "weight-cache"]
    terms = ds["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    pv, pvc = tenant.one("PersistentVolume"), tenant.one("PersistentVolumeClaim")
    assert pv["metadata"]["name"] == "weightcache-team-a"
    assert pv["spec"]["local"] == {"path": host["path"]}
    assert pv["spec"]["nodeAffinity"]["required"] == terms
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    # Read-only at the mount, whatever a tenant's Pod spec asks.
    assert pv["spec"]["mountOptions"] == ["ro"]
    assert pv["spec"]["claimRef"]["namespace"] == pvc["metadata"]["namespace"] == "team-a"
    assert pv["spec"]["claimRef"]["name"] == pvc["metadata"]["name"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["spec"]["storageClassName"] == pv["spec"]["storageClassName"]


def test_everything_lands_in_the_tenant_namespace(tenant: Rendered) -> None:
    namespaced = [d for d in tenant.docs if d["kind"] != "PersistentVolume"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"team-a"}, [
        (d["kind"], d["metadata"].get("namespace")) for d in namespaced
    ]
    assert "ConfigMap" not in {d["kind"] for d in tenant.docs}, "the parameter is build-time"


def test_two_tenants_get_two_volumes(tmp_path: Path) -> None:
    names = []
    for ns in ("team-a", "team-b"):
        (tmp_path / ns).mkdir()
        docs = kustomize(tenant_overlay(tmp_path / ns, ns))
        names += [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolume"]
    assert names == ["weightcache-team-a", "weightcache-team-b"]


def test_a_forgotten_namespace_fails_the_build(tmp_path: Path) -> None:
    kubectl = require_tool("kubectl", "the kubectl package")
    proc = subprocess.run(
        [kubectl, "kustomize", str(tenant_overlay(tmp_path, None))],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "weightcache-tenant" in proc.stderr, proc.stderr


def test_the_tenant_objects_validate_strictly(
    tenant: Rendered, kubernetes_validate: str, tmp_path: Path
) -> None:
    manifest = tmp_path / "tenant.yaml"
    manifest.write_text(yaml.safe_dump_all(tenant.docs, sort_keys=False))
    proc = subprocess.run(
        [kubernetes_validate, "--strict", "-k", "1.30.0", str(manifest)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
