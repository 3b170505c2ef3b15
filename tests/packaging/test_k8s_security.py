"""Security posture and resources of every rendered container, so no edit quietly drops them."""

from __future__ import annotations

from typing import Any

import pytest

#: hostPath volumes the manifests may use, and whether a container may write to them.
ALLOWED_HOST_PATHS = {"/var/lib/weightcache": True, "/var/lib/kubelet/pods": False}


def effective(container: Any, field: str) -> Any:
    """A securityContext field as the kubelet applies it: the container's, else the Pod's."""
    own = container.spec.get("securityContext", {})
    if field in own:
        return own[field]
    return container.pod_spec.get("securityContext", {}).get(field)


def test_every_container_is_locked_down(rendered: Any) -> None:
    problems = []
    for c in rendered.containers():
        sc = c.spec.get("securityContext", {})
        if effective(c, "runAsNonRoot") is not True:
            problems.append(f"{c.where}: runAsNonRoot is not true")
        uid = effective(c, "runAsUser")
        if uid is not None and int(uid) == 0:
            problems.append(f"{c.where}: runAsUser 0")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{c.where}: readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c.where}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{c.where}: privileged")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{c.where}: capabilities do not drop ALL")
        if caps.get("add"):
            problems.append(f"{c.where}: adds capabilities {caps['add']}")
        if (effective(c, "seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{c.where}: seccompProfile is not RuntimeDefault")
    assert not problems, "\n".join(problems)


def test_weightcache_runs_as_the_image_uid(rendered: Any) -> None:
    """The cache is shared through uid 65532 (Dockerfile USER); every writer must be it."""
    for c in rendered.weightcache_containers():
        assert effective(c, "runAsUser") == 65532, c.where
        assert effective(c, "runAsGroup") == 65532, c.where


def test_pods_stay_off_the_host_namespaces(rendered: Any) -> None:
    for w in rendered.workloads():
        spec = w["spec"]["template"]["spec"]
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(field), f"{w['kind']}/{w['metadata']['name']} sets {field}"


def test_host_paths_are_the_cache_and_read_only_kubelet_pods(rendered: Any) -> None:
    for c in rendered.containers():
        for mount in c.spec.get("volumeMounts", []):
            host = c.volume(mount["name"]).get("hostPath")
            if host is None:
                continue
            path = host["path"]
            assert path in ALLOWED_HOST_PATHS, f"{c.where} mounts host path {path}"
            if not ALLOWED_HOST_PATHS[path]:
                assert mount.get("readOnly") is True, f"{c.where}: {path} must be read-only"
            if not c.runs_weightcache:
                # Only weightcache writes the cache; engines read it.
                assert mount.get("readOnly") is True, f"{c.where}: {path} must be read-only"
            if path == "/var/lib/weightcache":
                # Directory: a node nobody prepared shows up as a Pod event, not a run-time
                # failure in a root-owned directory (components/node-prep creates it).
                assert host.get("type") == "Directory", f"{c.where}: cache hostPath type"
            if path == "/var/lib/kubelet/pods":
                assert mount.get("mountPropagation") == "HostToContainer", (
                    f"{c.where}: a private mount of {path} holds other Pods' volume mounts"
                )


def test_every_container_requests_resources(rendered: Any) -> None:
    problems = []
    for c in rendered.containers():
        res = c.spec.get("resources", {})
        requests, limits = res.get("requests", {}), res.get("limits", {})
        for r in ("cpu", "memory"):
            if r not in requests:
                problems.append(f"{c.where}: no {r} request")
        # Memory is not compressible: without a limit one container can take the node down.
        if "memory" not in limits:
            problems.append(f"{c.where}: no memory limit")
        for key, value in requests.items():
            if key in limits and _quantity(limits[key]) < _quantity(value):
                problems.append(f"{c.where}: {key} limit below its request")
    assert not problems, "\n".join(problems)


def _quantity(value: Any) -> float:
    """A Kubernetes quantity as a number (enough of the grammar for comparisons)."""
    text = str(value)
    suffixes = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def test_images_are_pinned(rendered: Any) -> None:
    for c in rendered.containers():
        image = str(c.spec["image"])
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest"), (
            f"{c.where}: image {image} is not pinned"
        )


def test_no_api_token_unless_node_labels(rendered: Any) -> None:
    """Nothing talks to the Kubernetes API except the optional node labels."""
    for w in rendered.workloads():
        spec = w["spec"]["template"]["spec"]
        wants_token = any(
            any(a == "--node-name" or a.startswith("--node-name=") for a in c.argv)
            or c.env("WEIGHTCACHE_NODE_NAME") is not None
            for c in rendered.containers()
            if c.workload is w
        )
        assert spec.get("automountServiceAccountToken") is wants_token, (
            f"{rendered.name} {w['kind']}/{w['metadata']['name']}: automountServiceAccountToken "
            f"should be {wants_token}"
        )


def test_rbac_is_only_what_node_labels_need(rendered: Any) -> None:
    roles = [d for d in rendered.docs if d["kind"] in ("Role", "ClusterRole")]
    if rendered.name != "daemonset+node-labels":
        assert not roles, f"{rendered.name}: RBAC without the node-labels component"
        assert not [d for d in rendered.docs if d["kind"].endswith("RoleBinding")]
        return
    assert [r["kind"] for r in roles] == ["ClusterRole"]
    assert roles[0]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}
    ]
    (binding,) = rendered.of_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == roles[0]["metadata"]["name"]
    ds = rendered.one("DaemonSet")
    sa = ds["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa, "namespace": ds["metadata"]["namespace"]}
    ]


@pytest.mark.parametrize("tolerated_by", ["Deployment", "DaemonSet"])
def test_gpu_taint_is_tolerated(initcontainer: Any, daemonset: Any, tolerated_by: str) -> None:
    source = initcontainer if tolerated_by == "Deployment" else daemonset
    spec = source.one(tolerated_by)["spec"]["template"]["spec"]
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    assert _tolerates(spec.get("tolerations", []), taint), (
        f"{tolerated_by} does not tolerate the nvidia.com/gpu taint"
    )


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' matching: an empty key with Exists matches every taint; an empty effect
    matches every effect."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if not t.get("key"):
            if t.get("operator") == "Exists":
                return True
            continue
        if t["key"] != taint["key"]:
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def test_the_daemon_tolerates_every_taint_by_default(daemonset: Any) -> None:
    """A read-only miss without a daemon is a hard failure (exit 2), so the daemon goes
    wherever inference Pods may go, whatever they tolerate (as the device plugin does)."""
    tolerations = daemonset.one("DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    assert {"operator": "Exists"} in tolerations, tolerations
    for taint in (
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "inference", "effect": "NoSchedule"},
        {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"},
        {"key": "team-a/reserved", "value": "", "effect": "NoExecute"},
    ):
        assert _tolerates(tolerations, taint), taint


def test_the_daemon_tolerates_what_the_inference_pods_tolerate(
    initcontainer: Any, daemonset: Any
) -> None:
    daemon = daemonset.one("DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    pods = initcontainer.one("Deployment")["spec"]["template"]["spec"].get("tolerations", [])
    for t in pods:
        taint = {"key": t.get("key", "any"), "value": t.get("value", "x"),
                 "effect": t.get("effect") or "NoSchedule"}  # fmt: skip
        assert _tolerates(daemon, taint), t
