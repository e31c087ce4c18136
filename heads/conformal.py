"""Conformal p-values and the k-nearest-neighbour distance, in numpy alone."""

from __future__ import annotations

import numpy as np


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


def kth_distance(z: np.ndarray, bank: np.ndarray, k: int, b2: np.ndarray | None = None
                 ) -> np.ndarray:
    """Euclidean distance of each row of `z` [N, D] to its k-th nearest row of `bank`
    (|a|² + |b|² − 2a·b, as `torch.cdist` computes it for all but tiny inputs). One row at
    a time: a matrix product over several rows rounds differently from one over one row,
    and an image's reading must not depend on the batch it came in. `b2`: the bank's
    squared row norms, `(bank * bank).sum(1)`, when the caller keeps them (computing them
    cost more than one row's distances)."""
    out = np.empty(len(z))
    if b2 is None:
        b2 = (bank * bank).sum(1)
    for i, a in enumerate(z):
        # the k-th smallest squared distance; its root below is the k-th smallest
        # distance bit for bit (max(·, 0) and the root keep the order of any values)
        out[i] = np.partition(b2 + a @ a - 2.0 * (bank @ a), k - 1)[k - 1]
    return np.sqrt(np.maximum(out, 0.0))
