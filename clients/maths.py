"""The CCG-AUC maths (docs/method.md §2), AURC and the image-cluster bootstrap, numpy only.

Shared by the probe clients and by `heads` (whose evaluation CIs resample images the same
way), so an evaluator needs no model stack to recompute a number.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from clients.grounding import classify_pair


@dataclass
class Pair:
    """One eligible item of CCG: the real image and its donor (hard negative)."""

    item_id: str
    image_id: str
    z_real: bool
    z_hn: bool
    c_real: float
    c_hn: float
    strict: bool    # decisive with the same non-empty canonical answer on both images


def phi(d: np.ndarray) -> np.ndarray:
    """φ(d) = 1[d > 0] + ½·1[d = 0]."""
    d = np.asarray(d, float)
    return (d > 0).astype(float) + 0.5 * (d == 0)


def decisive(pairs: Sequence[Pair], strict: bool = False) -> list[Pair]:
    """E (z_real = 1, z_hn = 0) by the one rule in `clients.grounding`; with `strict`,
    E_strict, read from each pair's `strict` flag (set by that same rule when the pair was
    made, from the canonical answers this record no longer holds)."""
    return [p for p in pairs if classify_pair(p.z_real, p.z_hn, "", "").decisive
            and (p.strict or not strict)]


def ccg_auc(pairs: Sequence[Pair], strict: bool = False) -> float:
    """mean over E of φ(c_real − c_hn); NaN when E is empty."""
    e = decisive(pairs, strict)
    if not e:
        return float("nan")
    return float(phi(np.array([p.c_real - p.c_hn for p in e])).mean())


def aurc(c: np.ndarray, z: np.ndarray) -> float:
    """Area under the risk-coverage curve, confidence high to low.

    Items with equal confidence form one block; within it the expected risk under a random
    order is used (errors spread evenly over the block's positions).
    """
    c, err = np.asarray(c, float), 1 - np.asarray(z, float)
    n = len(c)
    if n == 0:
        return float("nan")
    order = np.argsort(-c, kind="stable")
    c, err = c[order], err[order]
    starts = np.r_[0, np.nonzero(np.diff(c))[0] + 1]
    sizes = np.diff(np.r_[starts, n])
    block_err = np.add.reduceat(err, starts)
    before = np.r_[0.0, np.cumsum(block_err)[:-1]]
    pos = np.arange(n) - np.repeat(starts, sizes) + 1          # 1-based place in block
    expected = np.repeat(before, sizes) + np.repeat(block_err / sizes, sizes) * pos
    return float(np.mean(expected / np.arange(1, n + 1)))


def resample_clusters_counted(clusters: Sequence[str], stat: Callable[[np.ndarray], float],
                              n: int = 1000, seed: int = 42) -> tuple[float, float, int]:
    """95% percentile CI of `stat(item indices)`, resampling whole clusters (images), and
    the number of resamples whose statistic was NaN (e.g. one class only), which the CI
    leaves out: a caller reports it rather than trusting a CI of fewer resamples."""
    keys, inv = np.unique(np.asarray(clusters), return_inverse=True)
    members = [np.nonzero(inv == k)[0] for k in range(len(keys))]
    rng = np.random.default_rng(seed)
    stats, nan = [], 0
    for _ in range(n if len(keys) else 0):
        idx = np.concatenate([members[k] for k in rng.integers(len(keys), size=len(keys))])
        v = stat(idx)
        if np.isnan(v):
            nan += 1
        else:
            stats.append(v)
    if not stats:
        return float("nan"), float("nan"), nan
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi), nan


def resample_clusters(clusters: Sequence[str], stat: Callable[[np.ndarray], float],
                      n: int = 1000, seed: int = 42) -> tuple[float, float]:
    """95% percentile CI of `stat(item indices)`, resampling whole clusters (images).

    NaN resamples are left out of the CI, with a warning that counts them
    (`resample_clusters_counted` returns the count).
    """
    lo, hi, nan = resample_clusters_counted(clusters, stat, n, seed)
    if nan:
        warnings.warn(f"{nan} of {n} bootstrap resamples gave NaN and are left out of the CI",
                      RuntimeWarning, stacklevel=2)
    return lo, hi


def cluster_bootstrap(c: np.ndarray, z: np.ndarray, clusters: Sequence[str],
                      fn: Callable[[np.ndarray, np.ndarray], float], n: int = 1000,
                      seed: int = 42) -> tuple[float, float]:
    """95% percentile CI of a metric fn(c, z), resampling whole clusters (source images)."""
    c, z = np.asarray(c, float), np.asarray(z, int)
    return resample_clusters(clusters, lambda idx: fn(c[idx], z[idx]), n, seed)


def ccg_bootstrap_ci(pairs: Sequence[Pair], strict: bool = False, n: int = 1000,
                     seed: int = 42) -> tuple[float, float]:
    """Paired source-image-cluster bootstrap: resample images, keep all their questions."""
    pairs = list(pairs)
    return resample_clusters([p.image_id for p in pairs],
                             lambda idx: ccg_auc([pairs[i] for i in idx], strict), n, seed)
