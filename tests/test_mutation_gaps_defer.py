"""The defer threshold's search at its edges (mutation gaps of heads/defer.py)."""

from __future__ import annotations

import numpy as np

from heads.defer import (
    DEFER_ALL_TAU,
    choose_threshold,
    choose_threshold_sequence,
    clopper_pearson_upper,
    sequence_grid,
)


def test_no_calibration_items_defer_everything_without_a_search():
    p = choose_threshold(np.zeros(0), np.zeros(0, int), target_risk=0.05, delta=0.1)
    assert not p.feasible and p.tau == DEFER_ALL_TAU
    assert p.coverage == 0.0 and p.n_calibration == 0 and p.risk_upper_bound == 1.0


def test_fewer_items_than_any_threshold_needs_defer_everything():
    # 10 items, all right: the bound with no error needs about 45 kept at r = .05
    p = choose_threshold(np.linspace(0.5, 0.99, 10), np.ones(10, int), target_risk=0.05)
    assert not p.feasible and p.tau == DEFER_ALL_TAU and p.n_calibration == 10


# ------------------------------------------------------------ the fixed-sequence search
def test_fixed_sequence_defaults_are_the_binary_searchs():
    # r = .05 and δ = .1 unless told, as `choose_threshold`
    c = np.linspace(0.5, 1.0, 400)
    p = choose_threshold_sequence(c, np.ones(400, int), np.array([0.9, 0.7]))
    assert (p.target_risk, p.delta) == (0.05, 0.1)
    q = choose_threshold(c, np.ones(400, int))
    assert (q.target_risk, q.delta) == (p.target_risk, p.delta)


def test_fixed_sequence_releases_an_item_at_tau():
    # defer when confidence < τ: an item exactly at a grid threshold is kept and counted
    c = np.r_[np.full(200, 0.8), np.full(50, 0.3)]
    p = choose_threshold_sequence(c, np.ones(250, int), np.array([0.8]), 0.05, 0.1)
    assert p.feasible and p.tau == 0.8 and not p.defer(0.8)
    assert p.coverage == 200 / 250


def test_fixed_sequence_passes_a_bound_equal_to_r():
    # the bound must be ≤ r, so one exactly at r passes, as in `choose_threshold`
    c = np.linspace(0.0, 1.0, 300)
    z = np.ones(300, int)
    z[c >= 0.5][::20] = 0
    sel = c >= 0.5
    r = clopper_pearson_upper(int((1 - z[sel]).sum()), int(sel.sum()), 0.1)
    p = choose_threshold_sequence(c, z, np.array([0.5]), r, 0.1)
    assert p.feasible and p.tau == 0.5 and p.risk_upper_bound == r


def test_fixed_sequence_policy_reports_what_it_certified():
    c = np.linspace(0.0, 1.0, 400)
    z = np.ones(400, int)
    z[np.flatnonzero(c >= 0.4)[::50]] = 0          # a few errors among the kept
    p = choose_threshold_sequence(c, z, np.array([0.9, 0.6, 0.4]), 0.1, 0.1)
    sel = c >= 0.4
    k, e = int(sel.sum()), int((1 - z[sel]).sum())
    assert p.to_dict() == {
        "tau": 0.4, "target_risk": 0.1, "delta": 0.1, "coverage": k / 400,
        "empirical_risk": e / k, "risk_upper_bound": clopper_pearson_upper(e, k, 0.1),
        "n_calibration": 400, "feasible": True}


def test_fixed_sequence_with_no_passing_threshold_defers_everything():
    c = np.linspace(0.0, 1.0, 100)
    p = choose_threshold_sequence(c, np.zeros(100, int), np.array([0.9, 0.5]), 0.05, 0.2)
    # every field as sent on /v1/heads: a bound of 1, nothing kept, no risk measured
    assert p.to_dict() == {
        "tau": DEFER_ALL_TAU, "target_risk": 0.05, "delta": 0.2, "coverage": 0.0,
        "empirical_risk": 0.0, "risk_upper_bound": 1.0, "n_calibration": 100,
        "feasible": False}


def test_sequence_grid_steps_by_a_hundredth_unless_told():
    # the first share keeps 4 · k_min of 700 (k_min = 45): about 0.26, then .01 up to 1
    g = sequence_grid(np.linspace(0, 1, 1001), 700, 0.05, 0.1)
    assert len(g) == len(np.arange(180 / 700, 1.0 - 1e-9, 0.01)) + 1
    assert np.allclose(-np.diff(g)[:-1], 0.01) and g[-1] == 0.0   # then share 1 itself


def test_sequence_grid_for_one_test_item_or_none():
    c = np.array([0.2, 0.9, 0.5])
    # one test item: a single threshold that keeps every item
    assert sequence_grid(c, 1, 0.05, 0.1).tolist() == [0.2]
    # no test item: no grid (and no division by zero)
    assert len(sequence_grid(c, 0, 0.05, 0.1)) == 0
