"""The fleet alerts (PrometheusRule group weightcache.fleet), run by promtool against series
shaped like kube-state-metrics' and the daemons': each fires on its failure and stays silent
on the healthy case next to it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.packaging.conftest import promtool_test

GROUP = "weightcache.fleet"
ALERTS = (
    "WeightcacheGPUNodesWithoutDaemon",
    "WeightcacheDaemonDown",
    "WeightcacheDaemonDownWhilePodsFetch",
    "WeightcacheRevisionNotReady",
    "WeightcachePeerTokenMismatch",
)


def _group(daemonset: Any) -> dict[str, Any]:
    groups = daemonset.one("PrometheusRule")["spec"]["groups"]
    (group,) = [g for g in groups if g["name"] == GROUP]
    return group  # type: ignore[no-any-return]


def _alert(daemonset: Any, name: str) -> dict[str, Any]:
    (rule,) = [r for r in _group(daemonset)["rules"] if r.get("alert") == name]
    return rule  # type: ignore[no-any-return]


def _render(text: str, value: float, labels: dict[str, str]) -> str:
    """The annotation as Prometheus renders it (the template subset these alerts use)."""
    text = text.replace("{{ $value }}", f"{value:g}")
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
    assert "{{" not in text, f"the test cannot render {text!r}"
    return text


def _firing(rule: dict[str, Any], value: float, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {k: _render(v, value, labels) for k, v in rule["annotations"].items()},
    }


def _case(
    name: str, series: dict[str, str], alert: str, at: str, expected: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "name": name,
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}],
    }


def _gpu(node: str, gpus: int) -> tuple[str, str]:
    labels = f'node="{node}",resource="nvidia_com_gpu",unit="integer"'
    return f"kube_node_status_allocatable{{{labels}}}", f"{gpus}x40"


READY = 'kube_pod_status_ready{namespace="weightcache",pod="weightcache-%s",condition="true"}'
DAEMON_POD = (
    'kube_pod_info{namespace="weightcache",pod="weightcache-%s",node="%s",uid="d-%s",'
    'created_by_kind="DaemonSet",created_by_name="weightcache"}'
)


def _daemon(node: str, ready: bool = True) -> dict[str, str]:
    """kube-state-metrics' view of the weightcache daemon Pod on `node`."""
    return {DAEMON_POD % (node, node, node): "1x40", READY % node: f"{int(ready)}x40"}


UP = 'up{job="weightcache/weightcache",node="a",pod="weightcache-x7k2p",namespace="weightcache"}'
REVISION = 'weightcache_revision_ready{node="a",name="m",revision="r1",pinned="true"}'
UNPINNED = 'weightcache_revision_ready{node="a",name="m",revision="r2",pinned="false"}'
REFUSED = 'weightcache_peer_requests_refused_total{node="a",reason="%s"}'
#: kube-state-metrics: a Pod in namespace "team" on node "a" whose init container fetches.
INIT = 'kube_pod_init_container_status_running{namespace="team",pod="llm-0",container="%s"}'
POD_ON_A = 'kube_pod_info{namespace="team",pod="llm-0",node="a",uid="u0"}'


def _fetching_on_a(container: str = "fetch-weights") -> dict[str, str]:
    return {INIT % container: "1x20", POD_ON_A: "1x20"}


def _cases(daemonset: Any) -> list[dict[str, Any]]:
    gpu_nodes = _alert(daemonset, "WeightcacheGPUNodesWithoutDaemon")
    down = _alert(daemonset, "WeightcacheDaemonDown")
    fetching = _alert(daemonset, "WeightcacheDaemonDownWhilePodsFetch")
    revision = _alert(daemonset, "WeightcacheRevisionNotReady")
    token = _alert(daemonset, "WeightcachePeerTokenMismatch")
    three_gpu_nodes = dict(_gpu(n, 8) for n in "abc")
    return [
        _case("3 GPU nodes, ready daemons on a and b: fires for c",
              {**three_gpu_nodes, **_daemon("a"), **_daemon("b")},
              gpu_nodes["alert"], "20m", [_firing(gpu_nodes, 8, {"node": "c"})]),
        _case("no DaemonSet at all (nothing selected the nodes): fires for each node",
              three_gpu_nodes, gpu_nodes["alert"], "20m",
              [_firing(gpu_nodes, 8, {"node": n}) for n in "abc"]),
        _case("a daemon on a node without GPUs does not hide c's missing one: fires for c",
              {**three_gpu_nodes, **dict([_gpu("cpu", 0)]), **_daemon("a"), **_daemon("b"),
               **_daemon("cpu")},
              gpu_nodes["alert"], "20m", [_firing(gpu_nodes, 8, {"node": "c"})]),
        _case("a daemon Pod on c that is not ready: fires for c",
              {**three_gpu_nodes, **_daemon("a"), **_daemon("b"), **_daemon("c", ready=False)},
              gpu_nodes["alert"], "20m", [_firing(gpu_nodes, 8, {"node": "c"})]),
        _case("every GPU node has a ready daemon: silent",
              {**three_gpu_nodes, **_daemon("a"), **_daemon("b"), **_daemon("c")},
              gpu_nodes["alert"], "20m", []),
        _case("a node without GPUs needs no daemon: silent",
              {**dict([_gpu("a", 8), _gpu("b", 8), _gpu("cpu", 0)]), **_daemon("a"),
               **_daemon("b")},
              gpu_nodes["alert"], "20m", []),
        _case("a daemon not answering scrapes: fires", {UP: "0x20"}, down["alert"], "12m",
              [_firing(down, 0, {"job": "weightcache/weightcache", "node": "a",
                                 "pod": "weightcache-x7k2p", "namespace": "weightcache"})]),
        _case("a daemon answering: silent", {UP: "1x20"}, down["alert"], "12m", []),
        _case("another exporter down is not ours: silent",
              {'up{job="gpu-operator/nvidia-dcgm-exporter",node="a"}': "0x20"},
              down["alert"], "12m", []),
        _case("a daemon down while a Pod fetches on its node: fires",
              {UP: "0x20", **_fetching_on_a()}, fetching["alert"], "8m",
              [_firing(fetching, 1, {"node": "a"})]),
        _case("a GPU node with no daemon at all while a Pod fetches there: fires",
              {**dict([_gpu("a", 8)]), **_fetching_on_a()}, fetching["alert"], "8m",
              [_firing(fetching, 1, {"node": "a"})]),
        _case("a daemon answering while Pods fetch: silent", {UP: "1x20", **_fetching_on_a()},
              fetching["alert"], "8m", []),
        _case("a daemon down with no Pod fetching: silent (WeightcacheDaemonDown says it)",
              {UP: "0x20", POD_ON_A: "1x20"}, fetching["alert"], "8m", []),
        _case("another init container on that node: silent",
              {UP: "0x20", **_fetching_on_a("istio-init")}, fetching["alert"], "8m", []),
        _case("a Pod fetching on a node without GPUs and daemon: silent",
              {**dict([_gpu("a", 0)]), **_fetching_on_a()}, fetching["alert"], "8m", []),
        _case("a pinned revision not ready for over an hour: fires", {REVISION: "0x70"},
              revision["alert"], "65m",
              [_firing(revision, 0, {"node": "a", "name": "m", "revision": "r1",
                                     "pinned": "true"})]),
        _case("an unpinned revision not ready for over an hour: silent", {UNPINNED: "0x70"},
              revision["alert"], "65m", []),
        _case("a revision ready after a 30-minute prefetch: silent", {REVISION: "0x30 1x40"},
              revision["alert"], "65m", []),
        _case("bad_token refusals keep rising: fires", {REFUSED % "bad_token": "0+6x40"},
              token["alert"], "25m", [_firing(token, 0.1, {"node": "a"})]),
        _case("one burst during a token rotation: silent", {REFUSED % "bad_token": "0 0 30x40"},
              token["alert"], "25m", []),
        _case("other refusals (a peer lacks a blob) rising: silent",
              {REFUSED % "not_found": "0+6x40"}, token["alert"], "25m", []),
    ]  # fmt: skip


def _write(daemonset: Any, directory: Path, cases: list[dict[str, Any]]) -> str:
    (directory / "fleet.rules.yaml").write_text(yaml.safe_dump({"groups": [_group(daemonset)]}))
    suite = {"rule_files": ["fleet.rules.yaml"], "evaluation_interval": "1m", "tests": cases}
    (directory / "fleet.test.yaml").write_text(yaml.safe_dump(suite, sort_keys=False))
    return "fleet.test.yaml"


def test_every_fleet_alert_is_there(daemonset: Any) -> None:
    names = [r["alert"] for r in _group(daemonset)["rules"]]
    assert names == list(ALERTS)


def test_fleet_alerts_fire_on_their_failure_only(
    daemonset: Any, promtool: str, tmp_path: Path
) -> None:
    proc = promtool_test(promtool, tmp_path, _write(daemonset, tmp_path, _cases(daemonset)))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("alert", ALERTS)
def test_fleet_alert_tests_can_fail(
    daemonset: Any, promtool: str, tmp_path: Path, alert: str
) -> None:
    """Negative control: each alert's firing case, expected silent, must fail."""
    cases = [c for c in _cases(daemonset) if c["alert_rule_test"][0]["alertname"] == alert]
    firing = [c for c in cases if c["alert_rule_test"][0]["exp_alerts"]]
    assert firing, f"no firing case for {alert}"
    firing[0]["alert_rule_test"][0]["exp_alerts"] = []
    proc = promtool_test(promtool, tmp_path, _write(daemonset, tmp_path, firing[:1]))
    assert proc.returncode != 0, f"{alert}: promtool passed a firing case expected silent"
