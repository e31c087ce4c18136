"""Temperature scaling, Platt mapping and the DualRead log-odds fusion (SPEC §1)."""

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


def fit_platt(score: np.ndarray, z: np.ndarray) -> tuple[float, float]:
    """(a, b) of p = σ(a·s + b), by logistic regression on a validation split."""
    from sklearn.linear_model import LogisticRegression

    s = np.asarray(score, float).reshape(-1, 1)
    z = np.asarray(z, int)
    if z.min() == z.max():
        return 0.0, float(np.log((z.mean() + EPS) / (1 - z.mean() + EPS)))
    lr = LogisticRegression(C=1e4, max_iter=1000).fit(s, z)
    return float(lr.coef_[0, 0]), float(lr.intercept_[0])


def platt(score: np.ndarray | float, ab: tuple[float, float]) -> np.ndarray:
    return 1 / (1 + np.exp(-(ab[0] * np.asarray(score, float) + ab[1])))


def fuse(p_pre: torch.Tensor, p_post: torch.Tensor) -> torch.Tensor:
    """p_DR = σ(½·logit(p_pre) + ½·logit(p_post)): no learned weights."""
    return torch.sigmoid(0.5 * logit(p_pre) + 0.5 * logit(p_post)).to(torch.as_tensor(p_pre).dtype)
