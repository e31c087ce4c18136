"""`evaluate`'s defer accounting on hand-built heads (mutation gaps of heads/evaluate.py):
one reason per part of the rule the heads have, the deferred set as their union, and the
suite row read with it."""

from __future__ import annotations

import numpy as np
import pytest

from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.evaluate import defer_accounting
from heads.suites import suite_row

C = np.array([0.95, 0.9, 0.85, 0.5, 0.2, 0.99])
Z = np.array([1, 0, 1, 1, 0, 0])


def _heads(novelty: bool = False, image: bool = False) -> Heads:
    h = Heads(dim=2, policy=DeferPolicy(tau=0.8, target_risk=0.25, delta=0.1, coverage=0.5,
                                        empirical_risk=0.0, risk_upper_bound=0.05,
                                        n_calibration=100, feasible=True))
    if novelty:
        h.novelty, h.novelty_alpha = object(), 0.05
    if image:
        h.image_check, h.image_check_alpha = object(), 0.05
    return h


def test_only_tau_without_detectors_or_responses():
    got = defer_accounting(_heads(), Z, C, None, None, None)
    d = got["defer"]
    assert set(d["deferred_share"]) == {"tau"}
    assert "novelty_flag_rate" not in d and "image_flag_rate" not in d
    assert d["tau"] == 0.8 and d["target_risk"] == 0.25
    kept = C >= 0.8                                    # 4 kept, 2 of them wrong
    assert d["n_kept"] == 4 and d["coverage"] == pytest.approx(4 / 6)
    assert d["risk"] == pytest.approx(0.5) and d["risk_within_target"] is False
    assert got["suite"] == suite_row(Z, C, ~kept, ~kept)


def test_every_part_defers_and_the_suite_row_sees_the_union():
    nov = [0.5, 0.01, 0.5, 0.5, 0.5, 0.5]             # flags the 0.9 (wrong)
    img = [0.5, 0.5, 0.5, 0.5, 0.5, 0.01]             # flags the 0.99 (wrong)
    problems = ["no answer tag", None, None, None, None, None]   # the 0.95 (right)
    got = defer_accounting(_heads(True, True), Z, C, nov, problems, img)
    d = got["defer"]
    assert set(d["deferred_share"]) == {"tau", "novelty", "image", "problem"}
    assert d["novelty_flag_rate"] == pytest.approx(1 / 6)
    assert d["image_flag_rate"] == pytest.approx(1 / 6)
    assert d["n_kept"] == 1 and d["risk"] == 0.0 and d["risk_within_target"] is True
    deferred = np.array([True, True, False, True, True, True])
    tau_only = C < 0.8
    assert got["suite"] == suite_row(Z, C, deferred, tau_only)
    assert got["suite"]["released"] == pytest.approx(1 / 6)
    assert got["suite"]["released_tau_only"] == pytest.approx(4 / 6)


def test_a_part_the_heads_lack_is_left_out_even_with_its_values():
    nov = [0.01] * 6
    got = defer_accounting(_heads(image=True), Z, C, nov, [None] * 6, [0.5] * 6)
    d = got["defer"]
    assert set(d["deferred_share"]) == {"tau", "image", "problem"}
    assert d["n_kept"] == 4
    got = defer_accounting(_heads(novelty=True), Z, C, [0.5] * 6, None, [0.01] * 6)
    assert set(got["defer"]["deferred_share"]) == {"tau", "novelty"}
    assert got["defer"]["n_kept"] == 4
