"""Small readers on frozen features and how they are fitted (docs/method.md §1, §7).

Inputs are standardised with statistics of the fitting split (kept as buffers), so a
"linear head" stays linear in the raw state while the optimiser sees a sane scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Standardise(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def fit(self, x: torch.Tensor) -> Standardise:
        self.mean.copy_(x.mean(0))
        self.std.copy_(x.std(0).clamp_min(1e-4))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class Reader(nn.Module):
    """Standardise then an MLP (hidden sizes given) or a linear map; returns logits [N]."""

    def __init__(self, dim: int, hidden: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.norm = Standardise(dim)
        layers: list[nn.Module] = []
        width = dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(0.1)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.dim, self.hidden = dim, hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x)).squeeze(-1)


PSR_HIDDEN = (256, 128)
SAPLMA_HIDDEN = (256, 128, 64)
BICR_HIDDEN = (256, 128)


def fit_mlp(reader: Reader, x: torch.Tensor, z: torch.Tensor, x_val: torch.Tensor,
            z_val: torch.Tensor, lr: float = 1e-3, weight_decay: float = 1e-4,
            max_epochs: int = 200, patience: int = 10, batch: int = 256, seed: int = 0
            ) -> dict:
    """Class-weighted BCE with early stopping on a held-out split (best epoch kept)."""
    torch.manual_seed(seed)
    reader.norm.fit(x)
    pos = z.float().mean().clamp(1e-3, 1 - 1e-3)
    pos_weight = (1 - pos) / pos
    opt = torch.optim.AdamW(reader.parameters(), lr=lr, weight_decay=weight_decay)
    best, best_state, bad, epochs = float("inf"), None, 0, 0
    for _ in range(max_epochs):
        epochs += 1
        reader.train()
        perm = torch.randperm(len(x))
        for s in range(0, len(x), batch):
            i = perm[s: s + batch]
            loss = F.binary_cross_entropy_with_logits(reader(x[i]), z[i].float(),
                                                      pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
        reader.eval()
        with torch.no_grad():
            val = F.binary_cross_entropy_with_logits(reader(x_val), z_val.float(),
                                                     pos_weight=pos_weight).item()
        if val < best - 1e-5:
            best, bad = val, 0
            best_state = {k: v.clone() for k, v in reader.state_dict().items()}
        else:
            bad += 1
            if bad >= patience:
                break
    if best_state is not None:
        reader.load_state_dict(best_state)
    reader.eval()
    # Class weighting shifts the optimal logit by log(pos_weight); this undoes it exactly,
    # so temperature scaling starts from logits of the real class balance.
    return {"epochs": epochs, "val_bce": round(best, 5),
            "prior_offset": float(-torch.log(pos_weight))}


def fit_linear(reader: Reader, x: torch.Tensor, z: torch.Tensor,
               offset: torch.Tensor | None = None, steps: int = 1000, lr: float = 1e-3,
               l2: float = 1e-3, weight: torch.Tensor | None = None) -> dict:
    """BCE + L2, full batch, fixed steps (docs/method.md §1: 1000 steps, lr 1e-3).

    With `offset` the reader fits the residual: ℓ = offset + reader(x) (P-Visual on top of
    a frozen P-State). `weight` weighs each row's BCE (a weighted mean; default equal).
    """
    reader.norm.fit(x)
    base = torch.zeros(len(x)) if offset is None else offset.detach()
    w_row = torch.ones(len(x)) if weight is None else weight.float() / weight.float().mean()
    # Start the bias at the prior log-odds (a residual starts at 0: its offset carries the
    # prior): on standardised inputs Adam at lr 1e-3 moves a bias by about 1 in 1000 steps,
    # while a 92% base rate needs ≈ 2.5, so from 0 the head ended worse than the base rate.
    with torch.no_grad():
        prior = (w_row * z.float()).mean().clamp(1e-4, 1 - 1e-4)
        bias0 = torch.log(prior / (1 - prior)) if offset is None else torch.zeros(())
        reader.net[-1].bias.fill_(float(bias0))
        reader.net[-1].weight.zero_()
    opt = torch.optim.Adam(reader.parameters(), lr=lr)
    reader.train()
    for _ in range(steps):
        logits = base + reader(x)
        w = reader.net[-1].weight
        loss = F.binary_cross_entropy_with_logits(logits, z.float(), weight=w_row) \
            + l2 * (w ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    reader.eval()
    with torch.no_grad():
        bce = F.binary_cross_entropy_with_logits(base + reader(x), z.float(),
                                                 weight=w_row).item()
    return {"steps": steps, "train_bce": round(bce, 5),
            "prior_bce": round(prior_bce(float(prior)), 5)}


def fit_logistic(reader: Reader, x: torch.Tensor, z: torch.Tensor, c: float = 1.0) -> dict:
    """A linear reader fitted to convergence (L-BFGS, scikit-learn's LogisticRegression, L2
    with inverse strength `c` on the standardised inputs, classes weighed equally)."""
    from sklearn.linear_model import LogisticRegression

    if reader.hidden:
        raise ValueError("fit_logistic fits linear readers only")
    reader.norm.fit(x)
    with torch.no_grad():
        xs = reader.norm(x).double().numpy()
    lr = LogisticRegression(C=c, class_weight="balanced", max_iter=5000).fit(xs, z.numpy())
    with torch.no_grad():
        reader.net[-1].weight.copy_(torch.from_numpy(lr.coef_).float())
        reader.net[-1].bias.fill_(float(lr.intercept_[0]))
    reader.eval()
    return {"solver": "lbfgs", "C": c, "iterations": int(lr.n_iter_[0])}


def prior_bce(rate: float, z_rate: float | None = None) -> float:
    """BCE of predicting the base rate `rate` on labels whose positive share is `z_rate`
    (the same labels by default): the bar every reader must beat."""
    r = min(max(rate, 1e-6), 1 - 1e-6)
    q = rate if z_rate is None else z_rate
    return float(-(q * math.log(r) + (1 - q) * math.log(1 - r)))
