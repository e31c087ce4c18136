"""Defer policy with a finite-sample risk guarantee (docs/method.md §1).

Selective classification with guaranteed risk (Geifman & El-Yaniv, 2017): a binary search
over the sorted calibration confidences, ⌈log2 m⌉ tests, each a one-sided Clopper–Pearson
upper bound on the selective risk at level δ / ⌈log2 m⌉. τ is the lowest tested threshold
whose bound is ≤ r: with probability ≥ 1 − δ over the calibration draw, the error rate
among answers not deferred is ≤ r. A union bound over a fine fixed grid would cost far
more coverage; a fixed-sequence scan from the top stops at the first high threshold that
has too few items to pass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import beta

# A threshold above any probability: with it every answer is deferred (no feasible τ, or
# no policy at all).
DEFER_ALL_TAU = 1.5


@dataclass(frozen=True)
class DeferPolicy:
    tau: float                 # defer when confidence < tau
    target_risk: float         # r
    delta: float               # δ
    coverage: float            # share of calibration items not deferred at tau
    empirical_risk: float      # error rate among them
    risk_upper_bound: float    # Clopper–Pearson bound at tau
    n_calibration: int
    feasible: bool             # False: no threshold met r, everything is deferred

    def defer(self, confidence: float) -> bool:
        return confidence < self.tau

    def to_dict(self) -> dict:
        return asdict(self)


def clopper_pearson_upper(errors: int, n: int, delta: float) -> float:
    if n == 0:
        return 1.0
    if errors >= n:
        return 1.0
    return float(beta.ppf(1 - delta, errors + 1, n - errors))


def min_kept(target_risk: float, level: float) -> int:
    """k_min = ⌈log(level) / log(1 − r)⌉: the fewest kept items whose Clopper–Pearson bound
    with zero errors can be ≤ r."""
    if target_risk <= 0:
        return 10 ** 12
    if target_risk >= 1:
        return 1
    return max(1, math.ceil(math.log(level) / math.log(1 - target_risk) - 1e-12))


def choose_threshold(confidence: np.ndarray, correct: np.ndarray, target_risk: float = 0.05,
                     delta: float = 0.1) -> DeferPolicy:
    c = np.asarray(confidence, float)
    err = 1 - np.asarray(correct, int)
    n = len(c)
    order = np.sort(c)
    # A threshold keeping fewer than k_min items cannot pass even with no error at all
    # (the bound with 0 errors of k is 1 − level^(1/k)); the search only visits thresholds
    # that keep at least k_min, so it never walks into the top tail. k_min uses the level
    # of the full search (smaller level, larger k_min); the search over fewer candidates
    # then spends fewer tests, each at a larger level, which keeps the union bound.
    k_min = min_kept(target_risk, delta / max(1, math.ceil(math.log2(max(n, 2)))))
    m = n - k_min + 1                      # candidate thresholds order[0 .. n - k_min]
    tests = max(1, math.ceil(math.log2(max(m, 2))))
    level = delta / tests
    lo, hi = 0, n - k_min
    best = None
    if m < 1:
        tests = 0
    for _ in range(tests):
        mid = math.ceil((lo + hi) / 2)
        tau = float(order[mid])
        sel = c >= tau
        k = int(sel.sum())
        ub = clopper_pearson_upper(int(err[sel].sum()), k, level)
        if ub <= target_risk:
            if best is None or tau < best[0]:
                best = (tau, k, float(err[sel].mean()), ub)
            hi = mid
        else:
            lo = mid
    if best is None:
        # tau above any probability: everything is deferred
        return DeferPolicy(tau=DEFER_ALL_TAU, target_risk=target_risk, delta=delta, coverage=0.0,
                           empirical_risk=0.0, risk_upper_bound=1.0, n_calibration=n,
                           feasible=False)
    tau, k, risk, ub = best
    return DeferPolicy(tau=tau, target_risk=target_risk, delta=delta, coverage=k / n,
                       empirical_risk=risk, risk_upper_bound=ub, n_calibration=n,
                       feasible=True)


def sequence_grid(confidence: np.ndarray, n_test: int, target_risk: float, delta: float,
                  step: float = 0.01) -> np.ndarray:
    """Candidate thresholds for `choose_threshold_sequence`, from confidences of items
    *disjoint* from the ones the thresholds will be tested on: their quantiles at released
    shares from the share that keeps about 4·k_min of `n_test` test items (fewer could fail
    on one or two errors and end the scan at its first test) up to 1, in steps of `step`;
    highest threshold first."""
    c = np.asarray(confidence, float)
    if len(c) == 0 or n_test <= 0:
        return np.zeros(0)
    start = min(1.0, 4 * min_kept(target_risk, delta) / n_test)
    shares = np.r_[np.arange(start, 1.0 - 1e-9, step), 1.0]
    return np.unique(np.quantile(c, 1.0 - shares))[::-1]


def choose_threshold_sequence(confidence: np.ndarray, correct: np.ndarray,
                              grid: np.ndarray, target_risk: float = 0.05,
                              delta: float = 0.1) -> DeferPolicy:
    """τ by fixed-sequence testing (Bauer 1991; Angelopoulos et al. 2021, "Learn then
    Test"): the thresholds of `grid`, chosen without these items' labels (highest first),
    are tested in order, each with the one-sided Clopper–Pearson bound at level δ itself;
    the scan stops at the first threshold whose bound exceeds r, and τ is the last one that
    passed. A false certificate needs the first threshold whose true risk exceeds r to
    pass its own test, which happens with probability ≤ δ: with probability ≥ 1 − δ over
    the draw of these items, the risk among released is ≤ r, as `choose_threshold`
    guarantees, but with no union bound over the tests (a level of δ, not δ / ⌈log2 m⌉).
    Valid only when `grid` does not depend on these items' labels (`sequence_grid` of a
    disjoint part; re-certification also sizes it by how many test items the detectors
    release, which reads no label)."""
    c = np.asarray(confidence, float)
    err = 1 - np.asarray(correct, int)
    best = None
    for tau in np.asarray(grid, float):
        sel = c >= tau
        k = int(sel.sum())
        ub = clopper_pearson_upper(int(err[sel].sum()), k, delta)
        if ub > target_risk:
            break
        best = (float(tau), k, float(err[sel].mean()), ub)
    if best is None:
        return DeferPolicy(tau=DEFER_ALL_TAU, target_risk=target_risk, delta=delta,
                           coverage=0.0, empirical_risk=0.0, risk_upper_bound=1.0,
                           n_calibration=len(c), feasible=False)
    tau, k, risk, ub = best
    return DeferPolicy(tau=tau, target_risk=target_risk, delta=delta, coverage=k / len(c),
                       empirical_risk=risk, risk_upper_bound=ub, n_calibration=len(c),
                       feasible=True)
