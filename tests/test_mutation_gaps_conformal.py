"""Conformal p-values and the k-th neighbour distance by hand (mutation gaps of
heads/conformal.py)."""

from __future__ import annotations

import numpy as np

from heads.conformal import kth_distance, p_values


def test_p_value_counts_ties_as_at_least_as_strange():
    cal = np.array([3.0, 1.0, 2.0, 2.0])          # unsorted: the function sorts
    p = p_values(cal, np.array([2.0, 0.0, 3.5, 3.0]))
    # (1 + #{s_i >= s}) / (n + 1): ties count, n = 4
    assert np.allclose(p, [4 / 5, 5 / 5, 1 / 5, 2 / 5])


def test_presorted_skips_the_sort_only():
    cal = np.array([1.0, 2.0, 2.0, 3.0])
    s = np.array([2.0, 2.5])
    assert np.array_equal(p_values(cal, s, presorted=True), p_values(cal[::-1], s))
    # an unsorted bank given as sorted reads differently: the flag is honoured
    assert not np.array_equal(p_values(cal[::-1], s, presorted=True), p_values(cal, s))
    # and the default is to sort
    assert np.array_equal(p_values(cal[::-1], s), p_values(cal, s, presorted=True))


def test_kth_distance_equals_brute_force_below_one():
    rng = np.random.default_rng(0)
    bank = rng.normal(size=(7, 3)) * 0.1
    z = np.vstack([bank[2], rng.normal(size=(2, 3)) * 0.1])   # one row sits on the bank
    full = np.linalg.norm(z[:, None, :] - bank[None, :, :], axis=2)
    for k in (1, 2, 3):
        got = kth_distance(z, bank, k)
        assert np.allclose(got, np.sort(full, axis=1)[:, k - 1], atol=1e-7)
    assert kth_distance(z[:1], bank, 1)[0] == 0.0          # clipped at zero, never NaN
    assert np.all(kth_distance(z, bank, 1) < 1.0)


def test_kth_distance_is_exact_for_a_large_k():
    # np.partition leaves the rows below a small kth in order, so only a large k shows
    # that the k-th smallest distance is the one partitioned for
    rng = np.random.default_rng(3)
    bank = rng.normal(size=(300, 4))
    z = rng.normal(size=(40, 4))
    full = np.sort(np.linalg.norm(z[:, None, :] - bank[None, :, :], axis=2), axis=1)
    for k in (50, 120):
        assert np.allclose(kth_distance(z, bank, k), full[:, k - 1], atol=1e-9)
