"""What a GPU cluster operator needs from the manifests: engine budgets that fit real
storage, a rollout that moves on a full GPU pool, ports that do not collide with
dcgm-exporter, a cache path an overlay can move, and the optional node preparation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.packaging.conftest import (
    DAEMONSET,
    INITCONTAINER,
    NODE_PREP,
    Container,
    Rendered,
    kustomize,
    overlay,
)

#: dcgm-exporter's port: it runs on the same GPU nodes, usually with host networking.
DCGM_EXPORTER_PORT = 9400


def _engine(initcontainer: Rendered) -> Container:
    (engine,) = [c for c in initcontainer.containers() if not c.init and not c.runs_weightcache]
    return engine


def _only(rendered: Rendered, word: str) -> Container:
    (found,) = [c for c in rendered.weightcache_containers() if word in c.argv]
    return found


def _budget(probe: dict[str, Any]) -> int:
    return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))


# -- engine budgets ---------------------------------------------------------------------------


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_engine_probes_wait_longer_than_one_second(initcontainer: Rendered, probe: str) -> None:
    """The 1 s default timeout restarts a loaded engine whose /health answers slowly."""
    spec = _engine(initcontainer).spec[probe]
    assert int(spec.get("timeoutSeconds", 1)) >= 3, f"{probe}: timeoutSeconds"


#: The example's model: Qwen3 70B in BF16, parameters x 2 bytes.
MODEL_BYTES = 70e9 * 2
#: A cold node's share of the store during a scale-out, bytes per second: the rate the
#: example's comments size the deadline for.
COLD_RATE = 200e6
#: Memory of one GPU the example targets (A100/H100 80 GB).
GPU_BYTES = 80e9
#: The most of the GPUs' memory the weights may take; vLLM needs the rest for the KV
#: cache, activations and CUDA graphs.
WEIGHTS_SHARE = 0.75


def test_progress_deadline_covers_a_cold_start(initcontainer: Rendered) -> None:
    """A Deployment is marked failed after progressDeadlineSeconds (default 600) without a
    new ready replica: it must outlast a cold download plus the startup budget. --timeout
    is a stall limit (time without a byte), not a duration, so it is no part of the sum."""
    deployment = initcontainer.one("Deployment")
    deadline = int(deployment["spec"].get("progressDeadlineSeconds", 600))
    download = MODEL_BYTES / COLD_RATE
    startup = _budget(_engine(initcontainer).spec["startupProbe"])
    assert deadline > download + startup, f"{deadline}s < {download:.0f}s + {startup}s"


def test_a_rollout_keeps_a_replica_serving(initcontainer: Rendered) -> None:
    """maxUnavailable as large as replicas stops every replica at once on each rollout."""
    spec = initcontainer.one("Deployment")["spec"]
    unavailable = int(spec["strategy"]["rollingUpdate"]["maxUnavailable"])
    assert int(spec.get("replicas", 1)) > unavailable, spec


def test_the_model_fits_the_gpus_it_asks_for(initcontainer: Rendered) -> None:
    """70B in BF16 is ~140 GB: it needs tensor parallelism over enough 80 GB GPUs, one
    shard per GPU requested."""
    engine = _engine(initcontainer)
    gpus = int(engine.spec["resources"]["limits"]["nvidia.com/gpu"])
    assert int(engine.spec["resources"]["requests"]["nvidia.com/gpu"]) == gpus
    parallel = int(engine.option("--tensor-parallel-size")) if "--tensor-parallel-size" in (
        engine.argv) else 1  # fmt: skip
    assert parallel == gpus, f"--tensor-parallel-size {parallel} on {gpus} GPUs"
    assert WEIGHTS_SHARE * gpus * GPU_BYTES >= MODEL_BYTES, f"{gpus} x 80 GB GPUs"


def test_rollout_moves_on_a_full_gpu_pool(initcontainer: Rendered) -> None:
    """A surge Pod needs a free GPU; on a full pool it stays Pending and the rollout stalls."""
    strategy = initcontainer.one("Deployment")["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxSurge"] == 0
    assert int(strategy["rollingUpdate"]["maxUnavailable"]) >= 1


# -- ports ------------------------------------------------------------------------------------


def test_metrics_port_is_not_dcgm_exporters(daemonset: Rendered) -> None:
    from weightcache.cli import daemon as daemon_command

    daemon = _only(daemonset, "daemon")
    port = int(daemon.option("--metrics-addr").rpartition(":")[2])
    assert port != DCGM_EXPORTER_PORT and daemon.port("metrics") == port
    (default,) = [p.default for p in daemon_command.params if p.name == "metrics_addr"]
    assert default == daemon.option("--metrics-addr"), "the CLI default and the manifest differ"
    service = {p["name"]: p["port"] for p in daemonset.one("Service")["spec"]["ports"]}
    assert DCGM_EXPORTER_PORT not in service.values()


# -- the cache path ---------------------------------------------------------------------------

NVME = "/mnt/nvme0/weightcache"


def cache_path_patch(kind: str, name: str) -> str:
    """The patch docs/deploy.md gives for a cache on another disk (strategic merge: volumes
    merge by name, so only `path` changes)."""
    return (
        f"apiVersion: apps/v1\nkind: {kind}\nmetadata:\n  name: {name}\n"
        "spec:\n  template:\n    spec:\n      volumes:\n        - name: weight-cache\n"
        f"          hostPath:\n            path: {NVME}\n"
    )


def _cache_volumes(rendered: Rendered) -> list[dict[str, Any]]:
    return [
        v["hostPath"]
        for w in rendered.workloads()
        for v in w["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "weight-cache"
    ]


@pytest.mark.parametrize("with_node_prep", [False, True])
def test_cache_path_moves_with_one_patch(
    tmp_path: Path, daemonset: Rendered, with_node_prep: bool
) -> None:
    components = (NODE_PREP,) if with_node_prep else ()
    patch = cache_path_patch("DaemonSet", "weightcache")
    moved = Rendered("moved", kustomize(overlay(tmp_path, DAEMONSET, components, (patch,))))
    volumes = _cache_volumes(moved)
    assert volumes and all(v["path"] == NVME for v in volumes), volumes
    wanted = "DirectoryOrCreate" if with_node_prep else "Directory"
    assert all(v["type"] == wanted for v in volumes), volumes
    # Inside the Pod nothing changes: the daemon still works on /cache.
    assert _only(moved, "daemon").spec == _only(daemonset, "daemon").spec


def test_inference_cache_path_moves_with_one_patch(tmp_path: Path) -> None:
    patch = cache_path_patch("Deployment", "qwen3-70b")
    moved = Rendered("moved", kustomize(overlay(tmp_path, INITCONTAINER, (), (patch,))))
    assert _cache_volumes(moved) == [{"path": NVME, "type": "Directory"}]


# -- node preparation (components/node-prep) --------------------------------------------------


def _prep(rendered: Rendered) -> Container:
    found = [c for c in rendered.containers() if c.init]
    assert [c.spec["name"] for c in found] == ["prepare-node"], "one init container, first"
    return found[0]


def test_node_prep_is_root_with_exactly_chown_and_fowner(daemonset_node_prep: Rendered) -> None:
    prep = _prep(daemonset_node_prep)
    assert prep.spec["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert "memory" in prep.spec["resources"]["limits"]


def test_node_prep_touches_only_the_two_directories(daemonset_node_prep: Rendered) -> None:
    prep = _prep(daemonset_node_prep)
    mounts = {m["mountPath"]: m for m in prep.spec["volumeMounts"]}
    assert set(mounts) == {"/cache", "/var/lib/kubelet/pods"}
    assert prep.volume(mounts["/cache"]["name"])["hostPath"]["path"] == "/var/lib/weightcache"
    kubelet = mounts["/var/lib/kubelet/pods"]
    assert prep.volume(kubelet["name"])["hostPath"]["path"] == "/var/lib/kubelet/pods"
    assert kubelet.get("mountPropagation") == "HostToContainer"
    script = [line.strip() for line in prep.spec["args"][0].splitlines() if line.strip()]
    # The manual step of docs/deploy.md, without recursion into the cache.
    assert script == [
        "set -eu",
        "chown 65532:65532 /cache",
        "chmod 0755 /cache",
        "chmod o+x /var/lib/kubelet/pods",
    ]


def test_node_prep_changes_nothing_else(daemonset: Rendered, daemonset_node_prep: Rendered) -> None:
    """Same objects; in the DaemonSet only the init container and the cache volume's type."""
    plain = {(d["kind"], d["metadata"]["name"]): d for d in daemonset.docs}
    prepped = {(d["kind"], d["metadata"]["name"]): d for d in daemonset_node_prep.docs}
    assert plain.keys() == prepped.keys()
    for key, doc in plain.items():
        if key[0] != "DaemonSet":
            assert prepped[key] == doc, key
    before = daemonset.one("DaemonSet")["spec"]["template"]["spec"]
    after = copy.deepcopy(daemonset_node_prep.one("DaemonSet")["spec"]["template"]["spec"])
    prep = after.pop("initContainers")
    assert prep[0]["image"] == before["containers"][0]["image"], "same image as the daemon"
    for volume in after["volumes"]:
        if volume["name"] == "weight-cache":
            assert volume["hostPath"]["type"] == "DirectoryOrCreate"
            volume["hostPath"]["type"] = "Directory"
    assert after == before
