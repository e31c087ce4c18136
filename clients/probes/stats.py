"""numpy-only statistics for the probes (docs/method.md §3–§5): evidence order, trajectory
grounding, visual reliance, bootstrap intervals and permutation tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from clients.maths import resample_clusters

Interval = tuple[float, float]
NAN_CI: Interval = (float("nan"), float("nan"))


def mean(x: Sequence[float] | np.ndarray) -> float:
    a = np.asarray(x, float)
    return float(a.mean()) if a.size else float("nan")


# ---------------------------------------------------------------- evidence order (§4)
def violations(r: np.ndarray, tol: float = 0.0) -> np.ndarray:
    """[n, K] reliabilities ordered by severity → [n, K-1] booleans R_{k+1} > R_k + tol
    (tol = 0: the EMVR paper's definition)."""
    r = np.asarray(r, float)
    return r[:, 1:] > r[:, :-1] + tol


def emvr(r: np.ndarray, tol: float = 0.0) -> float:
    """Fraction of all adjacent pairs (pooled over trajectories) where reliability rises
    as evidence is removed. Ties are not violations. `tol` > 0 counts only rises larger
    than it: a diagnostic beside EMVR, never EMVR itself (docs/probes.md)."""
    v = violations(r, tol)
    return float(v.mean()) if v.size else float("nan")


def tvr(r: np.ndarray) -> float:
    """Fraction of trajectories with at least one adjacent violation."""
    v = violations(r)
    return float(v.any(1).mean()) if len(v) else float("nan")


def auroc(c: np.ndarray, z: np.ndarray) -> float:
    """AUROC with correct = positive and ties counted ½ (Mann–Whitney); NaN with one class."""
    c, z = np.asarray(c, float).ravel(), np.asarray(z, bool).ravel()
    pos, neg = c[z], c[~z]
    if not len(pos) or not len(neg):
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    allc = np.concatenate([pos, neg])[order]
    ranks = np.empty(len(allc))
    ranks[order] = _average_ranks(allc)
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def _average_ranks(sorted_values: np.ndarray) -> np.ndarray:
    """1-based ranks of an ascending array, tied values sharing their mean rank."""
    n = len(sorted_values)
    starts = np.r_[0, np.nonzero(np.diff(sorted_values))[0] + 1]
    ends = np.r_[starts[1:], n]
    return np.repeat((starts + ends + 1) / 2, ends - starts)


# ---------------------------------------------------------------- trajectory grounding (§3)
def jsd_bernoulli(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon divergence (base 2, in [0, 1]) between Bernoulli(p) and Bernoulli(q)."""
    p = np.clip(np.asarray(p, float), 0, 1)
    q = np.clip(np.asarray(q, float), 0, 1)
    P = np.stack([p, 1 - p], -1)
    Q = np.stack([q, 1 - q], -1)
    M = (P + Q) / 2

    def kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log2(a / np.where(b > 0, b, 1)), 0.0)
        return t.sum(-1)

    return np.maximum(0.5 * kl(P, M) + 0.5 * kl(Q, M), 0.0)


def share_close(p: np.ndarray, q: np.ndarray, at: float = 0.1) -> float:
    """P(JSD ≤ at): how often swapping a component leaves the confidence distribution
    (near) unchanged — higher means more trajectory-independent."""
    d = jsd_bernoulli(p, q)
    return float((d <= at).mean()) if d.size else float("nan")


def jsd(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon divergence between rows of two distributions (natural log, so at
    most ln 2): ½ KL(P‖M) + ½ KL(Q‖M), M = ½(P + Q) (TGS paper A.1.4)."""
    p, q = np.atleast_2d(np.asarray(p, float)), np.atleast_2d(np.asarray(q, float))
    m = (p + q) / 2

    def kl(a: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log(a / m), 0.0)
        return t.sum(-1)
    return 0.5 * kl(p) + 0.5 * kl(q)


def pairwise_jsd(dists: list[np.ndarray]) -> list[float]:
    """JSD of every pair among a set of distributions (the paper's 'all alternative
    pairs')."""
    return [float(jsd(dists[i], dists[j])[0]) for i in range(len(dists))
            for j in range(i + 1, len(dists))]


# ---------------------------------------------------------------- visual reliance (§5)
def reliance(z_real, z_blank, z_shuf, same_answer, nvc) -> dict[str, float]:
    """VRS, BD, IS, VBR, VHR, NVCR, HVRR and P(invariant | NVC) from per-item arrays."""
    zr, zb, zs = (np.asarray(x, bool) for x in (z_real, z_blank, z_shuf))
    same, claim = np.asarray(same_answer, bool), np.asarray(nvc, bool)
    if not len(zr):
        return {k: float("nan") for k in ("acc_real", "acc_blank", "acc_shuffle", "vrs", "bd",
                                          "is", "vbr", "vhr", "nvcr", "hvrr",
                                          "p_invariant_given_nvc")}
    return {"acc_real": mean(zr), "acc_blank": mean(zb), "acc_shuffle": mean(zs),
            "vrs": mean(zr) - mean(zs), "bd": mean(zr) - mean(zb), "is": mean(~same),
            "vbr": mean(zr & ~zs), "vhr": mean(~zr & zs), "nvcr": mean(claim),
            "hvrr": mean(claim & same),
            "p_invariant_given_nvc": mean(same[claim]) if claim.any() else float("nan")}


# ---------------------------------------------------------------- uncertainty
def bootstrap(n: int, stat: Callable[[np.ndarray], float], resamples: int = 1000,
              seed: int = 42) -> Interval:
    """Percentile 95% CI of `stat(unit indices)`, resampling whole units (paired: every
    array indexed by the same units moves together)."""
    if n == 0 or resamples <= 0:
        return NAN_CI
    rng = np.random.default_rng(seed)
    vals = np.array([stat(rng.integers(0, n, n)) for _ in range(resamples)], float)
    vals = vals[np.isfinite(vals)]
    if not vals.size:
        return NAN_CI
    return float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))


def cluster_bootstrap(clusters: Sequence[str], stat: Callable[[np.ndarray], float],
                      resamples: int = 1000, seed: int = 42) -> Interval:
    """Percentile 95% CI resampling clusters (images) with all their items; the one
    image-cluster bootstrap of `clients.maths`."""
    if not len(clusters) or resamples <= 0 or not np.isfinite(stat(np.arange(len(clusters)))):
        return NAN_CI                     # undefined on the whole sample: no interval
    return resample_clusters(clusters, stat, resamples, seed)


def sign_flip_p(d: Sequence[float] | np.ndarray, resamples: int = 10000, seed: int = 42
                ) -> float:
    """Two-sided paired permutation test of mean(d) = 0: under H0 the two conditions of an
    item are exchangeable, so each difference keeps or flips its sign at random.
    p = (1 + #{|mean*| ≥ |mean|}) / (resamples + 1)."""
    d = np.asarray(d, float)
    if not d.size:
        return float("nan")
    obs = abs(d.mean())
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, resamples, 1000):        # in blocks: bounded memory
        k = min(1000, resamples - start)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(k, d.size))
        hits += int((np.abs((signs * d).mean(1)) >= obs - 1e-12).sum())
    return (1 + hits) / (resamples + 1)
