"""Conformal p-values and the k-nearest-neighbour distance, in numpy alone: the process
that runs the image check (`heads.check_process`) never imports torch."""

from __future__ import annotations

import numpy as np

ROWS_AT_ONCE = 64      # rows whose distances to the whole bank are held at once


def p_values(cal_scores: np.ndarray, scores: np.ndarray, presorted: bool = False
             ) -> np.ndarray:
    """(1 + #{i : s_i ≥ s}) / (n + 1) for each s, against calibration scores s_i
    (`presorted`: they are already in ascending order, as `Novelty` keeps them)."""
    cal = np.asarray(cal_scores, float)
    if not presorted:
        cal = np.sort(cal)
    s = np.asarray(scores, float)
    at_least = len(cal) - np.searchsorted(cal, s, side="left")
    return (1 + at_least) / (len(cal) + 1)


def kth_distance(z: np.ndarray, bank: np.ndarray, k: int) -> np.ndarray:
    """Euclidean distance of each row of `z` [N, D] to its k-th nearest row of `bank`,
    from the differences themselves (no |a|² + |b|² − 2ab cancellation)."""
    out = np.empty(len(z))
    for s in range(0, len(z), ROWS_AT_ONCE):
        d = np.sqrt(((z[s: s + ROWS_AT_ONCE, None, :] - bank[None]) ** 2).sum(-1))
        out[s: s + ROWS_AT_ONCE] = np.partition(d, k - 1, axis=1)[:, k - 1]
    return out
