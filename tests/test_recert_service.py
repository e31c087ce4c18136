"""Re-certification through the service: streams of answers over /answer, operator
verdicts over /feedback, the switch in /calibration and /answer, the drift gauges on
/metrics; the guards (operator key, once per id, restart) on a real `dualread serve`."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.service import Service
from app.settings import Settings
from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.features import extract_many
from heads.novelty import Novelty, features
from models.shift import corrupt
from tests.conftest import random_image
from tests.helpers import LiveServer, b64, png_bytes, random_heads, stub_answers

Q = "what color is the shape?"
TRAJ = "<think>I see a red circle.</think><answer>red</answer><confidence>9</confidence>"
OP = {"X-Operator-Key": "op-secret"}
WINDOW = 100          # verdicts per window in these tests (the default is 300)


def benign(k: int) -> Image.Image:
    """Another colour balance (a scanner-like transform): the novelty detector flags it."""
    a = np.asarray(random_image(5000 + k), float)
    return Image.fromarray(np.clip(a * [1.0, 0.55, 0.35] + [40, 0, 0], 0, 255).astype(np.uint8))


def harmful(k: int) -> Image.Image:
    """Severity-5 brightness: the novelty detector below flags it too (the tiny actor's
    image-token states move little under blur)."""
    return corrupt(random_image(9000 + k), "brightness", 5)


def _states(actor, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """The heads' features of the readouts `_service` serves for `images`."""
    readouts = []
    for s in range(0, len(images), 16):
        chunk = images[s: s + 16]
        readouts += [r.readout for r in actor.score(chunk, [Q] * len(chunk),
                                                    [TRAJ] * len(chunk), cue=False)]
    return extract_many(readouts)


@pytest.fixture(scope="module")
def heads_dir(actors, tmp_path_factory) -> str:
    """Random readers with a policy at r = 0.3 and a kNN novelty detector on the mean
    image-token state, fitted on clean (noise) images: both streams below are new to it."""
    root = tmp_path_factory.mktemp("recert-heads")
    actor = actors["qwen3_vl"]
    heads = Heads.load(random_heads(root / "plain", actor))
    heads.policy = DeferPolicy(0.45, 0.3, 0.1, 0.7, 0.2, 0.28, 500, True)
    fit = features("img_mean", _states(actor, [random_image(1000 + k) for k in range(150)]))
    cal = features("img_mean", _states(actor, [random_image(2000 + k) for k in range(199)]))
    heads.novelty = Novelty("knn", "img_mean").fit(fit).calibrate(cal)
    heads.save(root / "h", heads.card)
    return str(root / "h")


def _service(actor_dir: str, heads_dir: str, monkeypatch) -> Service:
    service = Service(actor_dir, heads_dir)
    # a well-formed, finished response: the parse check is not what defers it
    stub_answers(monkeypatch, service, TRAJ)
    monkeypatch.setattr(service, "needs_tag", True)
    return service


def _settings(heads_dir: str, state) -> Settings:
    return Settings(max_new_tokens=8, batch_wait_ms=20, heads=heads_dir,
                    operator_key="op-secret", recert_window=WINDOW,
                    recert_max_window=3 * WINDOW, recert_min_per_class=3,
                    recert_state=str(state), drift_window=60)


def _answers(c: TestClient, images: list[Image.Image]) -> list[dict]:
    """Answers of many images, eight requests at a time (they share model batches)."""
    def one(im):
        r = c.post("/answer", json={"image": b64(png_bytes(im)), "question": Q})
        assert r.status_code == 200, r.text
        return r.json()
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, images))


def _verdicts(c: TestClient, bodies: list[dict], correct, headers=OP) -> list[dict]:
    out = []
    for k, b in enumerate(bodies):
        r = c.post("/feedback", json={"request_id": b["request_id"], "correct": correct(k)},
                   headers=headers)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def _files(folder: str) -> dict[str, bytes]:
    return {e.name: open(e.path, "rb").read() for e in os.scandir(folder)}


def _gauges(c: TestClient) -> dict:
    return {(s.name, s.labels.get("score")): s.value
            for f in text_string_to_metric_families(c.get("/metrics").text)
            for s in f.samples}


def test_streams_through_the_service(actor_dirs, heads_dir, tmp_path, monkeypatch):
    state = tmp_path / "rules.json"
    shipped_files = _files(heads_dir)
    svc = _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)
    with TestClient(create_app(_settings(heads_dir, state), svc)) as c:
        # ---- harmful stream (severity-5 brightness), mostly wrong: the certificate refuses
        bodies = _answers(c, [harmful(k) for k in range(WINDOW)])
        assert np.mean([b["defer"] for b in bodies]) >= 0.9
        assert {b["defer_rule_version"] for b in bodies} == {"shipped"}
        g = _gauges(c)
        # the alert's condition (docker/prometheus/rules.yml, DualreadInputDrift)
        assert g[("dualread_drift", "novelty")] > 0.25
        assert g[("dualread_drift_window", None)] >= 50
        assert g[("dualread_drift_flagged_share", None)] >= 0.9
        # an unauthenticated client's verdicts (no operator key) never count
        assert not any(v["counted"] for v in _verdicts(c, bodies[:30], lambda k: True,
                                                        headers={}))
        assert c.get("/calibration", headers=OP).json()["window"]["counted"] == 0
        # a wrong operator key is refused outright
        r = c.post("/feedback", json={"request_id": bodies[30]["request_id"],
                                      "correct": True}, headers={"X-Operator-Key": "guess"})
        assert r.status_code == 401
        _verdicts(c, bodies, lambda k: k % 10 < 4)          # 40% right
        cal = c.get("/calibration", headers=OP).json()
        assert cal["last_attempt"]["event"] == "refused"
        assert cal["last_attempt"]["window"]["n"] == WINDOW
        assert "Clopper-Pearson" in cal["last_attempt"]["certificate"]["reason"]
        # the refused window is kept for the next test (it reads the last 3 × WINDOW)
        assert cal["active"]["version"] == "shipped" and cal["window"]["counted"] == WINDOW
        after = _answers(c, [harmful(WINDOW + k) for k in range(8)])
        assert all(b["defer"] and b["defer_rule_version"] == "shipped" for b in after)
        # a new stream comes: the operator starts its window afresh (operator only)
        assert c.post("/calibration/window/reset").status_code == 403
        r = c.post("/calibration/window/reset", headers=OP)
        assert r.status_code == 200 and r.json()["dropped"] == WINDOW
        assert r.json()["window"]["counted"] == 0 and r.json()["active"] == "shipped"
        # the dropped window spent a test's share of δ; later tests share theirs by 3
        spending = c.get("/calibration").json()["alpha_spending"]
        assert spending["tests"] == 2 and spending["carried_union"] == 3
        assert c.get("/calibration", headers=OP).json()["window"]["counted"] == 0

        # ---- benign stream (another colour balance), right 9 times in 10
        bodies = _answers(c, [benign(k) for k in range(60)])
        shipped_released = 1 - np.mean([b["defer"] for b in bodies])
        assert shipped_released <= 0.1
        assert np.mean([b["novelty"]["novel"] for b in bodies]) >= 0.9
        assert all(v["counted"] for v in _verdicts(c, bodies, lambda k: k % 10 != 0))
        assert c.get("/calibration", headers=OP).json()["window"]["counted"] == 60

    # ---- restart mid-window: a new process state from disk; no counted verdict lost
    svc = _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)
    with TestClient(create_app(_settings(heads_dir, state), svc)) as c:
        cal = c.get("/calibration", headers=OP).json()
        assert cal["window"]["counted"] == 60 and cal["window"]["wrong"] == 6
        bodies = _answers(c, [benign(60 + k) for k in range(WINDOW - 60)])
        _verdicts(c, bodies, lambda k: k % 10 != 0)
        cal = c.get("/calibration").json()
        assert cal["last_attempt"]["event"] == "switch", cal["last_attempt"]
        new = cal["active"]["version"]
        assert new != "shipped" and cal["chain"] == ["shipped", new]
        cert = cal["active"]["certificate"]
        assert cert["holds"] and cert["risk_upper_bound"] <= 0.3
        assert cert["detector_references"]["novelty"].startswith("extended")
        [switch] = [e for e in cal["history"] if e["event"] == "switch"]
        assert switch["who"] == "operator" and switch["at"]     # the key itself never shows
        assert switch["old"]["version"] == "shipped" and switch["new"]["version"] == new
        assert switch["window"]["n"] == WINDOW
        # the next answers of the stream: decided by the new rule, and released
        nxt = _answers(c, [benign(200 + k) for k in range(40)])
        assert {b["defer_rule_version"] for b in nxt} == {new}
        assert {b["defer_threshold"] for b in nxt} == {cal["active"]["policy"]["tau"]}
        assert 1 - np.mean([b["defer"] for b in nxt]) >= 0.8
        # drift is now measured against the window the rule was certified on
        g = _gauges(c)
        assert g[("dualread_drift", "novelty")] < 0.25
        assert g[("dualread_defer_rule_info", None)] == 1.0
        # rollback: the shipped rule again, pinned; /answer says so
        r = c.post("/calibration/rollback", headers=OP)
        assert r.status_code == 200 and r.json()["active"]["version"] == "shipped"
        assert _answers(c, [benign(300)])[0]["defer_rule_version"] == "shipped"
        assert c.post("/calibration/rollback").status_code == 403      # operator only
        r = c.post("/calibration/pin", json={"version": new}, headers=OP)
        assert r.status_code == 200 and r.json()["active"]["version"] == new
        assert c.post("/calibration/pin", json={"version": "nope"},
                      headers=OP).status_code == 404
    # the heads' own files were never written
    assert _files(heads_dir) == shipped_files
    audit = json.loads(state.read_text())["events"]
    assert [e["event"] for e in audit] == ["refused", "window_reset", "switch", "rollback",
                                           "pin"]


# ------------------------------------------------------------------ a real server
def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=60)


def test_real_server_keeps_counted_verdicts_and_counts_once(actor_dirs, heads_dir, tmp_path,
                                                            monkeypatch):
    state = tmp_path / "rules.json"
    monkeypatch.setenv("DUALREAD_OPERATOR_KEY", "op-secret")
    monkeypatch.setenv("DUALREAD_RECERT_STATE", str(state))
    monkeypatch.setenv("DUALREAD_RECERT_WINDOW", "50")
    server = LiveServer(actor_dirs["qwen3_vl"], heads_dir, max_new_tokens=4).wait_ready()
    try:
        ids = [_post(server.url, "/answer", {"image": b64(png_bytes(random_image(k))),
                                             "question": Q}).json()["request_id"]
               for k in range(4)]
        for rid in ids[:3]:
            assert _post(server.url, "/feedback", {"request_id": rid, "correct": True},
                         OP).json()["accepted"]
        # sixteen concurrent verdicts on one id: one counts
        start = threading.Barrier(16)

        def send():
            start.wait()
            return _post(server.url, "/feedback", {"request_id": ids[3], "correct": False},
                         OP).json()["accepted"]

        with ThreadPoolExecutor(16) as pool:
            accepted = list(pool.map(lambda _: send(), range(16)))
        assert sum(accepted) == 1
        assert httpx.get(server.url + "/calibration", headers=OP).json()["window"]["counted"] == 4
    finally:
        server.close()
    server = LiveServer(actor_dirs["qwen3_vl"], heads_dir, max_new_tokens=4).wait_ready()
    try:
        window = httpx.get(server.url + "/calibration", headers=OP).json()["window"]
        assert window["counted"] == 4 and window["wrong"] == 1
        # an id counted before the restart cannot count again
        assert not _post(server.url, "/feedback", {"request_id": ids[0], "correct": True},
                         OP).json()["accepted"]
    finally:
        server.close()


def test_without_an_operator_key_nothing_counts(actor_dirs, heads_dir, tmp_path,
                                               monkeypatch):
    svc = _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)
    settings = Settings(max_new_tokens=8, batch_wait_ms=5, heads=heads_dir,
                        recert_window=20, recert_state=str(tmp_path / "rules.json"))
    with TestClient(create_app(settings, svc)) as c:
        bodies = _answers(c, [benign(k) for k in range(20)])
        for b in bodies:        # the monitor takes them; none counts toward a certificate
            got = c.post("/feedback", json={"request_id": b["request_id"], "correct": True},
                         headers=OP).json()
            assert got["accepted"] and got["counted"] is False     # and the sender learns it
        cal = c.get("/calibration").json()
        assert cal["counting"] is False and "no operator key" in cal["reason"]
        assert cal["active"]["version"] == "shipped" and "last_attempt" not in cal
        for path in ("/calibration/pin", "/calibration/rollback", "/calibration/unpin"):
            assert c.post(path, json={}, headers=OP).status_code == 404
    assert not (tmp_path / "rules.json").exists()


def test_a_second_process_on_one_state_file_counts_nothing(actor_dirs, heads_dir, tmp_path,
                                                           monkeypatch):
    """Two replicas on one state file would overwrite each other's windows: the second
    one to start counts nothing and says why."""
    state = tmp_path / "rules.json"
    first = TestClient(create_app(_settings(heads_dir, state),
                                  _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)))
    second = TestClient(create_app(_settings(heads_dir, state),
                                   _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)))
    with first as a, second as b:
        assert a.get("/calibration").json()["counting"] is True
        cal = b.get("/calibration").json()
        assert cal["counting"] is False and "held by another process" in cal["reason"]
        # an operator's verdict there is taken by the monitor; it says why it did not count
        [body] = _answers(b, [benign(0)])
        got = b.post("/feedback", json={"request_id": body["request_id"], "correct": True},
                     headers=OP).json()
        assert (got["accepted"], got["counted"], got["reason"]) == (True, False, "not_counting")


def test_an_unwritable_state_file_stops_recertification_not_the_service(
        actor_dirs, heads_dir, tmp_path, monkeypatch):
    """A state path this process cannot write (a read-only heads folder in a container)
    must leave /answer serving, with /calibration saying why nothing counts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    state = blocker / "rules.json"            # its parent is a file: mkdir fails
    with TestClient(create_app(_settings(heads_dir, state),
                               _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch))) as c:
        assert c.get("/health/ready").status_code == 200
        assert _answers(c, [benign(0)])[0]["answer"] is not None
        cal = c.get("/calibration").json()
        assert cal["counting"] is False and "DUALREAD_RECERT_STATE" in cal["reason"]


def test_a_client_verdict_and_an_operator_verdict_on_one_answer(actor_dirs, heads_dir,
                                                                 tmp_path, monkeypatch):
    """Which verdict counts where: the calibration monitor (/metrics' rolling figures)
    keeps the first verdict on an answer, whoever sends it; the certificate counts only an
    operator's, once. When an API client and the operator disagree, each keeps its own."""
    svc = _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)
    with TestClient(create_app(_settings(heads_dir, tmp_path / "rules.json"), svc)) as c:
        [body] = _answers(c, [benign(0)])
        rid = body["request_id"]
        client = c.post("/feedback", json={"request_id": rid, "correct": True}).json()
        assert client["accepted"] and client["window"] == 1
        op = c.post("/feedback", json={"request_id": rid, "correct": False},
                    headers=OP).json()
        assert op["accepted"] and op["reason"] is None            # counted
        cal = c.get("/calibration", headers=OP).json()["window"]
        assert (cal["counted"], cal["correct"], cal["wrong"]) == (1, 0, 1)
        assert [z for _, _, z in c.app.state.hooks.monitor.window] == [True]
        for headers in ({}, OP):                                  # once each
            again = c.post("/feedback", json={"request_id": rid, "correct": False},
                           headers=headers).json()
            assert not again["accepted"] and again["reason"] == "already_labelled"
        assert c.get("/calibration", headers=OP).json()["window"]["counted"] == 1


def test_answer_only_says_so_on_calibration(actors, actor_dirs, tmp_path):
    """Heads of another actor served answer-only: /calibration says why nothing counts
    (not "loading model"), and the operator routes answer 409, not a 503 to retry."""
    from app.service import Service as Svc

    other = random_heads(tmp_path / "other", actors["qwen2_vl"])
    svc = Svc(actor_dirs["qwen3_vl"], other, heads_mismatch="answer-only")
    settings = Settings(max_new_tokens=8, batch_wait_ms=5, heads=other,
                        operator_key="op-secret", recert_state=str(tmp_path / "rules.json"))
    with TestClient(create_app(settings, svc)) as c:
        cal = c.get("/calibration").json()
        assert cal["counting"] is False and cal["reason"].startswith("answer-only")
        assert "loading" not in cal["reason"]
        r = c.post("/calibration/rollback", headers=OP)
        assert r.status_code == 409 and "answer-only" in r.text
        # no rule decides, so /metrics claims none
        assert ("dualread_defer_rule_info", None) not in _gauges(c)
    assert not (tmp_path / "rules.json").exists()


def test_an_api_client_cannot_move_what_operators_alert_on(actor_dirs, heads_dir, tmp_path,
                                                           monkeypatch):
    """An API-key client replaying one image: the drift window takes it once (the gauge
    cannot be filled, raised or masked with one input); its verdicts feed the monitor only,
    never the certificate's window or the drift reference; the operator's verdicts on the
    same image and question under other request ids count once."""
    svc = _service(actor_dirs["qwen3_vl"], heads_dir, monkeypatch)
    settings = _settings(heads_dir, tmp_path / "rules.json").model_copy(
        update={"api_key": "client-key"})
    api = {"Authorization": "Bearer client-key"}
    with TestClient(create_app(settings, svc)) as c:
        c.headers.update(api)
        bodies = _answers(c, [benign(0)] * 30)
        drift = c.app.state.recert.drift
        assert len(drift.rows) == 1
        reference = {k: v.copy() for k, v in drift.reference.items()}
        got = _verdicts(c, bodies[:20], lambda k: False, headers=api)
        assert all(v["accepted"] and not v["counted"] for v in got)
        cal = c.get("/calibration", headers=OP).json()
        assert cal["window"]["counted"] == 0 and cal["alpha_spending"]["tests"] == 0
        assert drift.reference.keys() == reference.keys()
        assert all(np.array_equal(drift.reference[k], reference[k]) for k in reference)
        # the operator: the same input under ten request ids is one verdict
        got = _verdicts(c, bodies[20:], lambda k: True, headers={**api, **OP})
        assert [v["counted"] for v in got] == [True] + [False] * 9
        # accepted by the monitor, not counted, and the response says why
        assert all(v["accepted"] for v in got)
        assert [v["reason"] for v in got] == [None] + ["duplicate_input"] * 9
        assert c.get("/calibration", headers=OP).json()["window"]["counted"] == 1
        # the open window's tallies are the operator's: an API client sees its size only
        plain = c.get("/calibration").json()
        assert plain["window"] == {"needed": WINDOW, "max": 3 * WINDOW}
        assert plain["active"]["version"] == "shipped" and "certificate" in plain["active"]
        assert c.get("/calibration", headers={**api, "X-Operator-Key": "guess"}
                     ).status_code == 401
        # distinct inputs each count, and each enter the drift window
        more = _answers(c, [benign(1 + k) for k in range(5)])
        assert all(v["counted"] for v in _verdicts(c, more, lambda k: True,
                                                   headers={**api, **OP}))
        assert len(drift.rows) == 6
