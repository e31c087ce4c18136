"""Sharded probe runs: `dualread probe ... --url A --url B` against two live services."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from app.cli import app
from clients.probes.runner import same_deployment
from tests.helpers import assert_reports_close, live_servers, probe_items, random_heads


@pytest.fixture(scope="module")
def two_services(actor_dirs, actors, tmp_path_factory):
    """Two `dualread serve` processes of one deployment (same tiny actor, same heads)."""
    heads = random_heads(tmp_path_factory.mktemp("shard-heads"), actors["qwen3_vl"])
    with live_servers(actor_dirs["qwen3_vl"], heads, n=2, max_new_tokens=8) as urls:
        yield urls


def _answers_served(url: str) -> float:
    """/answer requests the service itself counted (its Prometheus counter)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dualread_requests_total" and s.labels.get("route") == "/answer")


def _probe(urls: list[str], data: str, out: Path) -> str:
    args = ["probe", "ccg", "--data", data, "--out", str(out), "--concurrency", "2",
            "--bootstrap", "50", "--no-progress"]
    for u in urls:
        args += ["--url", u]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_two_endpoints_split_the_items_into_one_resumable_file(two_services, tmp_path):
    a, b = two_services
    data, ids = probe_items(tmp_path, 6, 1, box=[4, 4, 24, 20])
    served = [_answers_served(u) for u in (a, b)]
    shard = tmp_path / "shard"
    _probe([a, b], data, shard)

    # each service answered part of the run (its own count), every item is stored once
    assert all(_answers_served(u) > s for u, s in zip((a, b), served))
    run = json.loads((shard / "run.json").read_text())
    assert sorted(run["items_by_url"]) == sorted([a, b])
    # the command that reran it, with the options that differ from the defaults
    assert run["command"] == (f"dualread probe ccg --url {a} --url {b} --data {data} "
                              f"--out {shard} --concurrency 2 --bootstrap 50")
    assert all(n >= 2 for n in run["items_by_url"].values())     # 2 in flight each at start
    assert sum(run["items_by_url"].values()) == len(ids) == run["items_run"]
    stored = [json.loads(x)["id"] for x in (shard / "ccg.jsonl").read_text().splitlines()]
    assert sorted(stored) == sorted(ids)

    # the same report as one endpoint alone
    single = tmp_path / "single"
    _probe([a], data, single)
    assert_reports_close(json.loads((shard / "report.json").read_text()),
           json.loads((single / "report.json").read_text()))

    # resumable, with either endpoint set: the results are keyed by the deployment
    assert f"0 items run, {len(ids)} resumed" in _probe([b, a], data, shard)
    assert f"0 items run, {len(ids)} resumed" in _probe([b], data, shard)


def test_endpoints_of_different_deployments_are_refused():
    one = {"actor": "a1", "heads": "h1"}
    assert same_deployment([one, dict(one)], ["u1", "u2"]) == one
    with pytest.raises(ValueError, match="different actors or heads"):
        same_deployment([one, {"actor": "a1", "heads": "h2"}], ["u1", "u2"])
    # an endpoint without /v1/models: results keyed by every address, in a fixed order
    assert same_deployment([one, {"url": "u2"}], ["u2", "u1"]) == {"url": ["u1", "u2"]}
