"""deploy/grafana/elaswave.json: loads as a Grafana dashboard, every query parses as PromQL
far enough to name its metrics, and every metric it names is one the Core exports (read from
a live registry of the Core's metric definitions, not from a list kept by hand)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from core_service.job_metrics import JobGauges
from core_service.metrics import CoreMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/elaswave.json"
METRIC = re.compile(r"\belaswave_[a-z0-9_]+\b")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exported_series() -> set[str]:
    """Every series name the Core's registry exposes (histograms' _bucket/_sum/_count too)."""
    registry = CollectorRegistry()
    CoreMetrics(registry)
    JobGauges(registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in HISTOGRAM_SERIES)
    return names


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_metric_the_dashboard_queries_is_exported_by_the_core() -> None:
    exported = exported_series()
    used = {m for q in queries() for m in METRIC.findall(q)}
    assert used, "the dashboard queries no elaswave_* metric"
    assert used <= exported, f"not exported by the Core: {sorted(used - exported)}"
    # Histograms are queried through their buckets, never as a bare name.
    histograms = {n for n in exported if n + "_bucket" in exported}
    assert not used & histograms


def test_the_dashboard_covers_what_operators_watch() -> None:
    used = {m for q in queries() for m in METRIC.findall(q)}
    for metric in (
        "elaswave_members",  # members by state
        "elaswave_failures_detected_total",  # failures by detection path
        "elaswave_detection_gap_seconds_bucket",  # MTTR phases
        "elaswave_plan_seconds_bucket",  # plan latency
        "elaswave_plan_apply_seconds_bucket",
        "elaswave_job_step_time_seconds",
        "elaswave_job_samples_per_second",
        "elaswave_job_linear_scaling_efficiency_ratio",  # LSE
        "elaswave_core_is_leader",
    ):
        assert metric in used, metric


def test_the_json_is_a_grafana_dashboard_with_unique_panels_on_the_grid() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "elaswave" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule), Grafana's variables filled in."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `make system-deps` (Debian package prometheus)"
    grafana_variables = {"$__rate_interval": "1m", "$job": ".*"}
    rules = []
    for i, expr in enumerate(queries()):
        for name, value in grafana_variables.items():
            expr = expr.replace(name, value)
        if expr.startswith("label_values("):
            expr = expr.removeprefix("label_values(").split(",")[0]  # Grafana's own function
        rules.append({"record": f"elaswave:query_{i}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
