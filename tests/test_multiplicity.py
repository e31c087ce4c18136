"""The family-wise note on paired contrasts: p-values from 95% intervals and Holm's
step-down."""

from __future__ import annotations

import pytest

from studies.multiplicity import family, holm, p_from_ci


def test_an_interval_that_just_touches_0_has_p_one_in_twenty():
    assert p_from_ci(1.96, 0.0, 3.92) == pytest.approx(0.05, abs=1e-4)
    assert p_from_ci(0.0, -1.0, 1.0) == pytest.approx(1.0)
    assert p_from_ci(-3.0, -4.0, -2.0) < 1e-6


def test_holm_steps_down_and_stops_at_the_first_failure():
    # sorted: .001 ≤ .05/4, .012 ≤ .05/3, .03 > .05/2 stops, so .04 stays too
    assert holm([0.03, 0.001, 0.04, 0.012]) == [False, True, False, True]
    # Bonferroni (each ≤ .05/3) would keep only .001; Holm: .02 ≤ .05/2, .03 ≤ .05/1
    assert holm([0.001, 0.02, 0.03]) == [True, True, True]
    assert holm([0.2]) == [False]


def test_a_contrast_clear_on_its_own_can_fall_under_the_family():
    d = {"paired_vs_dualread": {f"m{k}": {"auroc": {"diff": 0.9, "ci": [0.5, 1.3]}}
                                for k in range(9)}}
    # two contrasts with p ≈ .029 each: clear on their own, not under .05/2
    d["paired_vs_dualread"]["weak"] = {"auroc": {"diff": 0.05, "ci": [0.005, 0.095]},
                                       "ccg_natural": {"diff": -0.05, "ci": [-0.095, -0.005]}}
    rows = family({"datasets": {"x": d}, "ccg": {"contrasts": {"a − b": {
        "natural": {"difference": 0.5, "ci": [0.4, 0.6]}}}}})
    assert len(rows) == 12
    weak = [r for r in rows if "weak" in r["contrast"]]
    assert len(weak) == 2 and all(r["ci95_clear_of_0"] and not r["holm_clear_of_0"]
                                  for r in weak)
    assert all(r["holm_clear_of_0"] for r in rows if r not in weak)


def test_emvr_differences_join_the_probe_family_and_small_p_is_floored():
    report = {"emvr": {"bootstrap": 1000,
                       "per": {"blur_minus_verbalized": 0.048, "blur_minus_verbalized_ci":
                               [0.005, 0.097], "blur": 0.4, "blur_ci": [0.3, 0.5]},
                       "actor": {"drop_difference": 0.28, "drop_difference_ci": [0.24, 0.32]}}}
    rows = family(report)
    # the interface's own score (blur) is not a contrast; the two differences are
    assert sorted(r["contrast"] for r in rows) == ["EMVR actor: drop_difference",
                                                   "EMVR per: blur_minus_verbalized"]
    by = {r["contrast"]: r for r in rows}
    assert by["EMVR actor: drop_difference"]["p_text"] == "< 0.001"
    assert by["EMVR per: blur_minus_verbalized"]["p_text"] == "0.041"
    assert by["EMVR per: blur_minus_verbalized"]["ci95_clear_of_0"]
