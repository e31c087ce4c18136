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
