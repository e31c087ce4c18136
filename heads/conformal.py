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


def kth_distance(z: np.ndarray, bank: np.ndarray, k: int) -> np.ndarray:
    """Euclidean distance of each row of `z` [N, D] to its k-th nearest row of `bank`
    (|a|² + |b|² − 2a·b, as `torch.cdist` computes it for all but tiny inputs). One row at
    a time: a matrix product over several rows rounds differently from one over one row,
    and an image's reading must not depend on the batch it came in."""
    out = np.empty(len(z))
    b2 = (bank * bank).sum(1)
    for i, a in enumerate(z):
        d = np.sqrt(np.maximum(b2 + a @ a - 2.0 * (bank @ a), 0.0))
        out[i] = np.partition(d, k - 1)[k - 1]
    return out
