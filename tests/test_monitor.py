"""The feedback monitor: which answers it scores, its values, and what it forgets."""

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from heads.monitor import FeedbackMonitor

# (request id, confidence, deferred, correct)
ROWS = [("a", 0.9, False, True), ("b", 0.8, False, False), ("c", 0.7, False, True),
        ("d", 0.3, True, False), ("e", 0.2, True, True), ("f", 0.6, False, True)]


def _fed(window: int = 500) -> FeedbackMonitor:
    m = FeedbackMonitor(window=window)
    for rid, c, d, _ in ROWS:
        m.record(rid, c, d)
    for rid, _, _, z in ROWS:
        assert m.feedback(rid, z) is True
    return m


def test_values_on_a_hand_built_window():
    s = _fed().stats()
    c = np.array([r[1] for r in ROWS])
    z = np.array([r[3] for r in ROWS], int)
    assert s["auroc"] == pytest.approx(roc_auc_score(z, c))
    # 15 bins: .9→13, .8→12, .7→10, .3→4, .2→3, .6→9; each alone, gap |z - c|
    assert s["ece"] == pytest.approx(np.mean(np.abs(z - c)))
    # selective risk: among the 4 answers not deferred (a, b, c, f) one is wrong
    assert s["selective_risk"] == pytest.approx(1 / 4)
    assert s["defer_rate"] == pytest.approx(2 / 6)
    assert s["n"] == 6


def test_selective_risk_ignores_deferred_answers():
    m = FeedbackMonitor()
    # every deferred answer is wrong, every kept answer right: the kept risk is 0
    for k, (c, d, z) in enumerate([(0.9, False, True), (0.1, True, False), (0.2, True, False)]):
        m.record(str(k), c, d)
        m.feedback(str(k), z)
    assert m.stats()["selective_risk"] == 0.0
    # all deferred: no kept answers, no risk to report
    m2 = FeedbackMonitor()
    m2.record("x", 0.1, True)
    m2.feedback("x", True)
    assert math.isnan(m2.stats()["selective_risk"]) and m2.stats()["defer_rate"] == 1.0


def test_unknown_and_repeated_feedback_is_refused():
    m = FeedbackMonitor()
    assert m.stats() == {}
    assert m.feedback("never-seen", True) is False
    m.record("r1", 0.7, False)
    assert m.feedback("r1", False) is True
    assert m.feedback("r1", True) is False          # one verdict per answer
    assert len(m.window) == 1 and m.stats()["n"] == 1
    assert m.already_labelled("r1") and not m.already_labelled("never-seen")


def test_labelled_ids_are_remembered_boundedly():
    m = FeedbackMonitor(remember=2)
    for rid in ("a", "b", "c"):
        m.record(rid, 0.5, False)
        assert m.feedback(rid, True)
    assert list(m.labelled) == ["b", "c"] and not m.already_labelled("a")


def test_window_keeps_only_the_latest_feedback():
    s = _fed(window=3).stats()
    # the window holds d, e, f: kept f (correct); deferred d, e
    assert s["n"] == 3
    assert s["defer_rate"] == pytest.approx(2 / 3)
    assert s["selective_risk"] == 0.0
    assert s["auroc"] == pytest.approx(roc_auc_score([0, 1, 1], [0.3, 0.2, 0.6]))


def test_pending_answers_are_forgotten_oldest_first():
    m = FeedbackMonitor(remember=2)
    for rid in ("old", "mid", "new"):
        m.record(rid, 0.5, False)
    assert list(m.pending) == ["mid", "new"]
    assert m.feedback("old", True) is False
    assert m.feedback("mid", True) is True and m.feedback("new", False) is True


def test_undefined_feedback_statistics_are_left_out_of_metrics():
    """One feedback so far: AUROC is undefined (one class). A NaN gauge breaks alert
    arithmetic, so it is absent until defined; the defined ones are exported."""
    from app.metrics import FeedbackCollector

    class OneAnswer:
        def stats(self):
            return {"auroc": float("nan"), "ece": 0.1, "selective_risk": float("nan"),
                    "n": 1.0}

    got = {g.name: g.samples[0].value for g in FeedbackCollector(OneAnswer()).collect()}
    assert got == {"dualread_feedback_ece": 0.1, "dualread_feedback_window": 1.0}
