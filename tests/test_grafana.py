"""The Grafana dashboard in docker/: every panel's PromQL names only metrics the service
exports (plus `dualread_drift`), the expressions parse (promtool), and docker/compose.yml
provisions the dashboard and its Prometheus data source."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from app.metrics import DEFER_REASONS, Metrics, MetricsHooks
from app.serving import AnswerResult, Confidences, StageTimes
from clients.schemas import DeferCode
from heads.monitor import FeedbackMonitor

DOCKER = Path(__file__).resolve().parents[1] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "dualread.json"
COMPOSE = DOCKER / "compose.yml"
# exported by another part of the service once it lands; the dashboard already shows it
PLANNED = {"dualread_drift"}
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
            "histogram": ("_bucket", "_count", "_sum", "_created")}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset"}


def result(defer: bool, codes: tuple[str, ...] = ()) -> AnswerResult:
    return AnswerResult("red", "red", "<answer>red</answer>", Confidences(0.4, 0.5, 0.6, 0.7),
                        defer, None, StageTimes(0.1, 0.01, 0.001), defer_codes=codes)


def exported() -> set[str]:
    """Every sample name the service's registry can export, feedback statistics included."""
    monitor = FeedbackMonitor(50)
    metrics = Metrics(monitor)
    hooks = MetricsHooks(metrics, monitor)
    for i in range(20):              # both outcomes, so every window statistic is defined
        hooks.answered(str(i), result(i % 3 == 0), 0.01)
        hooks.feedback(str(i), i % 2 == 0)
    names = set()
    for fam in metrics.registry.collect():
        names |= {fam.name + s for s in SUFFIXES[fam.type]}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label
    matchers, range windows, grouping label lists, functions and keywords are gone."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}|\[[^]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    idents = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*(?!\s*\()(?![A-Za-z0-9_:])", e)
    return {i for i in idents if i not in KEYWORDS}


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_metric_names_reads_only_metrics():
    assert metric_names('histogram_quantile(0.9, sum by (le, stage) (rate('
                        'x_bucket{instance=~"$i", a="b(c)"}[5m]))) / on (job) y > 0.5') \
        == {"x_bucket", "y"}


def test_panels_read_only_exported_metrics():
    known = exported() | PLANNED
    for p in panels():
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = metric_names(t["expr"])
            assert names, t["expr"]
            assert names <= known, (p["title"], names - known)


def test_dashboard_covers_what_an_operator_watches():
    used = set().union(*map(metric_names, exprs()))
    for name in ("dualread_confidence_count",                # answers/s
                 "dualread_request_duration_seconds_bucket",  # latency quantiles
                 "dualread_defer_reasons_total",              # defer rate by reason
                 "dualread_drift", "dualread_feedback_ece",
                 "dualread_feedback_selective_risk", "dualread_queue_depth"):
        assert name in used, name
    assert any(e.startswith("histogram_quantile(0.99,") for e in exprs())
    assert any("sum by (reason)" in e for e in exprs())
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    ds = {json.dumps(p["datasource"], sort_keys=True) for p in panels()}
    assert ds == {json.dumps({"type": "prometheus", "uid": "prometheus"}, sort_keys=True)}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed "
                    "(Debian package `prometheus`)")
def test_panel_queries_parse(tmp_path):
    """Each query as a recording rule: `promtool check rules` parses its PromQL."""
    rules = [{"record": f"dashboard:panel_{i}", "expr": e.replace("$instance", ".*")}
             for i, e in enumerate(exprs())]
    f = tmp_path / "panels.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout


def test_compose_provisions_the_dashboard():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    grafana = services["grafana"]
    mounts = {}
    for v in grafana["volumes"]:
        src, dst, *_ = v.split(":")
        mounts[dst] = src
    # the provisioning folder, read by Grafana at start
    prov = (COMPOSE.parent / mounts["/etc/grafana/provisioning"]).resolve()
    [provider] = yaml.safe_load((prov / "dashboards" / "dualread.yml").read_text())["providers"]
    path = provider["options"]["path"]
    assert provider["type"] == "file"
    host = (COMPOSE.parent / mounts[path]).resolve()
    assert (host / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    # the data source the panels name, pointing at the compose file's Prometheus
    [source] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["uid"] == "prometheus" and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in services and "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    assert "prometheus" in grafana["depends_on"]


# ------------------------------------------------------------------ defer by reason
def test_defer_reasons_counter():
    """One series per defer code from the start; each deferred answer counts under each of
    its codes; `dualread_defer_total` still counts answers."""
    metrics = Metrics()
    hooks = MetricsHooks(metrics, FeedbackMonitor(50))

    def count(reason: str) -> float:
        return metrics.registry.get_sample_value("dualread_defer_reasons_total",
                                                 {"reason": reason})

    assert set(DEFER_REASONS) == {c.value for c in DeferCode}
    assert all(count(r) == 0 for r in DEFER_REASONS)
    hooks.answered("a", result(True, (DeferCode.low_confidence.value,)), 0.0)
    hooks.answered("b", result(True, (DeferCode.truncated.value,
                                      DeferCode.novel_states.value)), 0.0)
    hooks.answered("c", result(False), 0.0)
    got = {r: count(r) for r in DEFER_REASONS if count(r)}
    assert got == {"low_confidence": 1, "truncated": 1, "novel_states": 1}
    assert metrics.registry.get_sample_value("dualread_defer_total") == 2
