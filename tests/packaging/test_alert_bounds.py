"""Every alert's `for:` and thresholds, pinned by promtool cases just inside and just outside
each bound: changing one (say `for: 10m` to 9m or 11m, `> 0.98` to `>= 0.98` or `> 0.99`)
makes a case here fail.

Each alert has an onset (the evaluation at which its condition first holds, given its
input) and a series just inside every threshold. The alert must be firing at onset + `for:`
and not one evaluation earlier; with each input moved just outside one threshold it must
stay silent. Firing is read from the ALERTS series, so the cases hold whatever the
annotations say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.packaging.conftest import promtool_test

#: A pinned revision not ready on node "a"; a Pod of namespace "team" fetching there.
REVISION = 'weightcache_revision_ready{node="a",name="m",revision="r1",pinned="true"}'
UP = 'up{job="weightcache/weightcache",node="a",pod="weightcache-x7k2p"}'
GPUS = 'kube_node_status_allocatable{node="a",resource="nvidia_com_gpu",unit="integer"}'
INIT = (
    'kube_pod_init_container_status_running{namespace="team",pod="llm-0",container="fetch-weights"}'
)
POD_ON_A = 'kube_pod_info{namespace="team",pod="llm-0",node="a",uid="u0"}'
DAEMON_ON_A = (
    'kube_pod_info{namespace="weightcache",pod="weightcache-x7k2p",node="a",uid="u1",'
    'created_by_kind="DaemonSet",created_by_name="weightcache"}'
)
DAEMON_READY = (
    'kube_pod_status_ready{namespace="weightcache",pod="weightcache-x7k2p",condition="true"}'
)


def _node_a(copies: int, downloads: int, fetches: int, gets: int, alone: int) -> dict[str, str]:
    """One daemon's gauges at --max-concurrency 16, constant from t=0."""
    gauges = {
        "weightcache_copies_inflight": copies,
        "weightcache_downloads_inflight": downloads,
        "weightcache_replica_fetches_inflight": fetches,
        "weightcache_origin_get_inflight": gets,
        "weightcache_fetches_alone_inflight": alone,
        "weightcache_max_concurrency": 16,
    }
    return {f'{name}{{node="a"}}': f"{value}x100" for name, value in gauges.items()}


#: A counter rising by 0.0001 a minute from t=0: its rate is positive from the second sample
#: (onset 1m) and far below any threshold above 0.
CREEPING = "0+0.0001x100"
FLAT = "3x100"


@dataclass
class Bounds:
    """An alert, its `for:`, its input just inside every threshold with the condition's
    first evaluation (minutes), and that input moved just outside one threshold at a time."""

    alert: str
    #: Its `for:` in minutes, as operators rely on it (not read from the rule: a test
    #: that took it from there would pass whatever it becomes).
    minutes: int
    onset: int
    inside: dict[str, str]
    outside: dict[str, dict[str, str]] = field(default_factory=dict)


BOUNDS = [
    Bounds(
        "WeightcacheEveryReplicaPulling", 10, 0,
        _node_a(copies=2, downloads=1, fetches=3, gets=32, alone=1),
        {
            "no extra copy": _node_a(copies=1, downloads=1, fetches=3, gets=16, alone=1),
            "2 fetches": _node_a(copies=2, downloads=1, fetches=2, gets=32, alone=1),
        },
    ),
    Bounds(
        "WeightcacheOriginThrottled", 15, 1,
        {"weightcache_origin_throttled_total": CREEPING},
        {"no throttles": {"weightcache_origin_throttled_total": FLAT}},
    ),
    Bounds(
        "WeightcacheVerifyFailures", 0, 1,
        {'weightcache_verify_failures_total{node="a"}': CREEPING},
        {"no failures": {'weightcache_verify_failures_total{node="a"}': FLAT}},
    ),
    Bounds(
        "WeightcacheFetchErrors", 5, 1,
        {'weightcache_fetches_total{node="a",result="error"}': CREEPING},
        {"no errors": {'weightcache_fetches_total{node="a",result="error"}': FLAT}},
    ),
    Bounds(
        "WeightcacheCacheFull", 30, 0,
        {'weightcache_cache_bytes{node="a"}': "985x100",
         'weightcache_cache_capacity_bytes{node="a"}': "1000x100"},
        {"98% full": {'weightcache_cache_bytes{node="a"}': "980x100",
                      'weightcache_cache_capacity_bytes{node="a"}': "1000x100"}},
    ),
    Bounds(
        "WeightcacheDiskBelowMinFree", 15, 0,
        {'weightcache_disk_free_bytes{node="a"}': "999x100",
         'weightcache_min_free_bytes{node="a"}': "1000x100"},
        {"free at the floor": {'weightcache_disk_free_bytes{node="a"}': "1000x100",
                               'weightcache_min_free_bytes{node="a"}': "1000x100"}},
    ),
    Bounds(
        "WeightcacheGPUNodesWithoutDaemon", 15, 0,
        {GPUS: "1x100", DAEMON_ON_A: "1x100", DAEMON_READY: "0x100"},
        {
            "no GPU": {GPUS: "0x100", DAEMON_ON_A: "1x100", DAEMON_READY: "0x100"},
            "daemon ready": {GPUS: "1x100", DAEMON_ON_A: "1x100", DAEMON_READY: "1x100"},
        },
    ),
    Bounds(
        "WeightcacheDaemonDown", 10, 0,
        {UP: "0x100"},
        {"up": {UP: "1x100"}},
    ),
    Bounds(
        "WeightcacheDaemonDownWhilePodsFetch", 5, 0,
        {INIT: "1x100", POD_ON_A: "1x100", UP: "0x100"},
        {
            "no init container running": {INIT: "0x100", POD_ON_A: "1x100", UP: "0x100"},
            "daemon up": {INIT: "1x100", POD_ON_A: "1x100", UP: "1x100"},
            "no GPU, no daemon": {INIT: "1x100", POD_ON_A: "1x100", GPUS: "0x100"},
        },
    ),
    Bounds(
        "WeightcacheRevisionNotReady", 60, 0,
        {REVISION: "0x100"},
        {"ready": {REVISION: "1x100"}},
    ),
    Bounds(
        "WeightcachePeerTokenMismatch", 15, 1,
        {'weightcache_peer_requests_refused_total{node="a",reason="bad_token"}': CREEPING},
        {"no refusals": {
            'weightcache_peer_requests_refused_total{node="a",reason="bad_token"}': FLAT}},
    ),
]  # fmt: skip


def _alerts(daemonset: Any) -> dict[str, dict[str, Any]]:
    groups = daemonset.one("PrometheusRule")["spec"]["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def _case(name: str, series: dict[str, str], alert: str, minute: int, firing: bool) -> Any:
    query = f'count(ALERTS{{alertname="{alert}",alertstate="firing"}})'
    return {
        "name": name,
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "promql_expr_test": [
            {
                "expr": query,
                "eval_time": f"{minute}m",
                "exp_samples": [{"labels": "{}", "value": 1}] if firing else [],
            }
        ],
    }


def _cases() -> list[dict[str, Any]]:
    cases = []
    for b in BOUNDS:
        due = b.onset + b.minutes
        cases.append(_case(f"{b.alert}: fires at onset + for", b.inside, b.alert, due, True))
        if due > 0:
            cases.append(_case(f"{b.alert}: silent 1m before", b.inside, b.alert, due - 1, False))
        for what, series in b.outside.items():
            cases.append(_case(f"{b.alert}: silent with {what}", series, b.alert, due + 5, False))
    return cases


def _run(promtool: str, daemonset: Any, directory: Path, cases: list[Any]) -> Any:
    groups = daemonset.one("PrometheusRule")["spec"]["groups"]
    (directory / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    suite = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": cases}
    (directory / "bounds.test.yaml").write_text(yaml.safe_dump(suite, sort_keys=False))
    return promtool_test(promtool, directory, "bounds.test.yaml")


def test_every_alert_has_its_bounds(daemonset: Any) -> None:
    """A new alert, or a threshold added to one, needs its cases here."""
    alerts = _alerts(daemonset)
    assert sorted(alerts) == sorted(b.alert for b in BOUNDS)
    for b in BOUNDS:
        thresholds = re.findall(r"(?:>=|<=|==|!=|>|<)\s*[0-9.]+", alerts[b.alert]["expr"])
        assert len(b.outside) >= len(thresholds), f"{b.alert}: a case per threshold"


def test_alerts_fire_exactly_at_their_bounds(daemonset: Any, promtool: str, tmp_path: Path) -> None:
    proc = _run(promtool, daemonset, tmp_path, _cases())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bound_cases_can_fail(daemonset: Any, promtool: str, tmp_path: Path) -> None:
    """Negative control: a firing case expected silent fails."""
    case = _cases()[0]
    case["promql_expr_test"][0]["exp_samples"] = []
    assert _run(promtool, daemonset, tmp_path, [case]).returncode != 0
