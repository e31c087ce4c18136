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


def fit_platt(score: np.ndarray, z: np.ndarray, nonneg: bool = True) -> tuple[float, float]:
    """(a, b) of p = σ(a·s + b), by logistic regression on a validation split.

    With `nonneg` (the default) the slope is constrained to a ≥ 0: every statistic is
    oriented so that higher means more confident, and a negative slope would silently
    invert it. When the data want a < 0 the fit stops at a = 0 (the base rate, no
    ranking) and `platt_inverted` says so.
    """
    from scipy.optimize import minimize

    s = np.asarray(score, float).ravel()
    z = np.asarray(z, float).ravel()
    if len(z) == 0 or z.min() == z.max():
        rate = z.mean() if len(z) else 0.5
        return 0.0, float(np.log((rate + EPS) / (1 - rate + EPS)))
    # centre and scale for the optimiser; mapped back below
    mu, sd = s.mean(), s.std() if s.std() > 0 else 1.0
    x = (s - mu) / sd

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        t = w[0] * x + w[1]
        # mean BCE with logits, numerically stable; tiny ridge as sklearn's C=1e4
        val = np.mean(np.logaddexp(0, t) - z * t) + 0.5e-4 * w[0] ** 2 / len(z)
        g = 1 / (1 + np.exp(-t)) - z
        return val, np.array([np.mean(g * x) + 1e-4 * w[0] / len(z), np.mean(g)])

    rate = z.mean()
    w0 = np.array([0.0, np.log(rate / (1 - rate))])
    bounds = [(0.0, None) if nonneg else (None, None), (None, None)]
    w = minimize(loss, w0, jac=True, method="L-BFGS-B", bounds=bounds).x
    a = w[0] / sd
    return float(a), float(w[1] - a * mu)


def platt_inverted(score: np.ndarray, z: np.ndarray) -> bool:
    """True when an unconstrained Platt fit wants a negative slope: the statistic ranks
    the wrong way round on this split."""
    return fit_platt(score, z, nonneg=False)[0] < 0


def platt_log(score: np.ndarray, z: np.ndarray, ab: tuple[float, float]) -> dict:
    """What the card records about a fitted Platt map."""
    return {"slope": round(ab[0], 6), "intercept": round(ab[1], 6),
            "inverted": platt_inverted(score, z)}


def platt(score: np.ndarray | float, ab: tuple[float, float]) -> np.ndarray:
    return 1 / (1 + np.exp(-(ab[0] * np.asarray(score, float) + ab[1])))


def fuse(p_pre: torch.Tensor, p_post: torch.Tensor) -> torch.Tensor:
    """p_DR = σ(½·logit(p_pre) + ½·logit(p_post)): no learned weights."""
    return torch.sigmoid(0.5 * logit(p_pre) + 0.5 * logit(p_post)).to(torch.as_tensor(p_pre).dtype)
