"""Every kustomization renders, and every rendered object validates offline.

Core kinds go through `kubernetes-validate --strict` (its bundled schemas: unknown fields are
errors) for the oldest and newest Kubernetes versions we claim. The Prometheus Operator kinds
(PodMonitor, PrometheusRule) have no schema there; they are checked against the strict subset
below, written for the fields these manifests use, so a misspelt or misplaced field fails.
The rules' PromQL is checked separately by promtool (test_prometheus_rules.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

#: Oldest and newest Kubernetes minor versions the manifests are validated against.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")

CRD_GROUP = "monitoring.coreos.com/"

_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_METADATA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    "required": ["name"],
}

_LABEL_SELECTOR = _closed(
    {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _closed(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)

_RELABEL_ACTIONS = [
    "replace",
    "Replace",
    "keep",
    "Keep",
    "drop",
    "Drop",
    "hashmod",
    "HashMod",
    "labelmap",
    "LabelMap",
    "labeldrop",
    "LabelDrop",
    "labelkeep",
    "LabelKeep",
    "lowercase",
    "Lowercase",
    "uppercase",
    "Uppercase",
    "keepequal",
    "KeepEqual",
    "dropequal",
    "DropEqual",
]

_RELABELING = _closed(
    {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"enum": _RELABEL_ACTIONS},
    }
)

POD_MONITOR = _closed(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": _METADATA,
        "spec": _closed(
            {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _closed(
                    {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    }
                ),
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer"},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "port": {"type": "string"},
                            "portNumber": {"type": "integer"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "honorTimestamps": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABELING},
                            "metricRelabelings": {"type": "array", "items": _RELABELING},
                        }
                    ),
                },
            },
            ("selector", "podMetricsEndpoints"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

_RULE = {
    **_closed(
        {
            "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "alert": {"type": "string", "pattern": r"^[A-Za-z][A-Za-z0-9_]*$"},
            "expr": {"type": ["string", "integer"], "minLength": 1},
            "for": {"type": "string", "pattern": _DURATION},
            "keep_firing_for": {"type": "string", "pattern": _DURATION},
            "labels": _STRING_MAP,
            "annotations": _STRING_MAP,
        },
        ("expr",),
    ),
    "oneOf": [
        {
            "required": ["record"],
            "not": {
                "anyOf": [
                    {"required": ["alert"]},
                    {"required": ["for"]},
                    {"required": ["annotations"]},
                ]
            },
        },
        {"required": ["alert"], "not": {"required": ["record"]}},
    ],
}

PROMETHEUS_RULE = _closed(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": _closed(
            {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "query_offset": {"type": "string", "pattern": _DURATION},
                            "limit": {"type": "integer"},
                            "labels": _STRING_MAP,
                            "rules": {"type": "array", "minItems": 1, "items": _RULE},
                        },
                        ("name", "rules"),
                    ),
                }
            },
            ("groups",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

CRD_SCHEMAS = {"PodMonitor": POD_MONITOR, "PrometheusRule": PROMETHEUS_RULE}


def _core(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if not d["apiVersion"].startswith(CRD_GROUP)]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_objects_validate_strictly(
    rendered: Any, kubernetes_validate: str, version: str, tmp_path: Path
) -> None:
    core = _core(rendered.docs)
    assert core, f"{rendered.name} rendered no core objects"
    manifest = tmp_path / f"{rendered.name}.yaml"
    manifest.write_text(yaml.safe_dump_all(core, sort_keys=False))
    proc = subprocess.run(
        [kubernetes_validate, "--strict", "-k", version, str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{rendered.name} against Kubernetes {version}:\n{output}"
    # kubernetes-validate only warns (exit 0) for a kind it has no schema for: that must not
    # slip through as a pass, so every object has to be reported as passed.
    passed = len(re.findall(r"passed for resource", output))
    assert passed == len(core), (
        f"{rendered.name}: {passed}/{len(core)} objects validated:\n{output}"
    )


def test_strict_validation_rejects_an_unknown_field(
    initcontainer: Any, kubernetes_validate: str, tmp_path: Path
) -> None:
    """Negative control: a misspelt Pod field must fail the validator as it is run above."""
    deployment = dict(initcontainer.one("Deployment"))
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(yaml.safe_dump(broken))
    proc = subprocess.run(
        [kubernetes_validate, "--strict", "-k", KUBERNETES_VERSIONS[-1], str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "terminationGracePeriodSecond" in proc.stdout + proc.stderr


def test_only_known_custom_resources(rendered: Any) -> None:
    kinds = {d["kind"] for d in rendered.docs if d["apiVersion"].startswith(CRD_GROUP)}
    assert kinds <= set(CRD_SCHEMAS), f"no offline schema for {kinds - set(CRD_SCHEMAS)}"


def test_custom_resources_match_the_operator_api(daemonset: Any) -> None:
    found = [d for d in daemonset.docs if d["kind"] in CRD_SCHEMAS]
    assert {d["kind"] for d in found} == set(CRD_SCHEMAS), "daemonset/ should ship both"
    for doc in found:
        jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])


def test_crd_subset_rejects_a_misplaced_field(daemonset: Any) -> None:
    """Negative control for the hand-written CRD subset."""
    rule = yaml.safe_load(yaml.safe_dump(daemonset.one("PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["recrod"] = rule["spec"]["groups"][0]["rules"][0].pop(
        "record"
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, PROMETHEUS_RULE)
    monitor = yaml.safe_load(yaml.safe_dump(daemonset.one("PodMonitor")))
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, POD_MONITOR)


def test_pod_monitor_scrapes_the_daemon_metrics_port(daemonset: Any) -> None:
    monitor = daemonset.one("PodMonitor")
    ds = daemonset.one("DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items(), "PodMonitor selects no daemon Pod"
    ports = {
        p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    }
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in ports
        assert endpoint.get("path", "/metrics") == "/metrics"
    # The monitor lives where the DaemonSet does (PodMonitors select Pods in their namespace
    # unless namespaceSelector says otherwise).
    assert monitor["metadata"].get("namespace") == ds["metadata"].get("namespace")
