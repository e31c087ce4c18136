"""Re-certification over many windows: α-spending across certificate tests, and
near-duplicate inputs (one image and question under several request ids) counted once,
in the certificate's window and in the drift window."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from heads.drift import DriftWindow
from heads.recert import (
    Served,
    certify,
    distinct_inputs,
    input_key,
    spending_view,
    spent_delta,
)
from tests.conftest import random_image
from tests.test_recert import DELTA, R, _base, _store, stream, verdicts


def _keyed(rows, key_of=lambda i: f"k{i}"):
    """`rows` with an input digest each (distinct unless `key_of` says otherwise)."""
    return [(rid, replace(s, key=key_of(i)), z) for i, (rid, s, z) in enumerate(rows)]


# ------------------------------------------------------------------ α-spending
def test_spent_levels_sum_to_at_most_delta():
    levels = [spent_delta(0.1, t) for t in range(1, 10001)]
    assert levels[:3] == pytest.approx([0.05, 0.1 / 6, 0.1 / 12])
    assert sum(levels) <= 0.1 and sum(levels) == pytest.approx(0.1 * (1 - 1 / 10001))
    view = spending_view(0.1, 3)
    assert view["delta_spent"] == pytest.approx(0.1 * 3 / 4)
    assert view["next_delta"] == pytest.approx(0.1 / 20)
    with pytest.raises(ValueError):
        spent_delta(0.1, 0)


def test_each_window_is_tested_at_its_spent_level_and_the_count_persists(tmp_path):
    """The t-th test of a history runs at δ/(t(t+1)); the certificate and /calibration's
    view say so; a window refused for its label balance spends its share too; a restart keeps
    the count."""
    base = _base()
    s = _store(tmp_path, base, window=300)
    assert s.view()["alpha_spending"]["next_delta"] == pytest.approx(DELTA / 2)
    seen = []
    for k in range(2):
        rows = _keyed(stream(np.random.default_rng(40 + k), 300, base, shift=6.0,
                             tag=f"w{k}"), lambda i, k=k: f"{k}-{i}")
        for rid, served, z in rows:
            out = s.add(rid, served, z, "operator:a")
        cert = out["certificate"]
        seen.append(cert["delta"])
        assert cert["alpha_spending"]["test"] == k + 1
        assert cert["alpha_spending"]["delta_total"] == DELTA
    assert seen == pytest.approx([DELTA / 2, DELTA / 6])
    # all-correct verdicts: refused for the label balance before any test, spent all the same
    for rid, served, _ in _keyed(stream(np.random.default_rng(50), 300, base, tag="b"),
                                 lambda i: f"b-{i}"):
        out = s.add(rid, served, True, "operator:a")
    assert out["certificate"]["reason"].startswith("label balance")
    assert out["certificate"]["alpha_spending"]["test"] == 3
    view = s.view()["alpha_spending"]
    assert view["tests"] == 3 and view["next_delta"] == pytest.approx(DELTA / 20)
    state = json.loads(s.path.read_text())
    assert state["tests"] == 3 and state["alpha_spending"]["tests"] == 3
    assert _store(tmp_path, base).tests == 3                        # a restart
    if s.active.certificate is not None:     # the switched rule carries its level
        assert s.active.certificate["alpha_spending"]["test"] in (1, 2)


def test_a_borderline_stream_retried_often_switches_rarely():
    """A stream whose risk sits just above r at every threshold (about 0.11 wrong, the
    confidence uninformative), retried window after window: at a fixed δ some histories
    switch by luck, more of them the longer they try; with spending the share of histories
    that ever switch stays under δ (up to sampling)."""
    base = _base()
    fixed = spent = 0
    histories, tries = 12, 8
    for h in range(histories):
        rng = np.random.default_rng(700 + h)
        any_fixed = any_spent = False
        for t in range(1, tries + 1):
            rows = stream(rng, 300, base, accuracy_offset=3.8, informative=0.0,
                          tag=f"h{h}t{t}")
            v = verdicts(rows)
            f, _ = certify(v, base, "f", target_risk=R, delta=DELTA, min_per_class=10)
            g, _ = certify(v, base, "g", target_risk=R, delta=spent_delta(DELTA, t),
                           min_per_class=10)
            any_fixed |= f is not None
            any_spent |= g is not None
        fixed += any_fixed
        spent += any_spent
    assert fixed > spent, (fixed, spent)       # the problem exists, and spending helps
    assert spent / histories <= 2 * DELTA, (spent, fixed)


# ------------------------------------------------------------------ near-duplicates
def test_input_key_of_a_large_picture_reads_a_reduced_copy_and_still_tells_pictures_apart():
    """Past KEY_SIDE a side, the key hashes a box-reduced copy (the full bytes cost a
    quarter of a second at the pixel limit): one picture keeps one key, another picture or
    size another, and modes PIL cannot reduce are hashed whole."""
    from PIL import Image

    from heads import recert

    big = np.random.default_rng(0).integers(0, 255, (1200, 900, 3), dtype=np.uint8)
    a = Image.fromarray(big)
    calls = []
    real = Image.Image.reduce
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Image.Image, "reduce",
                  lambda self, f, *a, **k: calls.append(f) or real(self, f, *a, **k))
        key = recert.input_key(a, "q")
    assert calls == [1200 // recert.KEY_SIDE]
    assert key == recert.input_key(Image.fromarray(big.copy()), "q")
    other = big.copy()
    other[:40, :40] = 255 - other[:40, :40]                      # one corner changed
    assert key != recert.input_key(Image.fromarray(other), "q")
    assert key != recert.input_key(a.crop((0, 0, 1200, 899)), "q")
    pal = a.convert("P")                                         # cannot be reduced
    assert recert.input_key(pal, "q") == recert.input_key(pal.copy(), "q")


def test_input_key_is_the_decoded_picture_and_the_folded_question():
    im = random_image(3)
    png, bmp = io.BytesIO(), io.BytesIO()
    im.save(png, format="PNG")
    im.save(bmp, format="BMP")
    a, b = Image.open(png).convert("RGB"), Image.open(bmp).convert("RGB")
    q = "what color is the shape?"
    assert input_key(a, q) == input_key(b, "  What  color is the SHAPE? ")
    assert input_key(a, q) != input_key(a, "what shape is in the image?")
    assert input_key(a, q) != input_key(random_image(4), q)
    assert len(input_key(a, q)) == 32 and q not in input_key(a, q)


def test_one_input_under_many_ids_counts_once_in_a_window(tmp_path):
    base = _base()
    s = _store(tmp_path, base, window=300)
    rows = stream(np.random.default_rng(60), 200, base, shift=6.0, tag="d")
    same = _keyed(rows, lambda i: "one-image")
    assert s.add(*same[0][:2], same[0][2], "operator:a")["counted"]
    for rid, served, z in same[1:]:
        assert s.add(rid, served, z, "operator:a") == \
            {"counted": False, "reason": "duplicate_input"}
    assert len(s.window) == 1
    assert len(_store(tmp_path, base).keys) == 1           # a restart remembers it
    # the certificate too: 200 verdicts on one image are one verdict
    rule, cert = certify(verdicts(same), base, "r", target_risk=R, delta=DELTA,
                         min_per_class=10)
    assert rule is None and cert["n"] == 1 and cert["duplicates_dropped"] == 199
    assert [v.request_id for v in distinct_inputs(verdicts(_keyed(rows[:5])))] == \
        [r[0] for r in rows[:5]]
    # records without a digest (older state) are all kept
    assert len(distinct_inputs(verdicts(rows[:5]))) == 5


def test_drift_window_records_an_input_once():
    rng = np.random.default_rng(61)
    d = DriftWindow(50)
    d.set_reference({"s": rng.normal(size=500)})
    for _ in range(30):
        d.record({"s": rng.normal()}, False, "replayed")
    assert len(d.rows) == 1
    for k in range(60):                 # distinct inputs push the old one out
        assert d.record({"s": rng.normal()}, False, f"i{k}")
    assert len(d.rows) == 50 and "replayed" not in d.keys
    assert d.record({"s": 0.0}, True, "replayed")       # it may come back once
    assert not d.record({"s": 0.0}, True, "replayed")
    assert d.record({"s": 0.0}, True) and d.record({"s": 0.0}, True)  # no key: each one


def test_served_keeps_its_key_through_a_round_trip():
    s = Served("shipped", (1.0, 2.0, 0.0), {"novelty": 0.1}, {"novelty": 0.5}, False, "ab")
    assert Served.from_dict(s.to_dict()) == s
    old = {k: v for k, v in s.to_dict().items() if k != "key"}
    assert Served.from_dict(old).key == ""
