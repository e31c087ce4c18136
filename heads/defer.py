"""Defer policy with a finite-sample risk guarantee (SPEC §1).

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


def choose_threshold(confidence: np.ndarray, correct: np.ndarray, target_risk: float = 0.05,
                     delta: float = 0.1) -> DeferPolicy:
    c = np.asarray(confidence, float)
    err = 1 - np.asarray(correct, int)
    n = len(c)
    order = np.sort(c)
    tests = max(1, math.ceil(math.log2(max(n, 2))))
    level = delta / tests
    lo, hi = 0, n - 1
    best = None
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
