"""The PrometheusRule and the dashboard: valid PromQL, real metric names, and the alert's behaviour.

promtool (Debian package `prometheus`) checks the rules and runs them against synthetic
series: scale-outs where every replica pulls its own copy, through the daemon or alone (the
alert fires), and ones where the cache works, including a cold node where 8 replicas wait
30 minutes on one 16-GET download (silent; design §6). Without promtool those tests skip;
the metric name checks below need nothing but Python.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from weightcache.daemon.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "daemonset" / "grafana-dashboard.json"
RATIO = "weightcache:get_concurrency_per_replica:ratio"
ALERT = "WeightcacheEveryReplicaPulling"

#: Metric names of design §6, as exposed (counters with _total, the histogram's series).
DESIGN_METRICS = {
    "weightcache_origin_get_inflight",
    "weightcache_replica_fetches_inflight",
    "weightcache_get_concurrency_per_replica",
    "weightcache_fetches_total",
    "weightcache_bytes_total",
    "weightcache_origin_throttled_total",
    "weightcache_verify_failures_total",
    "weightcache_evictions_total",
    "weightcache_cache_bytes",
    "weightcache_cache_capacity_bytes",
    "weightcache_disk_free_bytes",
    "weightcache_min_free_bytes",
    "weightcache_fetch_duration_seconds_bucket",
    "weightcache_fetch_duration_seconds_sum",
    "weightcache_fetch_duration_seconds_count",
    # what the daemon reads from the fetches alone, and what the rules normalise by
    "weightcache_fetches_alone_inflight",
    "weightcache_fetches_alone_origin_get_inflight",
    "weightcache_downloads_inflight",
    "weightcache_copies_inflight",
    "weightcache_max_concurrency",
    # the swarm (design §8)
    "weightcache_peer_upload_bytes_total",
    "weightcache_peer_streamed_bytes_total",
    "weightcache_pieces_inflight",
    "weightcache_peers_marked_bad_total",
}

#: Grafana's variables, replaced by what they expand to so that promtool can parse the query.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "6h",
    "$node": ".*",
}


def rule_groups(daemonset: Any) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = daemonset.one("PrometheusRule")["spec"]["groups"]
    return groups


def rules(daemonset: Any) -> list[dict[str, Any]]:
    return [r for g in rule_groups(daemonset) for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if t.get("expr")]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict) and "label_values" in query.get("query", ""):
            exprs.append(re.search(r"label_values\((\w+)", query["query"]).group(1))  # type: ignore[union-attr]
    return exprs


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    # Label names and values sit inside {...} or by/without (...) and do not start with
    # "weightcache", so every weightcache token is a metric or recording rule name.
    # "node:weightcache_..." is a per-node recording rule's name.
    unquoted = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"\b(?:node:)?weightcache[a-zA-Z0-9_:]*", unquoted))


def write_rules(daemonset: Any, directory: Path) -> Path:
    path = directory / "weightcache.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups(daemonset)}, sort_keys=False))
    return path


def run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output}"
    return output


# -- without promtool -------------------------------------------------------------------------


def test_the_required_rules_exist(daemonset: Any) -> None:
    by_record = {r["record"]: r for r in rules(daemonset) if "record" in r}
    assert RATIO in by_record
    ratio = re.sub(r"\s+", "", by_record[RATIO]["expr"])
    assert ratio == (
        "sum(weightcache_origin_get_inflight)/clamp_min(sum(weightcache_replica_fetches_inflight),1)"
    )
    alerts = {r["alert"]: r for r in rules(daemonset) if "alert" in r}
    assert ALERT in alerts and alerts[ALERT].get("for")
    for alert in alerts.values():
        assert alert.get("labels", {}).get("severity"), f"{alert['alert']} has no severity"
        assert alert.get("annotations", {}).get("summary"), f"{alert['alert']} has no summary"


def test_rules_and_dashboard_use_only_known_metrics(daemonset: Any) -> None:
    records = {r["record"] for r in rules(daemonset) if "record" in r}
    fleet = {"weightcache_revision_ready", "weightcache_peer_requests_refused_total"}
    known = DESIGN_METRICS | records | fleet
    exprs = [r["expr"] for r in rules(daemonset)] + dashboard_exprs()
    unknown = {name for e in exprs for name in metric_names(e)} - known
    assert not unknown, f"rules or dashboard refer to unknown metrics: {sorted(unknown)}"


def test_metrics_match_what_the_daemon_exports(daemonset: Any) -> None:
    """Every raw metric the rules and dashboard read is registered by weightcache.daemon.metrics."""
    exported: set[str] = set()
    for family in Metrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        exported |= {family.name + s for s in suffixes.get(family.type, [""])}
    records = {r["record"] for r in rules(daemonset) if "record" in r}
    exprs = [r["expr"] for r in rules(daemonset)] + dashboard_exprs()
    raw = {name for e in exprs for name in metric_names(e)} - records
    assert raw <= exported, f"not exported by the daemon: {sorted(raw - exported)}"


def test_dashboard_shows_what_operators_need() -> None:
    exprs = "\n".join(dashboard_exprs())
    for needed in (
        "weightcache_cache_bytes",
        "weightcache_cache_capacity_bytes",
        "weightcache_fetches_total",
        "rate(weightcache_bytes_total",
        RATIO,
        "weightcache_evictions_total",
        # what WeightcacheEveryReplicaPulling reads
        "node:weightcache_extra_copies_inflight:sum",
        "sum(weightcache_copies_inflight)",
    ):
        assert needed in exprs, f"the dashboard does not show {needed}"
    assert re.search(
        r"histogram_quantile\(0\.9\d*, .*weightcache_fetch_duration_seconds_bucket", exprs
    )
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


def test_dashboard_has_a_swarm_row() -> None:
    """The swarm row: bytes by source, uploads, pieces in flight, store share, bad peers."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [p for p in panels if p["type"] == "row" and "Swarm" in p["title"]]
    assert len(rows) == 1, "expected one dashboard row titled Swarm"
    below = [p for p in panels if p["gridPos"]["y"] > rows[0]["gridPos"]["y"]]
    assert not [p for p in below if p["type"] == "row"], "the swarm row must be the last row"
    exprs = [re.sub(r"\s+", "", t["expr"]) for p in below for t in p["targets"]]
    sel = 'node=~"$node"'
    for needed in (
        f'sum by (source) (rate(weightcache_bytes_total{{source=~"origin|peer",{sel}}}',
        f"sum by (node) (rate(weightcache_peer_upload_bytes_total{{{sel}}}",
        f"sum by (source) (weightcache_pieces_inflight{{{sel}}})",
        f"sum by (reason) (increase(weightcache_peers_marked_bad_total{{{sel}}}",
        f'sum(increase(weightcache_bytes_total{{source="origin",{sel}}}[$__range]))/clamp_min('
        f'sum(increase(weightcache_bytes_total{{source=~"origin|peer",{sel}}}[$__range])),1)',
    ):
        needed = re.sub(r"\s+", "", needed)
        assert any(e.startswith(needed) for e in exprs), f"the swarm row does not show {needed}"


def test_dashboard_panels_do_not_overlap() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['id']} is wider than the dashboard"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap"
                cells[(x, y)] = p["id"]


# -- with promtool ----------------------------------------------------------------------------


def test_promtool_checks_the_rules(daemonset: Any, promtool: str, tmp_path: Path) -> None:
    output = run([promtool, "check", "rules", str(write_rules(daemonset, tmp_path))])
    assert f"SUCCESS: {len(rules(daemonset))} rules found" in output


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    # promtool has no "check this query"; a recording rule per query gets the same parser.
    records = [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(e)}
        for i, e in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    run([promtool, "check", "rules", str(path)])


def _series(name: str, values_by_node: dict[str, str]) -> list[dict[str, str]]:
    return [
        {"series": f'{name}{{node="{node}"}}', "values": values}
        for node, values in values_by_node.items()
    ]


def _node(
    node: str, gets: str, fetches: str, downloads: str, alone: str = "0x40", copies: str = ""
) -> list[dict[str, str]]:
    """One daemon's gauges (each a promtool series of 40+ samples) at --max-concurrency 16;
    copies default to one per revision (the cache works)."""
    return [
        *_series("weightcache_origin_get_inflight", {node: gets}),
        *_series("weightcache_replica_fetches_inflight", {node: fetches}),
        *_series("weightcache_downloads_inflight", {node: downloads}),
        *_series("weightcache_copies_inflight", {node: copies or downloads}),
        *_series("weightcache_fetches_alone_inflight", {node: alone}),
        *_series("weightcache_max_concurrency", {node: "16x40"}),
    ]


def _expected_annotations(alert: dict[str, Any], value: float, node: str) -> dict[str, str]:
    """The alert's annotations as Prometheus renders them for this $value and node."""
    out = {}
    for key, text in alert["annotations"].items():
        text = text.replace("{{ $value }}", f"{value:g}")
        text = text.replace("{{ $labels.node }}", node)
        assert "{{" not in text, f"test does not know how to render {text!r}"
        out[key] = text
    return out


def _firing(alert: dict[str, Any], value: float, *nodes: str) -> list[dict[str, Any]]:
    return [
        {
            "exp_labels": {"node": node, **alert["labels"]},
            "exp_annotations": _expected_annotations(alert, value, node),
        }
        for node in nodes
    ]


def _silent(*times: str) -> list[dict[str, Any]]:
    return [{"eval_time": t, "alertname": ALERT, "exp_alerts": []} for t in times]


def _fires(at: str, alert: dict[str, Any], extra: float, *nodes: str) -> dict[str, Any]:
    return {"eval_time": at, "alertname": ALERT, "exp_alerts": _firing(alert, extra, *nodes)}


def _pulling(
    name: str, alert: dict[str, Any], gets: int, fetches: int, alone: int, copies: int
) -> dict[str, Any]:
    """Node "a" fetching one revision in `copies` copies from minute 1: fires at 12m."""
    return {
        "name": f"{name}: {copies} copies, fires",
        "interval": "1m",
        "input_series": _node("a", f"0 {gets}x39", f"0 {fetches}x39", "0 1x39",
                              alone=f"0 {alone}x39", copies=f"0 {copies}x39"),
        "alert_rule_test": [*_silent("5m"), _fires("12m", alert, copies - 1, "a")],
    }  # fmt: skip


def _unit_tests(daemonset: Any) -> dict[str, Any]:
    alert = next(r for r in rules(daemonset) if r.get("alert") == ALERT)
    return {
        "rule_files": ["weightcache.rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                # 3 new nodes, 4 replicas each of one revision, every replica running its
                # own download (say the revision lock is bypassed on each node).
                "name": "every replica pulls its own copy: 3 extra copies per node, fires",
                "interval": "1m",
                "input_series": [
                    *(
                        s
                        for n in "abc"
                        for s in _node(n, "0 64x39", "0 4x39", "0 1x39", copies="0 4x39")
                    ),
                ],
                "promql_expr_test": [
                    {
                        "expr": RATIO,
                        "eval_time": "12m",
                        "exp_samples": [{"labels": RATIO, "value": 16}],
                    },
                ],
                "alert_rule_test": [*_silent("5m"), _fires("12m", alert, 3, "a", "b", "c")],
            },
            # 8 Pods on one node fetching alone (--no-daemon, or a source the daemon
            # refuses), each at 16 GETs.
            _pulling("every replica pulling alone", alert, gets=128, fetches=8, alone=8, copies=8),
            # The SlowDown case: AIMD has halved each of the 8 fetches alone to 4 GETs, 32 in
            # all, fewer than 8 x 16 by far. Still 8 copies of one revision.
            _pulling(
                "every replica pulling alone at 4 GETs after SlowDown",
                alert,
                gets=32,
                fetches=8,
                alone=8,
                copies=8,
            ),
            # 4 fetches bypassing a daemon whose --max-concurrency is 16, averaging 7 GETs.
            _pulling(
                "fetches alone averaging 7 GETs against a daemon at 16",
                alert,
                gets=28,
                fetches=4,
                alone=4,
                copies=4,
            ),
            # 8 replicas; the daemon downloads for 6, 2 pull alone: 3 copies.
            _pulling("2 of 8 replicas pulling alone", alert, gets=48, fetches=8, alone=2, copies=3),
            {
                # A healthy cold scale-out: 8 replicas wait 30 minutes on one node while
                # its daemon downloads the one revision with 16 GETs: one copy.
                "name": "a healthy cold scale-out on one node: silent for 30 minutes",
                "interval": "1m",
                "input_series": _node("a", "0 16x30 0x9", "0 8x30 0x9", "0 1x30 0x9"),
                "promql_expr_test": [
                    {
                        "expr": RATIO,
                        "eval_time": "20m",
                        "exp_samples": [{"labels": RATIO, "value": 2}],
                    },
                    {
                        "expr": "node:weightcache_origin_pulls_per_replica:ratio",
                        "eval_time": "20m",
                        "exp_samples": [
                            {
                                "labels": "node:weightcache_origin_pulls_per_replica"
                                ':ratio{node="a"}',
                                "value": 1 / 8,
                            }
                        ],
                    },
                    {
                        "expr": "node:weightcache_extra_copies_inflight:sum",
                        "eval_time": "20m",
                        "exp_samples": [
                            {
                                "labels": 'node:weightcache_extra_copies_inflight:sum{node="a"}',
                                "value": 0,
                            },
                        ],
                    },
                ],
                "alert_rule_test": _silent("5m", "12m", "20m", "30m", "35m"),
            },
            {
                # 6 new nodes, 8 replicas each. One node downloads from the object store (16 GETs),
                # the others get the blobs from peers: the ratio falls from 16 to 1/3.
                "name": "the cache works: ratio falls during the scale-out, alert silent",
                "interval": "1m",
                "input_series": [
                    *_node("a", "16x39", "1 1 8x37", "1x39"),
                    *(s for n in "bcdef" for s in _node(n, "0x39", "0 0 8x37", "0 0 1x37")),
                ],
                "promql_expr_test": [
                    {
                        "expr": RATIO,
                        "eval_time": "1m",
                        "exp_samples": [{"labels": RATIO, "value": 16}],
                    },
                    {
                        "expr": RATIO,
                        "eval_time": "12m",
                        "exp_samples": [{"labels": RATIO, "value": 16 / 48}],
                    },
                ],
                "alert_rule_test": _silent("5m", "12m", "20m"),
            },
            {
                # Four replicas of four different revisions on one node: each needs its own
                # download, which no cache can share.
                "name": "replicas of different revisions: silent",
                "interval": "1m",
                "input_series": _node("a", "64x39", "4x39", "4x39"),
                "alert_rule_test": _silent("20m"),
            },
            {
                # Two replicas, each pulling: below the "> 2 fetches" floor, so no page.
                "name": "a couple of replicas is not a scale-out",
                "interval": "1m",
                "input_series": _node("a", "32x39", "2x39", "1x39", copies="2x39"),
                "alert_rule_test": _silent("20m"),
            },
            {
                # Idle cluster: the ratio is 0 (clamp_min), not NaN, so graphs and alerts stay sane.
                "name": "idle: ratio is zero",
                "interval": "1m",
                "input_series": _node("a", "0x5", "0x5", "0x5"),
                "promql_expr_test": [
                    {
                        "expr": RATIO,
                        "eval_time": "3m",
                        "exp_samples": [{"labels": RATIO, "value": 0}],
                    },
                ],
            },
        ],
    }


def test_promtool_unit_tests_of_the_alert(daemonset: Any, promtool: str, tmp_path: Path) -> None:
    write_rules(daemonset, tmp_path)
    tests = tmp_path / "weightcache.test.yaml"
    tests.write_text(yaml.safe_dump(_unit_tests(daemonset), sort_keys=False))
    run([promtool, "test", "rules", tests.name], cwd=tmp_path)


def test_promtool_unit_tests_can_fail(daemonset: Any, promtool: str, tmp_path: Path) -> None:
    """Negative control: expecting silence where every replica pulls alone must fail."""
    write_rules(daemonset, tmp_path)
    suite = _unit_tests(daemonset)
    suite["tests"] = suite["tests"][1:2]
    suite["tests"][0]["alert_rule_test"][1]["exp_alerts"] = []
    tests = tmp_path / "inverted.test.yaml"
    tests.write_text(yaml.safe_dump(suite, sort_keys=False))
    proc = subprocess.run(
        [promtool, "test", "rules", tests.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
