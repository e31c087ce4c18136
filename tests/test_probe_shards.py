"""Sharded probe runs: `dualread probe ... --url A --url B` against two live services."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from app.cli import app
from clients.probes.runner import same_deployment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_services(actor_dirs, actors, tmp_path_factory):
    """Two `dualread serve` processes of one deployment (same tiny actor, same heads)."""
    from tests.helpers import random_heads

    heads = random_heads(tmp_path_factory.mktemp("shard-heads"), actors["qwen3_vl"])
    procs, urls = [], []
    for _ in range(2):
        port = _free_port()
        log = tempfile.TemporaryFile(mode="w+")     # an unread pipe would fill and block
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--actor", actor_dirs["qwen3_vl"],
             "--heads", heads, "--port", str(port), "--max-new-tokens", "8"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=log), log))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for (proc, log), url in zip(procs, urls):
            deadline = time.time() + 180
            while time.time() < deadline:
                try:
                    if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(log.read()[-3000:])
                time.sleep(0.2)
            else:
                raise RuntimeError(f"{url} did not become ready")
        yield urls
    finally:
        for proc, log in procs:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def _dataset(folder: Path, n_images: int) -> tuple[str, list[str]]:
    """A colour question per image (answers differ, so every item has a donor)."""
    rng = np.random.default_rng(1)
    rows = []
    for i in range(n_images):
        Image.fromarray(rng.integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(
            folder / f"{i}.png")
        rows.append({"id": f"c{i}", "image": f"{i}.png", "question": "what color is the shape?",
                     "answer": ["red", "blue", "green"][i % 3], "box": [4, 4, 24, 20]})
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}", [r["id"] for r in rows]


def _answers_served(url: str) -> float:
    """/answer requests the service itself counted (its Prometheus counter)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dualread_requests_total" and s.labels.get("route") == "/answer")


def _close(a, b, path: str = "") -> None:
    """Equal reports: floats to 1e-6 (batches differ between runs), the rest exactly."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-6), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


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
    data, ids = _dataset(tmp_path, 6)
    served = [_answers_served(u) for u in (a, b)]
    shard = tmp_path / "shard"
    _probe([a, b], data, shard)

    # each service answered part of the run (its own count), every item is stored once
    assert all(_answers_served(u) > s for u, s in zip((a, b), served))
    run = json.loads((shard / "run.json").read_text())
    assert sorted(run["items_by_url"]) == sorted([a, b])
    assert all(n >= 2 for n in run["items_by_url"].values())     # 2 in flight each at start
    assert sum(run["items_by_url"].values()) == len(ids) == run["items_run"]
    stored = [json.loads(x)["id"] for x in (shard / "ccg.jsonl").read_text().splitlines()]
    assert sorted(stored) == sorted(ids)

    # the same report as one endpoint alone
    single = tmp_path / "single"
    _probe([a], data, single)
    _close(json.loads((shard / "report.json").read_text()),
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
