"""Temperature scaling, Platt mapping and the DualRead log-odds fusion (docs/method.md §1)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-6


def logit(p: torch.Tensor | np.ndarray) -> torch.Tensor:
    p = torch.as_tensor(p, dtype=torch.float64).clamp(EPS, 1 - EPS)
    return torch.log(p) - torch.log1p(-p)


def fit_temperature(logits: torch.Tensor, z: torch.Tensor, steps: int = 200) -> float:
    """T minimising BCE(σ(ℓ/T), z) on a calibration split, everything else fixed."""
    logits, z = logits.double().flatten(), z.double().flatten()
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(logits / log_t.exp(), z)
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp().clamp(0.05, 100.0))


def fit_platt(score: np.ndarray, z: np.ndarray, nonneg: bool = True,
              min_slope: float = 0.0) -> tuple[float, float]:
    """(a, b) of p = σ(a·s + b), by logistic regression on a validation split.

    With `nonneg` (the default) the slope is constrained to a ≥ 0: every statistic is
    oriented so that higher means more confident, and a negative slope would silently
    invert it. When the data want a < 0 the fit stops at a = 0 (the base rate, no
    ranking) and `platt_inverted` says so. `min_slope` (in units of the score's standard
    deviation) keeps the slope above 0, so the map never collapses to a constant.
    """
    from scipy.optimize import minimize

    s = np.asarray(score, float).ravel()
    z = np.asarray(z, float).ravel()
    if len(z) == 0 or z.min() == z.max():
        rate = z.mean() if len(z) else 0.5
        return 0.0, float(np.log((rate + EPS) / (1 - rate + EPS)))
    # centre and scale for the optimiser; mapped back below. A constant statistic can have
    # a std of ~1e-17 (the mean's rounding): max > min, not std > 0, says it varies
    mu, sd = s.mean(), s.std() if s.max() > s.min() else 1.0
    x = (s - mu) / sd

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        t = w[0] * x + w[1]
        # mean BCE with logits, numerically stable; tiny ridge as sklearn's C=1e4
        val = np.mean(np.logaddexp(0, t) - z * t) + 0.5e-4 * w[0] ** 2 / len(z)
        g = 1 / (1 + np.exp(-t)) - z
        return val, np.array([np.mean(g * x) + 1e-4 * w[0] / len(z), np.mean(g)])

    rate = z.mean()
    w0 = np.array([0.0, np.log(rate / (1 - rate))])
    bounds = [(min_slope, None) if nonneg else (None, None), (None, None)]
    w = minimize(loss, w0, jac=True, method="L-BFGS-B", bounds=bounds).x
    a = w[0] / sd
    return float(a), float(w[1] - a * mu)


def platt_inverted(score: np.ndarray, z: np.ndarray) -> bool:
    """True when an unconstrained Platt fit wants a negative slope: the statistic ranks
    the wrong way round on this split."""
    return fit_platt(score, z, nonneg=False)[0] < 0


MIN_SLOPE = 0.05   # per standard deviation of the statistic: a floor, so never a constant


def fit_oriented_platt(score: np.ndarray, z: np.ndarray) -> tuple[tuple[float, float], dict]:
    """A Platt map whose orientation is chosen on this (the fitting) split and which is
    never a constant.

    The sign is the one under which the statistic ranks correct above wrong on this split
    (AUROC ≥ .5; for a baseline whose usual direction is a convention, such as mean
    log-prob or entropy, the data decide); the slope is then fitted ≥ MIN_SLOPE per
    standard deviation. Where the statistic carries no signal the map is nearly flat but
    still ranks, so its AUROC is measured, not .500 by construction. The log records
    both orientations' AUROC on the fitting split."""
    from heads.metrics import auroc

    s = np.asarray(score, float).ravel()
    z = np.asarray(z, float).ravel()
    varies = len(s) > 0 and s.max() > s.min()
    both = auroc(s, z) if 0 < z.mean() < 1 and varies else 0.5
    sign = 1.0 if both >= 0.5 else -1.0
    a, b = fit_platt(sign * s, z, min_slope=MIN_SLOPE if varies else 0.0)
    ab = (sign * a, b)
    return ab, {"slope": round(ab[0], 6), "intercept": round(ab[1], 6),
                "orientation": "as defined" if sign > 0 else "flipped",
                "fit_auroc_as_defined": round(float(both), 6),
                "fit_auroc_flipped": round(1 - float(both), 6)}


def platt_log(score: np.ndarray, z: np.ndarray, ab: tuple[float, float]) -> dict:
    """What the card records about a fitted Platt map."""
    return {"slope": round(ab[0], 6), "intercept": round(ab[1], 6),
            "inverted": platt_inverted(score, z)}


def platt(score: np.ndarray | float, ab: tuple[float, float]) -> np.ndarray:
    return 1 / (1 + np.exp(-(ab[0] * np.asarray(score, float) + ab[1])))


def fuse(p_pre: torch.Tensor, p_post: torch.Tensor) -> torch.Tensor:
    """p_DR = σ(½·logit(p_pre) + ½·logit(p_post)): no learned weights."""
    return torch.sigmoid(0.5 * logit(p_pre) + 0.5 * logit(p_post)).to(torch.as_tensor(p_pre).dtype)
