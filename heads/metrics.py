"""Reliability metrics (docs/method.md §6). Correct = positive; confidences in [0, 1]."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from sklearn.metrics import brier_score_loss, roc_auc_score

# the bootstrap and AURC live with the numpy-only client maths (the probes use them too);
# imported here for older callers
from clients.maths import (  # noqa: F401
    aurc,
    cluster_bootstrap,
    resample_clusters,
    resample_clusters_counted,
)


def auroc(c: np.ndarray, z: np.ndarray) -> float:
    """AUROC with ties counted ½ (sklearn's trapezoid); NaN with one class only."""
    z = np.asarray(z, int)
    if z.min(initial=1) == z.max(initial=0):
        return float("nan")
    return float(roc_auc_score(z, c))


def ece(c: np.ndarray, z: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error, equal-width bins, empty bins skipped; NaN on no items.

    Confidences outside [0, 1] (or NaN) are an error: binning would clip them silently.
    """
    c, z = np.asarray(c, float), np.asarray(z, float)
    if len(c) == 0:
        return float("nan")
    if not np.all((c >= 0) & (c <= 1)):
        raise ValueError("ece needs confidences in [0, 1] (got values outside, or NaN)")
    idx = np.minimum((c * bins).astype(int), bins - 1)
    total = 0.0
    for b in np.unique(idx):
        m = idx == b
        total += m.sum() * abs(z[m].mean() - c[m].mean())
    return float(total / len(c))


def brier(c: np.ndarray, z: np.ndarray) -> float:
    return float(brier_score_loss(np.asarray(z, int), np.asarray(c, float), pos_label=1))


def hce(c: np.ndarray, z: np.ndarray, at: float = 0.9) -> float:
    """Share of all items with confidence ≥ `at` that are wrong."""
    c, z = np.asarray(c, float), np.asarray(z, int)
    if len(c) == 0:
        return float("nan")
    return float(((c >= at) & (z == 0)).sum() / len(c))


def risk_coverage(c: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coverage and selective risk at every distinct threshold, high to low.

    Items with equal confidence are kept or deferred together, so there is one point per
    distinct confidence (at the end of its block): the curve does not depend on the order
    of tied items.
    """
    c = np.asarray(c, float)
    order = np.argsort(-c, kind="stable")
    err = 1 - np.asarray(z, float)[order]
    n = len(err)
    if n == 0:
        return np.zeros(0), np.zeros(0)
    ends = np.r_[np.nonzero(np.diff(c[order]))[0], n - 1]     # last index of each block
    k = ends + 1
    return k / n, np.cumsum(err)[ends] / k


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "auroc": auroc, "ece": lambda c, z: ece(c, z, 15), "ece10": lambda c, z: ece(c, z, 10),
    "brier": brier, "aurc": aurc, "hce90": hce,
}
