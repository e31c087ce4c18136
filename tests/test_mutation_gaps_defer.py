"""The defer threshold's search at its edges (mutation gaps of heads/defer.py)."""

from __future__ import annotations

import numpy as np

from heads.defer import DEFER_ALL_TAU, choose_threshold


def test_no_calibration_items_defer_everything_without_a_search():
    p = choose_threshold(np.zeros(0), np.zeros(0, int), target_risk=0.05, delta=0.1)
    assert not p.feasible and p.tau == DEFER_ALL_TAU
    assert p.coverage == 0.0 and p.n_calibration == 0 and p.risk_upper_bound == 1.0


def test_fewer_items_than_any_threshold_needs_defer_everything():
    # 10 items, all right: the bound with no error needs about 45 kept at r = .05
    p = choose_threshold(np.linspace(0.5, 0.99, 10), np.ones(10, int), target_risk=0.05)
    assert not p.feasible and p.tau == DEFER_ALL_TAU and p.n_calibration == 10
