"""Drift under the shipped composite detector (a clean sample of its combined score kept at
fit time) and the threshold search of re-certification (fixed-sequence testing)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import ks_2samp

from app.recertify import DriftCollector, drift_reference
from heads.defer import (
    DEFER_ALL_TAU,
    choose_threshold_sequence,
    clopper_pearson_upper,
    sequence_grid,
)
from heads.drift import DriftWindow
from heads.novelty import CompositeNovelty, Novelty, load_detector
from heads.recert import SHIPPED, DeferRule, Served, Verdict, certify

sys.path.insert(0, str(Path(__file__).parent))
from test_recert import DELTA, R, _base, released, stream, verdicts  # noqa: E402


def _rows(n: int, seed: int, shift: float = 0.0) -> dict[str, torch.Tensor]:
    """Feature rows with both parts' features: image-token slots [n, 6, 3] (4 real tokens,
    NaN padding) and a prompt state [n, 5]; the question part depends on the image part
    (their scores are correlated, as an odd picture and an odd question can be)."""
    g = np.random.default_rng(seed)
    tok = g.normal(size=(n, 4, 3)) + shift
    slots = np.full((n, 6, 3), np.nan)
    slots[:, :4] = tok
    q = np.c_[tok.mean(1) * 2.0, g.normal(size=(n, 2))] + g.normal(size=(n, 5)) * 0.5
    return {"img_tokens": torch.from_numpy(slots), "h_pre": torch.from_numpy(q)}


def _composite(cal: dict[str, torch.Tensor]) -> CompositeNovelty:
    fit = _rows(300, 0)
    img = Novelty("token_knn", "img_token_slots").fit(fit["img_tokens"]) \
        .calibrate(cal["img_tokens"])
    q = Novelty("knn", "h_pre", k=1).fit(fit["h_pre"]).calibrate(cal["h_pre"])
    return CompositeNovelty({"image": img, "question": q})


def _heads(det) -> SimpleNamespace:
    return SimpleNamespace(novelty=det, novelty_alpha=0.02, image_check=None)


# ------------------------------------------------------------------ the clean sample
def test_clean_sample_is_distributed_as_a_clean_inputs_combined_score():
    """Leave-one-out p-values of the calibration rows: the sample matches fresh clean
    rows' combined scores (KS), where an in-sample reading would not (each row counted
    against itself sits one rank lower: p never at its smallest value)."""
    cal = _rows(400, 1)
    det = _composite(cal).keep_clean_sample(cal)
    assert len(det.clean_scores()) == 400
    fresh = np.array([r.score for r in det.read(_rows(2000, 2))])
    assert ks_2samp(det.clean_scores(), fresh).pvalue > 0.01
    # each part's LOO p of a calibration row is its rank among the others, by hand
    img = det.parts["image"]
    s = img.score(cal["img_tokens"][:5])
    others = [np.delete(img.t["calibration"].numpy(),
                        np.argmin(np.abs(img.t["calibration"].numpy() - v))) for v in s]
    loo = [(1 + (o >= v).sum()) / (len(o) + 1) for o, v in zip(others, s)]
    q = det.parts["question"]
    sq = q.score(cal["h_pre"][:5])
    loo_q = [(1 + (np.delete(q.t["calibration"].numpy(),
                             np.argmin(np.abs(q.t["calibration"].numpy() - v))) >= v).sum())
             / len(q.t["calibration"]) for v in sq]
    want = -np.log10(np.minimum(1, 2 * np.minimum(loo, loo_q)))
    assert np.allclose(det.clean_sample({k: v[:5] for k, v in cal.items()}), want)
    assert det.calibration_share(cal) == {"image": 1.0, "question": 1.0}
    assert det.calibration_share(_rows(50, 3))["image"] == 0.0


def test_drift_moves_on_a_shifted_stream_and_stays_low_on_clean():
    """Under the shipped rule with the composite detector: with its clean sample, drift
    has a reference for the combined score; the KS statistic stays low on a clean stream
    and moves on a shifted one. Without the sample there is no reference at all."""
    cal = _rows(400, 1)
    det = _composite(cal)
    shipped = DeferRule(SHIPPED, {}, None)
    assert drift_reference(shipped, _heads(det)) == {}        # before: nothing to test
    det.keep_clean_sample(cal)
    ref = drift_reference(shipped, _heads(det))
    assert set(ref) == {"novelty"} and len(ref["novelty"]) == 400

    def gauge(rows) -> tuple[float, float, float]:
        """The exported gauges (`dualread_drift{score}`, its p-value, the flagged share)
        after a stream of answers."""
        d = DriftWindow(500)
        d.set_reference(ref)
        for r in det.read(rows, 0.02):
            d.record({"novelty": r.score}, r.novel)
        got = {(s.name, s.labels.get("score")): s.value
               for f in DriftCollector(SimpleNamespace(drift=d, service=None)).collect()
               for s in f.samples}
        return (got[("dualread_drift", "novelty")], got[("dualread_drift_p_value", "novelty")],
                got[("dualread_drift_flagged_share", None)])

    stat, p, flagged = gauge(_rows(500, 4))
    assert stat < 0.1 and p > 0.001 and flagged < 0.06
    stat, p, flagged = gauge(_rows(500, 5, shift=1.5))
    assert stat > 0.5 and p < 1e-10 and flagged > 0.5


def test_clean_sample_saves_loads_and_is_dropped_when_the_parts_change(tmp_path):
    cal = _rows(200, 1)
    det = _composite(cal).keep_clean_sample(cal)
    det.save(tmp_path)
    back = load_detector(tmp_path)
    assert np.array_equal(back.clean_scores(), det.clean_scores())
    assert back.to_dict()["n_clean_sample"] == 200
    # a part recalibrated since (another fit writing its parts only): the stale sample
    # would be drift's reference for another score distribution, so it is dropped
    other = _composite(_rows(200, 7))
    for name, part in other.parts.items():
        part.save(tmp_path, f"novelty.{name}")
    with pytest.warns(UserWarning, match="clean sample"):
        stale = load_detector(tmp_path)
    assert stale.clean_scores() is None
    # a composite saved without a sample removes an older one
    other.save(tmp_path)
    assert not (tmp_path / "novelty.safetensors").exists()


def test_add_clean_sample_reads_the_fit_data_and_refuses_other_readouts(monkeypatch):
    """The refit-free path: the fit's readouts, the same splits, nothing refitted; items
    that do not read as at calibration are refused."""
    import heads.detectors as detectors

    cal = _rows(120, 1)
    reader = _rows(80, 9)
    feats = {k: torch.cat([reader[k], cal[k]]) for k in cal}
    splits = {"reader": torch.arange(80), "temperature": torch.arange(80, 140),
              "defer": torch.arange(140, 200)}
    det = _composite(cal)
    bank = det.parts["image"].t["bank"].clone()

    class Col:
        def __init__(self, *a, **k):
            pass

        def run(self, items, label=""):
            return feats, None

    monkeypatch.setattr(detectors, "Collector", Col)
    monkeypatch.setattr(detectors, "splits_of", lambda meta: splits)
    heads = SimpleNamespace(novelty=det, kappa=1.0)
    assert detectors.add_clean_sample(None, heads, []) == 120
    assert np.array_equal(det.clean_scores(), np.sort(det.clean_sample(cal)))
    assert torch.equal(det.parts["image"].t["bank"], bank)          # nothing refitted
    feats = {k: v + 0.3 for k, v in feats.items()}                 # other readouts
    with pytest.raises(ValueError, match="do not read as they did"):
        detectors.add_clean_sample(None, heads, [])


# ------------------------------------------------------------------ the threshold search
def test_fixed_sequence_stops_at_the_first_failure_each_test_at_delta():
    c = np.linspace(0, 1, 1000)
    z = np.ones(1000, int)
    z[:600][::4] = 0                              # a quarter wrong below 0.6 ...
    z[700] = 0                                    # ... one above it
    grid = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    pol = choose_threshold_sequence(c, z, grid, 0.05, 0.1)
    assert pol.feasible and pol.tau == pytest.approx(0.6)
    sel = c >= 0.6
    assert pol.risk_upper_bound == pytest.approx(
        clopper_pearson_upper(int((1 - z[sel]).sum()), int(sel.sum()), 0.1))
    # a first threshold that fails ends the scan, even when a later one would pass
    z2 = z.copy()
    z2[c >= 0.9] = 0
    assert not choose_threshold_sequence(c, z2, grid, 0.05, 0.1).feasible
    assert choose_threshold_sequence(c, z2, grid, 0.05, 0.1).tau == DEFER_ALL_TAU


def test_sequence_grid_starts_where_a_test_can_pass():
    g = sequence_grid(np.linspace(0, 1, 301), 700, 0.05, 0.1)
    assert (np.diff(g) < 0).all()                                   # highest first
    # the first threshold keeps about 4 * k_min of 700 test items (k_min = 45 here)
    assert 1 - g[0] == pytest.approx(180 / 700, abs=0.01)
    assert g[-1] == 0.0
    assert len(sequence_grid(np.zeros(0), 700, 0.05, 0.1)) == 0


def test_the_certificate_holds_its_level_over_many_windows():
    """With probability ≥ 1 − δ over the window the rule's risk among released (on a large
    sample of the same stream) is ≤ r: the share of windows over r stays near δ or below
    (40 windows: δ + 3 standard errors; a search without the bound, τ where the window's
    own risk reaches r, is over r about half the time), while the search releases more
    than the binary search with its union bound."""
    base = _base()
    over, cov_seq, cov_bin = [], [], []
    for seed in range(40):
        rng = np.random.default_rng(5000 + seed)
        win = verdicts(stream(rng, 300, base, shift=6.0, tag=f"w{seed}"))
        later = stream(rng, 1500, base, shift=6.0, tag=f"n{seed}")
        rule, cert = certify(win, base, "r", target_risk=R, delta=DELTA, min_per_class=10)
        if rule is not None:
            assert cert["threshold_search"].startswith("fixed-sequence")
            cov, risk = released(rule.apply(base), later)
            over.append(risk > R)
            cov_seq.append(cov)
        rule_b, cert_b = certify(win, base, "r", target_risk=R, delta=DELTA,
                                 min_per_class=10, search="binary")
        cov_bin.append(0.0 if rule_b is None else released(rule_b.apply(base), later)[0])
        assert cert_b["threshold_search"].startswith("binary search")
    assert len(over) >= 35
    assert np.mean(over) <= DELTA + 3 * np.sqrt(DELTA * (1 - DELTA) / len(over))
    assert np.mean(cov_seq) > np.mean(cov_bin)


# ------------------------------------------------------------------ a skipped detector
def test_a_skipped_detector_is_judged_against_the_reference_the_rule_serves():
    """Verdicts served under an earlier rule that extended the detector carry its large
    p-values; one verdict lacks a reading, so the new rule does not extend the detector and
    serves the base's reference. The certificate must judge the τ part as that rule
    serves it: against the base's reference, not the served p-values."""
    base = _base()
    rng = np.random.default_rng(21)
    rows = stream(rng, 300, base, shift=6.0, accuracy_offset=3.0)
    [name] = rows[0][1].scores                               # the fixture's detector
    vs = []
    for i, v in enumerate(verdicts(rows)):
        s = v.served
        scores, pv = dict(s.scores), {name: 0.5}              # as the extended rule served
        if i == 0:
            scores, pv = {}, {}                                # no reading of the check
        vs.append(Verdict(v.request_id, Served("r1", s.logits, scores, pv, s.problem),
                          v.correct, 0.0, "op"))
    rule, cert = certify(vs, base, "r2", target_risk=R, delta=DELTA, min_per_class=10)
    assert cert["detector_references"][name].startswith("skipped")
    # the base flags this stream: every τ-part item with a score is deferred by it
    n_tau = cert["n_tau"]
    assert cert["n_tau_other_terms_defer"] >= n_tau - 1
    assert rule is None                       # nothing left to release: no certificate


def test_the_sequence_step_sets_the_grid_and_is_checked():
    import re

    base = _base()
    win = verdicts(stream(np.random.default_rng(7), 300, base, shift=6.0, tag="step"))
    counts = {}
    for step in (0.01, 0.05):
        _, cert = certify(win, base, "r", target_risk=R, delta=DELTA, min_per_class=10,
                          step=step)
        assert f"released shares {step:g} apart" in cert["threshold_search"]
        counts[step] = int(re.search(r"over (\d+) thresholds", cert["threshold_search"])[1])
    assert counts[0.05] < counts[0.01] / 3
    with pytest.raises(ValueError, match="step"):
        certify(win, base, "r", target_risk=R, delta=DELTA, min_per_class=10, step=0.0)
