"""The manifests agree with each other: paths, ports, labels and the revision they serve.

A cache that Pods and the daemon do not actually share, or an engine pointed at a path the
fetch does not fill, renders and validates fine; these tests catch that.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CACHE_HOST_PATH = "/var/lib/weightcache"


def _fetch(initcontainer: Any) -> Any:
    fetches = [c for c in initcontainer.weightcache_containers() if "fetch" in c.argv]
    assert len(fetches) == 1, "expected one `weightcache fetch` init container"
    assert fetches[0].init, "`weightcache fetch` must be an init container"
    return fetches[0]


def _daemon(daemonset: Any) -> Any:
    daemons = [c for c in daemonset.weightcache_containers() if "daemon" in c.argv]
    assert len(daemons) == 1, "expected one `weightcache daemon` container"
    return daemons[0]


def _engine(initcontainer: Any) -> Any:
    engines = [c for c in initcontainer.containers() if not c.init and not c.runs_weightcache]
    assert len(engines) == 1, "expected one inference engine container"
    return engines[0]


def _source(fetch: Any) -> tuple[str, str, str]:
    """(source, name, revision) of the fetch: the first positional after `fetch`."""
    argv = fetch.argv
    source = argv[argv.index("fetch") + 1]
    assert source.startswith("s3://"), f"{fetch.where}: SOURCE {source} is not s3://"
    name, revision = source.rstrip("/").split("/")[-2:]
    return source.rstrip("/"), name, revision


def _cache_volume(container: Any, cache_dir: str) -> dict[str, Any]:
    mount = container.mount_holding(cache_dir)
    assert mount["mountPath"].rstrip("/") == cache_dir.rstrip("/"), (
        f"{container.where}: --cache-dir {cache_dir} is not itself a volume mount"
    )
    host = container.volume(mount["name"]).get("hostPath")
    assert host is not None, f"{container.where}: cache dir is not on the node's hostPath"
    return host  # type: ignore[no-any-return]


def test_fetch_mounts_the_node_cache_read_only(initcontainer: Any) -> None:
    """Tenants cannot change each other's weights (design §5): the Pod's fetch asks
    the daemon through its socket in the cache and writes nothing itself."""
    fetch = _fetch(initcontainer)
    cache_dir = fetch.option("--cache-dir")
    host = _cache_volume(fetch, cache_dir)
    assert host["path"] == CACHE_HOST_PATH
    assert fetch.mount_holding(cache_dir).get("readOnly") is True
    assert "--no-daemon" not in fetch.argv and fetch.env("WEIGHTCACHE_DAEMON") is None


def test_daemon_keeps_free_space_above_the_kubelets_thresholds(daemonset: Any) -> None:
    """--min-free above the kubelet's defaults (image GC at 85% used, Pod eviction below
    10-15% free), whatever the cache's --capacity (design §5)."""
    from weightcache.config import Capacity

    floor = Capacity.parse(_daemon(daemonset).option("--min-free"), "--min-free", zero_ok=True)
    assert floor.percent is not None and floor.percent > 15, floor


def test_read_write_fallback_is_an_explicit_component(tmp_path: Path) -> None:
    """The read-write mount (fetch alone without a daemon) is a component one opts into;
    it changes the fetch's cache mount and nothing else, and says its risk."""
    from tests.packaging.conftest import INITCONTAINER, Rendered, kustomize, overlay

    component = INITCONTAINER / "components" / "read-write"
    text = (component / "kustomization.yaml").read_text()
    assert "risk" in text.lower() and "not re-hashed" in text, "the component must say its risk"
    base = Rendered("initcontainer", kustomize(INITCONTAINER))
    rw = Rendered("initcontainer+read-write",
                  kustomize(overlay(tmp_path, INITCONTAINER, (component,))))  # fmt: skip
    fetch = _fetch(rw)
    assert fetch.mount_holding(fetch.option("--cache-dir")).get("readOnly") is False
    assert _engine(rw).mount_holding(_engine(rw).option("--model")).get("readOnly") is True
    changed = [(a.where, b.where) for a, b in zip(base.containers(), rw.containers(), strict=True)
               if a.spec != b.spec]  # fmt: skip
    assert changed == [(fetch.where, fetch.where)], changed
    # Fetching alone, nothing evicts: the fetch keeps the daemon's floor itself.
    daemonset = Rendered("daemonset", kustomize(REPO / "daemonset"))
    assert fetch.option("--min-free") == _daemon(daemonset).option("--min-free")


def test_the_hf_component_serves_the_commit_it_fetches(
    initcontainer: Any, initcontainer_hf: Any
) -> None:
    """hf:// (design §4): a pinned commit (a hit needs no network), the engine reading the
    directory the fetch fills, HF_TOKEN from an optional Secret, and nothing else changed."""
    from weightcache.sourceurl import Source

    fetch = _fetch(initcontainer_hf)
    argv = fetch.argv
    source = Source.parse(argv[argv.index("fetch") + 1])
    assert source.scheme == "hf" and source.pinned, source
    expected = f"{fetch.option('--cache-dir')}/{source.name}/{source.revision}"
    assert _engine(initcontainer_hf).option("--model") == expected
    assert fetch.mount_holding(fetch.option("--cache-dir")).get("readOnly") is True
    refs = [e["secretRef"] for e in fetch.spec.get("envFrom", []) if "secretRef" in e]
    assert refs == [{"name": "weightcache-hf", "optional": True}], refs
    assert fetch.env("HF_TOKEN") is None, "a token belongs in the Secret, not the manifest"
    pairs = zip(initcontainer.containers(), initcontainer_hf.containers(), strict=True)
    changed = [a.where for a, b in pairs if a.spec != b.spec]
    assert changed == [fetch.where, _engine(initcontainer_hf).where], changed


def test_fetch_records_its_pod_for_the_lease(initcontainer: Any) -> None:
    env = _fetch(initcontainer).env("POD_UID")
    assert env is not None, "init container lacks POD_UID (the lease would never end)"
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_credentials_come_from_an_optional_secret(initcontainer: Any, daemonset: Any) -> None:
    for c in [*initcontainer.weightcache_containers(), *daemonset.weightcache_containers()]:
        refs = [e["secretRef"] for e in c.spec.get("envFrom", []) if "secretRef" in e]
        assert refs, f"{c.where}: no credentials Secret"
        # Optional, so web identity (IRSA) or an instance profile works without the Secret.
        assert all(r.get("optional") is True for r in refs), c.where
        assert len({r["name"] for r in refs}) == 1
        # Keys never appear in the manifests themselves.
        for e in c.spec.get("env", []):
            assert not re.search(r"SECRET|ACCESS_KEY|TOKEN", e["name"]) or "valueFrom" in e, c.where


def test_engine_reads_what_fetch_wrote(initcontainer: Any) -> None:
    fetch, engine = _fetch(initcontainer), _engine(initcontainer)
    _, name, revision = _source(fetch)
    cache_dir = fetch.option("--cache-dir")
    fetch_mount = fetch.mount_holding(cache_dir)
    model = engine.option("--model")
    engine_mount = engine.mount_holding(model)
    assert engine_mount["name"] == fetch_mount["name"], (
        "engine reads another volume than fetch fills"
    )
    assert engine_mount.get("readOnly") is True, "the engine must mount the cache read-only"
    relative = model[len(engine_mount["mountPath"].rstrip("/")) :].strip("/")
    assert relative == f"{name}/{revision}", (
        f"engine --model {model} is not <cache>/{name}/{revision}, where fetch puts the revision"
    )


def test_startup_probe_budget_is_load_not_download(initcontainer: Any) -> None:
    engine = _engine(initcontainer)
    probe = engine.spec.get("startupProbe")
    assert probe is not None, "the engine needs a startupProbe"
    budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    # The download happens in the init container, before probes start; what is left is
    # reading the cache and engine init: ~140 GB at ~100 MB/s when the cache is on network
    # storage (23 min), not only local NVMe. Hours would hide a broken cache.
    assert 1500 <= budget <= 3600, f"startupProbe budget {budget}s"
    assert _fetch(initcontainer).init


def test_engine_requests_gpus_and_stays_offline(initcontainer: Any) -> None:
    """How many GPUs: test_gpu_operations checks that the model fits them."""
    engine = _engine(initcontainer)
    assert int(engine.spec["resources"]["limits"].get("nvidia.com/gpu", 0)) >= 1
    hub = engine.env("HF_HUB_OFFLINE")
    assert hub is not None and hub.get("value") == "1"


def test_pods_and_daemon_share_one_host_directory(initcontainer: Any, daemonset: Any) -> None:
    fetch, daemon = _fetch(initcontainer), _daemon(daemonset)
    fetch_host = _cache_volume(fetch, fetch.option("--cache-dir"))
    daemon_host = _cache_volume(daemon, daemon.option("--cache-dir"))
    assert fetch_host["path"] == daemon_host["path"] == CACHE_HOST_PATH, (
        "Pods and the daemon must share the node cache, or every replica pulls its own copy"
    )


def test_daemon_reads_models_from_a_live_configmap_mount(daemonset: Any) -> None:
    daemon = _daemon(daemonset)
    models_path = daemon.option("--models")
    mount = daemon.mount_holding(models_path)
    assert "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    assert mount.get("readOnly") is True
    volume = daemon.volume(mount["name"])
    cm_name = volume["configMap"]["name"]
    (cm,) = [d for d in daemonset.of_kind("ConfigMap") if d["metadata"]["name"] == cm_name]
    key = models_path[len(mount["mountPath"].rstrip("/")) :].strip("/")
    assert key in cm["data"], f"ConfigMap {cm_name} has no {key}"
    assert cm["data"][key] == (REPO / "daemonset" / "models.yaml").read_text()


def test_models_file_follows_the_spec_format(daemonset: Any) -> None:
    models = yaml.safe_load((REPO / "daemonset" / "models.yaml").read_text())
    assert set(models) == {"models"} and models["models"]
    for entry in models["models"]:
        assert set(entry) <= {"source", "name", "revision", "pin"}, entry
        assert re.fullmatch(r"s3://[^/]+/(.+/)?[^/]+/[^/]+", entry["source"]), entry
        name, revision = entry["source"].split("/")[-2:]
        for key in ("name", "revision"):
            # Unquoted, YAML turns 2026-10-01 into a date and 1.10 into a float.
            assert isinstance(entry.get(key, ""), str), f"quote the {key} of {entry['source']}"
        assert entry.get("name", name) == name and entry.get("revision", revision) == revision
        assert isinstance(entry.get("pin", False), bool)


def test_the_example_revision_is_prefetched_and_pinned(initcontainer: Any) -> None:
    """Install order in docs/deploy.md: the Deployment's revision is in models.yaml first."""
    source, _, _ = _source(_fetch(initcontainer))
    models = yaml.safe_load((REPO / "daemonset" / "models.yaml").read_text())["models"]
    entries = [m for m in models if m["source"].rstrip("/") == source]
    assert entries, f"{source} is not in daemonset/models.yaml: nodes would not be warm"
    assert entries[0].get("pin") is True


def test_daemon_probes_and_metrics_port(daemonset: Any) -> None:
    daemon = _daemon(daemonset)
    host, _, port = daemon.option("--metrics-addr").rpartition(":")
    assert host == "0.0.0.0", "metrics must listen on the Pod IP for Prometheus"
    assert int(port) == daemon.port("metrics") == 9402
    assert daemon.port("peer") == 9401
    live, ready = daemon.spec["livenessProbe"]["httpGet"], daemon.spec["readinessProbe"]["httpGet"]
    assert (live["path"], ready["path"]) == ("/healthz", "/readyz")
    for probe in (live, ready):
        assert probe["port"] in ("metrics", 9402)


def test_daemonset_placement_and_lifecycle(daemonset: Any) -> None:
    ds = daemonset.one("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec, "a nodeSelector ANDs with the affinity's OR of labels"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # One term per label, ORed like NVIDIA's device plugin chart: any one selects the node.
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": key, "operator": "In", "values": ["true"]}]}
        for key in (
            "feature.node.kubernetes.io/pci-10de.present",  # Node Feature Discovery
            "nvidia.com/gpu.present",  # the GPU operator
            "node.weightcache.io/gpu",  # our own, for the plain device plugin
        )
    ]
    assert spec["terminationGracePeriodSeconds"] == 60
    priority = spec["priorityClassName"]
    classes = {d["metadata"]["name"]: d for d in daemonset.of_kind("PriorityClass")}
    assert priority == "system-node-critical" or priority in classes, (
        f"unknown PriorityClass {priority}"
    )
    daemon = _daemon(daemonset)
    node = daemon.env("NODE_NAME")
    assert node is not None and node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    kubelet = daemon.mount_holding(daemon.option("--kubelet-pods-dir"))
    assert kubelet["mountPath"] == "/var/lib/kubelet/pods" and kubelet.get("readOnly") is True
    assert daemon.volume(kubelet["name"])["hostPath"]["path"] == "/var/lib/kubelet/pods"
    limits = daemon.spec["resources"]["limits"]
    assert "memory" in limits and "cpu" in limits


def test_headless_service_exposes_metrics_and_peer(daemonset: Any) -> None:
    svc = daemonset.one("Service")
    ds = daemonset.one("DaemonSet")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert {n: p["port"] for n, p in ports.items()} == {"metrics": 9402, "peer": 9401}
    daemon = _daemon(daemonset)
    for name, p in ports.items():
        target = p.get("targetPort", p["port"])
        assert target == name or target == daemon.port(name)


def test_dashboard_configmap_is_the_json_file(daemonset: Any) -> None:
    raw = (REPO / "daemonset" / "grafana-dashboard.json").read_text()
    json.loads(raw)
    cms = [
        d
        for d in daemonset.of_kind("ConfigMap")
        if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(cms) == 1, 'expected one ConfigMap labelled grafana_dashboard: "1"'
    (content,) = cms[0]["data"].values()
    assert content == raw
    # A content-hash suffix would leave the old dashboard ConfigMap behind on every change.
    assert cms[0]["metadata"]["name"] == "weightcache-grafana-dashboard"


def test_runbook_links_point_at_existing_sections(daemonset: Any) -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    anchors = {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", guide, flags=re.M)}
    rules = daemonset.one("PrometheusRule")["spec"]["groups"]
    for rule in (r for g in rules for r in g["rules"] if "alert" in r):
        # runbook_url (the conventional name, which Alertmanager templates and receivers
        # link), absolute: a relative path means nothing in a pager notification.
        link = rule.get("annotations", {}).get("runbook_url")
        assert link, f"{rule['alert']} has no runbook_url annotation"
        path, _, anchor = link.partition("#")
        assert path.startswith("https://") and path.endswith("/docs/deploy.md"), link
        assert anchor in anchors, f"{rule['alert']}: {link} is no section of docs/deploy.md"


def test_runbook_base_url_is_set_in_one_place(tmp_path: Path) -> None:
    """A fork or an overlay whose docs live elsewhere changes one value, not every alert."""
    from tests.packaging.conftest import DAEMONSET, kustomize

    default = "https://github.com/weightcache/weightcache/blob/main/docs/deploy.md"
    files = [p for p in DAEMONSET.rglob("*.yaml") if default in p.read_text()]
    assert len(files) == 1 and files[0].read_text().count(default) == 1, files
    base = "https://docs.example.com/weightcache/deploy.html"
    overlay = {
        "resources": ["../daemonset"],
        "components": ["../daemonset/components/runbook-url"],
        "configMapGenerator": [
            {"name": "weightcache-runbook", "behavior": "merge", "literals": [f"base-url={base}"]}
        ],
    }
    (tmp_path / "daemonset").symlink_to(DAEMONSET)
    (tmp_path / "overlay").mkdir()
    (tmp_path / "overlay" / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    docs = kustomize(tmp_path / "overlay")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    links = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"]
             for r in g["rules"] if "alert" in r]  # fmt: skip
    assert links and all(link.startswith(base + "#") for link in links), links
    names = [d["metadata"]["name"] for d in docs]
    assert "weightcache-runbook" not in names, "the build-time ConfigMap must not be applied"


def _github_anchor(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_guide_links_within_itself_resolve() -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    anchors = {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", guide, flags=re.M)}
    for link in re.findall(r"\]\(#([^)]+)\)", guide):
        assert link in anchors, f"docs/deploy.md links to #{link}, which is no heading"


# -- peer-to-peer (design §8) -------------------------------------------------------------------


def test_daemon_serves_peers_with_a_required_token_secret(daemonset: Any) -> None:
    daemon = _daemon(daemonset)
    host, _, port = daemon.option("--peer-addr").rpartition(":")
    assert host == "0.0.0.0", "the peer port must listen on the Pod IP for the other nodes"
    assert int(port) == daemon.port("peer") == 9401
    daemon.option("--peer-upload-limit")  # an explicit upload budget, once
    # The token never appears in the manifests: it comes from a Secret that must exist.
    assert not any(a == "--peer-token" or a.startswith("--peer-token=") for a in daemon.argv)
    env = daemon.env("WEIGHTCACHE_PEER_TOKEN")
    assert env is not None, "the daemon gets no peer token"
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"] and ref.get("optional") is False, ref


def test_peers_are_found_through_the_headless_service(daemonset: Any) -> None:
    daemon, svc = _daemon(daemonset), daemonset.one("Service")
    name, _, port = daemon.option("--peer-service").rpartition(":")
    namespace = daemonset.one("DaemonSet")["metadata"]["namespace"]
    fqdn = name.replace("$(POD_NAMESPACE)", namespace)
    assert fqdn.split(".")[0] == svc["metadata"]["name"], f"{name} is not the Service"
    assert fqdn in (svc["metadata"]["name"], f"{svc['metadata']['name']}.{namespace}.svc")
    assert daemon.env("POD_NAMESPACE") is not None or "$(" not in name
    peer = next(p for p in svc["spec"]["ports"] if p["name"] == "peer")
    assert int(port) == peer["port"]
    # Headless and publishing not-ready Pods: a node still prefetching serves what it has.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]


def _admits(rule: dict[str, Any], port: str | int, container: Any) -> bool:
    """Whether an ingress rule covers a port (by name or number); no `ports` covers all."""
    ports = rule.get("ports")
    if not ports:
        return True
    names = {port, container.port(port)} if isinstance(port, str) else {port}
    return any(p.get("port") in names or "port" not in p for p in ports)


def _peer_port_problems(policy: dict[str, Any], daemonset: Any) -> list[str]:
    """What is wrong with the policy's admission of the peer port (empty: nothing)."""
    problems = []
    daemon = _daemon(daemonset)
    ds = daemonset.one("DaemonSet")
    labels, ds_selector = ds["spec"]["template"]["metadata"]["labels"], ds["spec"]["selector"]
    for i, rule in enumerate(policy["spec"].get("ingress", [])):
        if not _admits(rule, "peer", daemon):
            continue
        sources = rule.get("from")
        if not sources:
            problems.append(f"ingress[{i}] admits the peer port from anywhere")
            continue
        for source in sources:
            selector = source.get("podSelector", {}).get("matchLabels")
            if set(source) != {"podSelector"} or not selector:
                problems.append(f"ingress[{i}] admits the peer port from {source}")
            elif not selector.items() <= labels.items():
                problems.append(f"ingress[{i}] admits Pods other than the daemons: {selector}")
            elif not ds_selector["matchLabels"].items() <= selector.items():
                problems.append(f"ingress[{i}] selects more Pods than the DaemonSet's")
    return problems


def test_network_policy_admits_the_peer_port_only_from_daemon_pods(daemonset: Any) -> None:
    policy = daemonset.one("NetworkPolicy")
    ds = daemonset.one("DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    assert policy["metadata"].get("namespace") == ds["metadata"].get("namespace")
    assert not _peer_port_problems(policy, daemonset)
    daemon = _daemon(daemonset)
    rules = policy["spec"]["ingress"]
    assert any(_admits(r, "peer", daemon) for r in rules), "nobody may reach the peer port"
    # Prometheus must still scrape (the probes come from the node, which is always allowed).
    assert any(_admits(r, "metrics", daemon) for r in rules), "the metrics port is closed"


def test_network_policy_check_catches_an_open_peer_port(daemonset: Any) -> None:
    """Negative control: the check above flags a policy that opens the peer port wider."""
    policy = daemonset.one("NetworkPolicy")
    for extra in (
        {"ports": [{"port": "peer", "protocol": "TCP"}]},
        {"from": [{"namespaceSelector": {}}], "ports": [{"port": 9401}]},
        {"from": [{"podSelector": {"matchLabels": {"app": "vllm"}}}]},
        {"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP"}]},
    ):
        wider = yaml.safe_load(yaml.safe_dump(policy))
        wider["spec"]["ingress"].append(extra)
        assert _peer_port_problems(wider, daemonset), extra


def test_the_priority_class_says_it_preempts_inference_pods(daemonset: Any) -> None:
    """PreemptLowerPriority evicts Pods of lower priority, inference Pods included, to place
    a daemon on a full node: the manifest and the guide must say so."""
    (pc,) = daemonset.of_kind("PriorityClass")
    if pc.get("preemptionPolicy", "PreemptLowerPriority") == "Never":
        return
    text = (REPO / "daemonset" / "priorityclass.yaml").read_text()
    comment = " ".join(line for line in text.lower().splitlines() if line.startswith("#"))
    assert re.search(r"preempts?\b.*inference pods", comment), "priorityclass.yaml"
    guide = (REPO / "docs" / "deploy.md").read_text()
    paragraphs = [p for p in guide.split("\n\n") if pc["metadata"]["name"] in p]
    assert any("preempt" in p.lower() and "inference" in p.lower() for p in paragraphs), (
        f"docs/deploy.md does not say that {pc['metadata']['name']} preempts inference Pods"
    )


def _comment_before(text: str, key: str) -> str:
    """The comment lines right above the first line that starts with `key` (indented)."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith(key)][:1]
    block = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        block.append(line.strip().lstrip("#").strip())
    return " ".join(reversed(block))


def test_the_daemonset_comments_say_what_the_code_does() -> None:
    """/readyz does not wait for pinned revisions (Daemon.serving), and with the Pods'
    read-only mount a miss without a daemon fails (exit 2) rather than fetching alone."""
    from weightcache.daemon.daemon import Daemon

    assert "Waiting for pinned" in (Daemon.serving.__doc__ or "")
    text = (REPO / "daemonset" / "daemonset.yaml").read_text()
    readiness = _comment_before(text, "readinessProbe:")
    assert "does not wait" in readiness and "pinned" in readiness, readiness
    rollout = _comment_before(text, "maxUnavailable:")
    assert "alone" not in rollout and "exit 2" in rollout, rollout
