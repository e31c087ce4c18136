"""The evidence-order head's report (docs/results.md, EMVR's order head): the actor's native
row, AURC, paired CIs, the per-trajectory JSONL and the EMVR probe's mask. Synthetic
trajectories and a fake actor: no model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from clients.maths import aurc
from clients.probes import order
from clients.probes.images import mask_region
from clients.probes.order import Trajectories
from clients.probes.stats import bootstrap
from models.items import Item


def _data(n: int = 60, seed: int = 0) -> Trajectories:
    """Column 0 the mean answer log-prob (falls with severity), column 1 a feature a head
    can lean on; both columns drive the label."""
    rng = np.random.default_rng(seed)
    lam = np.linspace(0, 1, 5)
    lp = -0.2 - lam[None] + rng.normal(0, 0.05, (n, 5))
    f2 = rng.normal(0, 1, (n, 5))
    z = ((lp + 0.7 + 0.6 * f2 + rng.normal(0, 0.3, (n, 5))) > 0).astype(float)
    return Trajectories(np.stack([lp, f2], -1), z, [f"q{i}" for i in range(n)])


def test_native_row_is_its_input_without_a_fit():
    t = _data()
    res = order.compare(t, t, folds=3, order_weight=5.0, steps=100, resamples=50,
                        with_confidences=True)
    native = res["confidences"]["mask"]["native"]
    assert np.array_equal(native, np.exp(t.x[..., 0]))
    # no fit: other labels, another feature column and other folds leave it unchanged
    other = Trajectories(np.stack([t.x[..., 0], -t.x[..., 1]], -1), 1 - t.z, t.groups)
    res2 = order.compare(other, other, folds=4, steps=100, resamples=50,
                         with_confidences=True)
    assert np.array_equal(res2["confidences"]["mask"]["native"], native)
    # the heads did fit: their confidences are not the input
    assert not np.allclose(res["confidences"]["mask"]["bce"], native)
    r = res["mask"]
    assert r["emvr_native"] == order.emvr(native)
    assert r["aurc_native"] == aurc(native.ravel(), t.z.ravel())
    assert r["brier_native"] is None and "brier_native_minus_bce" not in r


def test_aurc_hand_computed():
    # high to low: right, wrong, right, wrong → selective risk 0, 1/2, 1/3, 2/4
    c, z = np.array([0.6, 0.9, 0.7, 0.8]), np.array([0, 1, 1, 0])
    assert aurc(c, z) == pytest.approx((0 + 1 / 2 + 1 / 3 + 2 / 4) / 4)
    # the report pools every state of every trajectory
    conf = {row: c.reshape(2, 2) for row in order.ROWS}
    r = order.summarise(conf, z.reshape(2, 2).astype(float), resamples=10)
    assert r["aurc_bce"] == pytest.approx((0 + 1 / 2 + 1 / 3 + 2 / 4) / 4)
    from heads.metrics import aurc as heads_aurc
    assert heads_aurc is aurc                       # one implementation, not two


def test_difference_cis_contain_the_estimate_and_are_paired():
    t = _data(80)
    res = order.compare(t, t, folds=3, order_weight=5.0, steps=200, resamples=200)
    for test in ("mask", "blur"):
        r = res[test]
        for row in ("order", "native"):
            for m in order.METRICS:
                key = f"{m}_{row}_minus_bce"
                if key not in r:
                    continue
                assert r[key] == pytest.approx(r[f"{m}_{row}"] - r[f"{m}_bce"])
                lo, hi = r[key + "_ci"]
                assert lo <= r[key] + 1e-12 and r[key] - 1e-12 <= hi, (test, key)
    assert res["mask"]["order_minus_bce_ci"] == res["mask"]["emvr_order_minus_bce_ci"]

    # paired: the order row differs from BCE by a tiny shift on every state, while the
    # trajectories differ widely from each other. Resampling the same trajectories for
    # both rows gives a narrow CI; resampling each row on its own draw would not.
    rng = np.random.default_rng(1)
    n = 200
    z = (rng.random((n, 5)) < 0.6).astype(float)
    bce = np.clip(rng.random((n, 1)) + rng.normal(0, 0.05, (n, 5)), 0.01, 0.99)
    conf = {"bce": bce, "order": np.clip(bce + 0.01, 0, 1), "native": bce}
    r = order.summarise(conf, z, resamples=300)
    lo, hi = r["brier_order_minus_bce_ci"]
    assert lo <= r["brier_order_minus_bce"] <= hi

    def brier(c, i):
        return float(((c[i] - z[i]) ** 2).mean())
    a = bootstrap(n, lambda i: brier(conf["order"], i), 300, 42)
    b = bootstrap(n, lambda i: brier(conf["bce"], i), 300, 7)
    unpaired_width = np.hypot(a[1] - a[0], b[1] - b[0])
    assert hi - lo < 0.2 * unpaired_width
    # identical rows: every paired resample differs by exactly 0
    for m in order.METRICS:
        if f"{m}_native_minus_bce_ci" in r:
            assert list(r[f"{m}_native_minus_bce_ci"]) == [0.0, 0.0], m


def test_trajectory_jsonl_round_trips_to_the_report(tmp_path, monkeypatch):
    """The CLI's own files: its trajectories.jsonl recomputes its report.json."""
    from typer.testing import CliRunner

    import models.data
    import models.loading
    from app.cli import app

    mask, blur = _data(40, 1), _data(40, 2)
    blur.groups = mask.groups
    monkeypatch.setattr(models.loading, "load_actor",
                        lambda *a, **k: SimpleNamespace(fingerprint="fake"))
    monkeypatch.setattr(models.data, "load", lambda spec: [])
    monkeypatch.setattr(models.data, "sample", lambda items, limit: items)
    monkeypatch.setattr(order, "collect", lambda actor, items, sev: (mask, blur))
    out = tmp_path / "oh"
    r = CliRunner().invoke(app, ["fit-order-head", "--out", str(out), "--steps", "100",
                                 "--bootstrap", "60", "--folds", "3"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    recs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(recs) == 80 and {x["test"] for x in recs} == {"mask", "blur"}
    assert recs[0]["severities"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    again = order.summarise_records(recs, resamples=60)
    for test in ("mask", "blur"):
        for key, want in report[test].items():
            got = again[test][key]
            if isinstance(want, list):
                assert list(got) == pytest.approx(want), (test, key)
            else:
                assert got == pytest.approx(want, nan_ok=True), (test, key)
    assert report["mask_fill"] == "background"
    assert "native confidence" in (out / "report.md").read_text()


def test_collect_masks_as_the_emvr_probe_and_reads_native_confidence(tmp_path):
    """The head trains on the EMVR probe's mask (the background estimate, not gray), and
    its native row is exp(mean answer log-prob) of what the actor returned."""
    img = Image.new("RGB", (40, 32), (250, 240, 230))
    img.paste((200, 30, 30), (10, 8, 30, 24))
    path = tmp_path / "a.png"
    img.save(path)
    item = Item("q0", str(path), "what color is the shape?", "red", "a.png", box=(10, 8, 30, 24))
    seen = []

    class Actor:
        def answer(self, images, questions, max_new_tokens):
            seen.extend(images)
            ro = SimpleNamespace(answer_logprobs=torch.tensor([np.log(0.3)] * 2),
                                 token_entropy=torch.tensor([0.5, 0.5]),
                                 answer_index=torch.tensor([0, 1]), h_close=torch.zeros(3))
            return [SimpleNamespace(answer="red", readout=ro) for _ in images]

    sev = (0.0, 0.5, 1.0)
    mask, blur = order.collect(Actor(), [item], sev)
    full = mask_region(img, item.box, 1.0)                 # the EMVR probe's default
    assert any(np.array_equal(np.asarray(s), np.asarray(full)) for s in seen)
    gray = mask_region(img, item.box, 1.0, "gray")
    assert not any(np.array_equal(np.asarray(s), np.asarray(gray)) for s in seen)
    assert mask.x.shape == (1, 3, 5) and mask.z.tolist() == [[1.0, 1.0, 1.0]]
    assert np.allclose(order.native_confidence(mask), 0.3)


def test_small_rise_diagnostic_is_apart_from_emvr():
    """A confidence pinned near 1 that rises in the fourth decimal violates EMVR (the
    paper's strict count) but not the labelled diagnostic beside it."""
    c = np.array([[0.9990, 0.9995, 0.9992, 0.5], [0.9, 0.8, 0.95, 0.1]])
    conf = {row: c for row in order.ROWS}
    r = order.summarise(conf, np.ones_like(c), resamples=10)
    assert r["emvr_native"] == pytest.approx(2 / 6)
    assert r["emvr_above_small_rise_native"] == pytest.approx(1 / 6)
    assert "Diagnostic, not EMVR" in order.markdown(
        {"n_trajectories": 2, "folds": 2, "order_weight": 1.0, "margin": 0.0, "mask": r,
         "blur": r}, "cmd")
