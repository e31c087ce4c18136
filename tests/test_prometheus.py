"""The operator's kit in docker/: alert rules and a live /metrics, checked with Prometheus's own
tools (Debian package `prometheus`: promtool and the server), plus a real Prometheus scraping a
real uvicorn process."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import random_image
from tests.helpers import b64, png_bytes, random_heads
from tests.test_server import Server, free_port

PROM = Path(__file__).resolve().parents[1] / "docker" / "prometheus"
RULES = PROM / "rules.yml"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
WHY = ("not installed: Debian package `prometheus` (`make test` installs it when run as root; "
       "otherwise `apt-get install prometheus`)")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool {WHY}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus {WHY}")

ANSWERS_OK = 2   # what the live fixture sends; nothing else in this module posts /answer
ANSWERS_BAD = 1


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def alert_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"] for g in groups for r in g["rules"] if "alert" in r}


@pytest.fixture(scope="module")
def live(actor_dirs, actors, tmp_path_factory):
    """A real server with tiny random actor and heads that has answered a few requests."""
    heads = random_heads(tmp_path_factory.mktemp("prom-heads"), actors["qwen3_vl"])
    s = Server(actor_dirs["qwen3_vl"], heads, max_new_tokens=8)
    try:
        q = "what color is the shape?"
        ids = []
        for seed in range(ANSWERS_OK):
            r = httpx.post(s.url + "/answer", timeout=60,
                           json={"image": b64(png_bytes(random_image(seed))), "question": q})
            assert r.status_code == 200, r.text
            ids.append(r.json()["request_id"])
        for _ in range(ANSWERS_BAD):   # not an image: 422
            r = httpx.post(s.url + "/answer", json={"image": b64(b"nope"), "question": q},
                           timeout=60)
            assert r.status_code == 422, r.text
        # feedback fills the rolling-ECE gauge the calibration alert reads
        r = httpx.post(s.url + "/feedback", json={"request_id": ids[0], "correct": True},
                       timeout=30)
        assert r.json()["accepted"] is True
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def scrape(live) -> str:
    r = httpx.get(live.url + "/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


@needs_promtool
def test_rules_are_valid():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(alert_names())} rules found" in out.stdout


@needs_promtool
def test_prometheus_config_is_valid():
    # also resolves rule_files relative to the config, as the compose mount does
    out = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_alert_unit_tests_pass():
    out = promtool("test", "rules", str(PROM / "rules.test.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load((PROM / "rules.test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert fires == alert_names()
    assert quiet == alert_names()


@needs_promtool
def test_live_metrics_pass_promtool(scrape):
    out = promtool("check", "metrics", stdin=scrape)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "" and out.stderr.strip() == "", out.stdout + out.stderr


def test_rules_only_use_metrics_the_service_exports(scrape):
    """A renamed metric in app/metrics.py would silently disable an alert: catch it here."""
    used = set(re.findall(r"\bdualread_[a-z_]+\b", RULES.read_text()))
    # declared families count too: the drift gauges have no sample until their window fills
    families = list(text_string_to_metric_families(scrape))
    exported = {s.name for f in families for s in f.samples} | {f.name for f in families}
    assert used, "no dualread_ metric in the rules"
    assert used <= exported, sorted(used - exported)


def query(base: str, promql: str) -> list[dict]:
    r = httpx.get(base + "/api/v1/query", params={"query": promql}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


@needs_prometheus
def test_prometheus_server_scrapes_live_service(live, tmp_path):
    host, port = live.url.removeprefix("http://").split(":")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "dualread",
                            "static_configs": [{"targets": [f"{host}:{port}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = free_port()
    base = f"http://127.0.0.1:{web}"
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ok = 'dualread_requests_total{route="/answer",status="200"}'
        result: list[dict] = []
        deadline = time.time() + 90   # bounded poll: the first scrape comes within seconds
        while time.time() < deadline and not result:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {proc.stderr.read()[-2000:]}")
            try:
                result = query(base, ok)
            except httpx.HTTPError:
                pass
            if not result:
                time.sleep(0.5)
        assert result, "prometheus never returned the service's series"
        assert result[0]["metric"]["job"] == "dualread"
        assert result[0]["metric"]["instance"] == f"{host}:{port}"
        assert float(result[0]["value"][1]) == ANSWERS_OK
        bad = query(base, 'dualread_requests_total{route="/answer",status="422"}')
        assert float(bad[0]["value"][1]) == ANSWERS_BAD
        assert float(query(base, 'up{job="dualread"}')[0]["value"][1]) == 1
        info = query(base, "dualread_model_info")
        assert info[0]["metric"]["family"] == "qwen3_vl"
        # the server loaded the same alert rules the unit tests cover
        groups = httpx.get(base + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert {r["name"] for g in groups for r in g["rules"]} == alert_names()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
