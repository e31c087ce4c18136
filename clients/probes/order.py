"""EMVR's evidence-order head (docs/method.md §4), numpy only: a linear head on
[h ; sequence log-confidence ; entropy] trained with BCE plus a hinge on adjacent logits
within a trajectory (a logit should not rise as evidence is removed), against the same
head trained with BCE only. Folds are grouped by question; heads are trained on mask
trajectories and tested out of fold on mask and on blur (an unseen degradation).

The actor's states are read offline by `collect` (given an actor object, so this module
does not import the model stack); `dualread fit-order-head` wires the two together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clients.probes.images import blur_region, mask_region
from clients.probes.stats import auroc, bootstrap, emvr, tvr


@dataclass
class Trajectories:
    """[n, K, F] features, [n, K] labels, per severity; one row per question."""

    x: np.ndarray
    z: np.ndarray
    groups: list[str]


@dataclass
class LinearHead:
    w: np.ndarray
    b: float
    mean: np.ndarray
    std: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.mean) / self.std) @ self.w + self.b


def _sigmoid(g: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-np.clip(g, -40, 40)))


def fit_head(x: np.ndarray, z: np.ndarray, order_weight: float = 0.0, margin: float = 0.0,
             l2: float = 1e-3, steps: int = 1000, lr: float = 1e-2, seed: int = 0
             ) -> LinearHead:
    """x [n, K, F] (severity order), z [n, K]. Loss: mean BCE over all states
    + order_weight · mean over adjacent pairs of max(0, margin − (g_k − g_{k+1}))
    + l2·|w|². Full-batch Adam."""
    n, k, f = x.shape
    flat = x.reshape(-1, f)
    mean, std = flat.mean(0), flat.std(0) + 1e-6
    xs = (x - mean) / std
    rng = np.random.default_rng(seed)
    w, b = rng.normal(0, 0.01, f), 0.0
    m_w, v_w, m_b, v_b = np.zeros(f), np.zeros(f), 0.0, 0.0
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):
        g = xs @ w + b                                          # [n, K]
        d = (_sigmoid(g) - z) / g.size                          # dBCE/dg
        if order_weight > 0 and k > 1:
            active = (margin - (g[:, :-1] - g[:, 1:])) > 0      # [n, K-1]
            coef = order_weight * active / active.size
            d[:, :-1] -= coef
            d[:, 1:] += coef
        gw = np.einsum("nk,nkf->f", d, xs) + 2 * l2 * w
        gb = float(d.sum())
        m_w, v_w = b1 * m_w + (1 - b1) * gw, b2 * v_w + (1 - b2) * gw ** 2
        m_b, v_b = b1 * m_b + (1 - b1) * gb, b2 * v_b + (1 - b2) * gb ** 2
        w -= lr * (m_w / (1 - b1 ** t)) / (np.sqrt(v_w / (1 - b2 ** t)) + eps)
        b -= lr * (m_b / (1 - b1 ** t)) / (np.sqrt(v_b / (1 - b2 ** t)) + eps)
    return LinearHead(w, float(b), mean, std)


def group_folds(groups: Sequence[str], folds: int, seed: int = 0) -> np.ndarray:
    """Fold index per row; every row of one group in the same fold (seeded)."""
    keys = sorted(set(groups))
    perm = np.random.default_rng(seed).permutation(len(keys))
    fold_of = {keys[i]: int(j % folds) for j, i in enumerate(perm)}
    return np.array([fold_of[g] for g in groups])


def compare(mask: Trajectories, blur: Trajectories, folds: int = 5, order_weight: float = 1.0,
            margin: float = 0.0, steps: int = 1000, resamples: int = 1000) -> dict:
    """Out-of-fold EMVR/TVR of BCE-only vs BCE + order heads, trained on mask, tested on
    mask and on blur, with paired bootstrap CIs (whole trajectories, seed 42)."""
    fold = group_folds(mask.groups, folds)
    oof = {m: {"mask": np.zeros(mask.z.shape), "blur": np.zeros(blur.z.shape)}
           for m in ("bce", "order")}
    for f in range(folds):
        tr, te = fold != f, fold == f
        if not te.any() or not tr.any():
            continue
        for name, wgt in (("bce", 0.0), ("order", order_weight)):
            head = fit_head(mask.x[tr], mask.z[tr], wgt, margin, steps=steps)
            oof[name]["mask"][te] = _sigmoid(head.logits(mask.x[te]))
            oof[name]["blur"][te] = _sigmoid(head.logits(blur.x[te]))
    out: dict = {"n_trajectories": len(mask.z), "folds": folds, "order_weight": order_weight,
                 "margin": margin}
    for test in ("mask", "blur"):
        a, b = oof["order"][test], oof["bce"][test]
        z = (mask if test == "mask" else blur).z
        out[test] = {"emvr_bce": emvr(b), "emvr_order": emvr(a), "tvr_bce": tvr(b),
                     "tvr_order": tvr(a), "auroc_bce": auroc(b, z), "auroc_order": auroc(a, z),
                     "brier_bce": float(((b - z) ** 2).mean()),
                     "brier_order": float(((a - z) ** 2).mean()),
                     "accuracy": float(z.mean()),
                     "order_minus_bce": emvr(a) - emvr(b),
                     "order_minus_bce_ci": bootstrap(len(a), lambda i, a=a, b=b:
                                                     emvr(a[i]) - emvr(b[i]), resamples, 42)}
    return out


def collect(actor, items: Sequence, severities: Sequence[float], batch: int = 32,
            max_new_tokens: int = 64) -> tuple[Trajectories, Trajectories]:
    """Mask and blur trajectories of the actor's readouts for items with a box:
    features [h_close ; mean answer log-prob ; mean answer entropy], label = correct."""
    from models.canon import is_correct

    jobs = []                                            # (row, variant, k, image)
    rows = [it for it in items if it.box]
    for r, it in enumerate(rows):
        img = it.image()
        for k, lam in enumerate(severities):
            if lam <= 0:                                 # the clean image starts both
                jobs.append((r, "clean", k, img))
                continue
            jobs.append((r, "mask", k, mask_region(img, it.box, lam)))
            jobs.append((r, "blur", k, blur_region(img, it.box, lam)))
    feats: dict[tuple[int, str, int], tuple[np.ndarray, float]] = {}
    for s in range(0, len(jobs), batch):
        part = jobs[s:s + batch]
        res = actor.answer([j[3] for j in part], [rows[j[0]].question for j in part],
                           max_new_tokens)
        for (r, var, k, _), resp in zip(part, res):
            ro = resp.readout
            lp, ent = ro.answer_logprobs, ro.token_entropy[ro.answer_index]
            x = np.concatenate([ro.h_close.float().cpu().numpy(),
                                [float(lp.mean()) if lp.numel() else 0.0,
                                 float(ent.mean()) if ent.numel() else 0.0]])
            z = float(is_correct(resp.answer, rows[r].answer, rows[r].options or None))
            for v in (("mask", "blur") if var == "clean" else (var,)):
                feats[(r, v, k)] = (x, z)
    out = []
    for var in ("mask", "blur"):
        x = np.stack([[feats[(r, var, k)][0] for k in range(len(severities))]
                      for r in range(len(rows))])
        z = np.array([[feats[(r, var, k)][1] for k in range(len(severities))]
                      for r in range(len(rows))])
        out.append(Trajectories(x, z, [it.id for it in rows]))
    return out[0], out[1]


def markdown(res: dict, command: str) -> str:
    def f(x) -> str:
        return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.3f}"

    lines = ["## Evidence-order head (SPEC §4)", "", f"`{command}`", "",
             f"{res['n_trajectories']} trajectories, {res['folds']} folds grouped by question; "
             "linear heads on [h_close ; mean answer log-prob ; mean answer entropy], trained "
             f"on mask trajectories (order weight {res['order_weight']}, margin "
             f"{res['margin']}); out-of-fold EMVR (lower is better).", "",
             "| test | EMVR BCE-only | EMVR BCE+order | order − BCE | 95% CI | TVR BCE-only | "
             "TVR BCE+order | AUROC BCE-only | AUROC BCE+order | Brier BCE-only | "
             "Brier BCE+order |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in ("mask", "blur"):
        r = res[t]
        lo, hi = r["order_minus_bce_ci"]
        lines.append(f"| {t} | {f(r['emvr_bce'])} | {f(r['emvr_order'])} | "
                     f"{f(r['order_minus_bce'])} | [{f(lo)}, {f(hi)}] | {f(r['tvr_bce'])} | "
                     f"{f(r['tvr_order'])} | {f(r['auroc_bce'])} | {f(r['auroc_order'])} | "
                     f"{f(r['brier_bce'])} | {f(r['brier_order'])} |")
    lines += ["", "Actor accuracy over all states: " + ", ".join(
        f"{t} {f(res[t]['accuracy'])}" for t in ("mask", "blur")) + "."]
    return "\n".join(lines) + "\n"
