"""The oriented Platt map at its edges (mutation gaps of heads/calibration.py): the
orientation follows the fitting split's AUROC, a constant statistic or one-class labels keep
the defined orientation, and the log records what was fitted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heads.calibration import MIN_SLOPE, fit_oriented_platt, fit_platt, fuse, platt, platt_log


def test_a_statistic_that_ranks_backwards_is_flipped_and_logged():
    rng = np.random.default_rng(0)
    z = (rng.uniform(size=400) < 0.5).astype(float)
    s = -z + rng.normal(0, 0.7, 400)                   # high = wrong
    ab, log = fit_oriented_platt(s, z)
    assert ab[0] < 0 and log["orientation"] == "flipped"
    assert log["fit_auroc_as_defined"] < 0.5
    assert log["fit_auroc_flipped"] == pytest.approx(1 - log["fit_auroc_as_defined"])
    assert (log["slope"], log["intercept"]) == (round(ab[0], 6), round(ab[1], 6))
    p = platt(s, ab)
    assert p[z == 1].mean() > p[z == 0].mean()
    assert platt_log(s, z, ab)["inverted"] is True
    assert platt_log(-s, z, (-ab[0], ab[1]))["inverted"] is False


def test_no_signal_keeps_the_defined_orientation_and_a_floor_slope():
    z = np.array([1.0, 0.0] * 50)
    s = np.tile([0.2, 0.2, 0.8, 0.8], 25)              # AUROC exactly .5
    ab, log = fit_oriented_platt(s, z)
    assert log["orientation"] == "as defined" and log["fit_auroc_as_defined"] == 0.5
    assert ab[0] >= MIN_SLOPE / s.std() - 1e-9        # never a constant
    # one class only, or a constant statistic: AUROC undefined, read as .5
    _, one = fit_oriented_platt(np.linspace(0, 1, 20), np.ones(20))
    assert one["orientation"] == "as defined" and one["fit_auroc_as_defined"] == 0.5
    ab_c, const = fit_oriented_platt(np.full(20, 0.3), np.array([1.0, 0.0] * 10))
    assert const["orientation"] == "as defined" and np.isfinite(ab_c).all()


def test_fuse_is_the_mean_of_the_two_logits_in_the_input_dtype():
    pre = torch.tensor([0.9, 0.2], dtype=torch.float32)
    post = torch.tensor([0.5, 0.8], dtype=torch.float32)
    got = fuse(pre, post)
    # ½·log 9 + ½·0 → σ = 3/4; ½·log ¼ + ½·log 4 = 0 → ½
    want = [0.75, 0.5]
    assert got.dtype == torch.float32
    assert got.numpy() == pytest.approx(want, abs=1e-6)


def test_one_class_either_way_and_a_constant_statistic_keep_the_defined_map():
    # all wrong, like all right, leaves the AUROC undefined: read as .5, not flipped
    ab, zero = fit_oriented_platt(np.linspace(0, 1, 20), np.zeros(20))
    assert zero["orientation"] == "as defined" and zero["fit_auroc_as_defined"] == 0.5
    assert ab[0] >= 0
    # a constant statistic ranks nothing: no slope at all (the floor is for statistics
    # that vary), the intercept is the base rate
    ab_c, _ = fit_oriented_platt(np.full(20, 0.5), np.array([1.0, 0.0, 0.0, 0.0] * 5))
    assert ab_c[0] == 0.0
    assert platt(0.5, ab_c) == pytest.approx(0.25, abs=1e-3)


@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_an_empty_split_gets_the_flat_map_not_an_error():
    # no rows to fit on (an empty temperature split): p = ½, the defined orientation
    ab, log = fit_oriented_platt(np.zeros(0), np.zeros(0))
    assert ab == (0.0, 0.0)
    assert log["orientation"] == "as defined" and log["fit_auroc_as_defined"] == 0.5


def test_the_log_rounds_to_six_places():
    s = np.array([0.1, 0.2, 0.3, 0.4])
    ab, log = fit_oriented_platt(s, np.array([1.0, 0.0, 1.0, 1.0]))   # AUROC 2/3
    assert log["fit_auroc_as_defined"] == 0.666667 and log["fit_auroc_flipped"] == 0.333333
    assert (log["slope"], log["intercept"]) == (round(ab[0], 6), round(ab[1], 6))
    assert log["slope"] != round(ab[0], 7)          # the data leave a seventh digit


def test_platt_fits_float32_scores_and_labels_as_their_float64_values():
    # readers emit float32: the fit must not depend on the storage type of the same numbers
    rng = np.random.default_rng(4)
    s = rng.normal(size=300).astype(np.float32)
    z = (rng.uniform(size=300) < 1 / (1 + np.exp(-2 * s))).astype(np.float32)
    want = fit_platt(s.astype(np.float64), z.astype(np.float64))
    assert fit_platt(s, z.astype(np.float64)) == want
    assert fit_platt(s.astype(np.float64), z) == want


def test_platt_maps_float32_scores_in_float64():
    s = np.linspace(-2, 2, 41).astype(np.float32)
    got = platt(s, (1.7, -0.3))
    assert got.dtype == np.float64
    assert np.array_equal(got, platt(s.astype(np.float64), (1.7, -0.3)))


def test_a_constant_statistic_with_a_rounding_std_gets_no_slope():
    """Twenty copies of 0.3 have a float std of ~5.6e-17, not 0: the fits must still see a
    constant (no slope), not divide by it into a step function."""
    s = np.full(20, 0.3)
    assert s.std() > 0
    z = np.array([1.0, 0.0] * 10)
    assert fit_platt(s, z)[0] == 0.0
    (a, _), log = fit_oriented_platt(s, z)
    assert a == 0.0 and log["fit_auroc_as_defined"] == 0.5
