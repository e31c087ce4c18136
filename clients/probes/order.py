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

from clients.maths import aurc
from clients.probes.emvr import critical_box
from clients.probes.images import blur_region, mask_region
from clients.probes.runner import Config
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


ROWS = ("native", "bce", "order")
METRICS = ("emvr", "tvr", "auroc", "aurc", "brier")
MASK_FILL = Config.mask_fill   # the EMVR probe's default fill (the background estimate)
SMALL_RISE = 1e-3   # diagnostic only: EMVR counting rises larger than this
LOGPROB = -2        # the feature column holding the mean answer log-prob (see `collect`)


def native_confidence(t: Trajectories) -> np.ndarray:
    """The actor's native sequence confidence, exp(mean answer log-prob), read from the
    features the heads see: the EMVR paper's reference score. No fit, so its out-of-fold
    value is its input on every fold."""
    return np.exp(t.x[..., LOGPROB])


def _metric(name: str, c: np.ndarray, z: np.ndarray) -> float:
    if name == "emvr":
        return emvr(c)
    if name == "tvr":
        return tvr(c)
    if name == "auroc":
        return auroc(c, z)
    if name == "aurc":
        return aurc(c.ravel(), z.ravel())
    return float(((c - z) ** 2).mean())


def _applies(row: str, metric: str) -> bool:
    # native confidence is a score, not a probability of correctness: no Brier (the paper's
    # Table 2 leaves it out too)
    return not (row == "native" and metric == "brier")


def summarise(conf: dict[str, np.ndarray], z: np.ndarray, resamples: int = 1000,
              seed: int = 42) -> dict:
    """Per row (native, bce, order) EMVR/TVR/AUROC/AURC/Brier of [n, K] confidences, and
    each row's difference to BCE-only with a paired bootstrap 95% CI: every resample draws
    whole trajectories (one question, all severities) and scores both rows on the same
    draw (seed fixed, so every metric and row sees the same draws)."""
    out: dict = {"accuracy": float(z.mean())}
    for row in ROWS:
        for m in METRICS:
            out[f"{m}_{row}"] = _metric(m, conf[row], z) if _applies(row, m) else None
        # a confidence pinned near 1 can "violate" by rises in the fourth decimal
        out[f"emvr_above_small_rise_{row}"] = emvr(conf[row], SMALL_RISE)
    for row in ("order", "native"):
        a, b = conf[row], conf["bce"]
        for m in METRICS:
            if not _applies(row, m):
                continue
            out[f"{m}_{row}_minus_bce"] = out[f"{m}_{row}"] - out[f"{m}_bce"]
            out[f"{m}_{row}_minus_bce_ci"] = bootstrap(
                len(a), lambda i, a=a, b=b, m=m: _metric(m, a[i], z[i]) - _metric(m, b[i], z[i]),
                resamples, seed)
    # the names earlier reports used for the headline difference
    out["order_minus_bce"] = out["emvr_order_minus_bce"]
    out["order_minus_bce_ci"] = out["emvr_order_minus_bce_ci"]
    return out


def compare(mask: Trajectories, blur: Trajectories, folds: int = 5, order_weight: float = 1.0,
            margin: float = 0.0, steps: int = 1000, resamples: int = 1000,
            with_confidences: bool = False) -> dict:
    """Out-of-fold BCE-only and BCE + order heads, trained on mask, tested on mask and on
    blur, next to the actor's native confidence on the same rows; `summarise` per test.
    With `with_confidences`, also the fold of each row and every row's confidence
    (`confidences`, for `trajectory_records`)."""
    fold = group_folds(mask.groups, folds)
    data = {"mask": mask, "blur": blur}
    oof = {t: {"native": native_confidence(d), "bce": np.zeros(d.z.shape),
               "order": np.zeros(d.z.shape)} for t, d in data.items()}
    for f in range(folds):
        tr, te = fold != f, fold == f
        if not te.any() or not tr.any():
            continue
        for name, wgt in (("bce", 0.0), ("order", order_weight)):
            head = fit_head(mask.x[tr], mask.z[tr], wgt, margin, steps=steps)
            for t, d in data.items():
                oof[t][name][te] = _sigmoid(head.logits(d.x[te]))
    out: dict = {"n_trajectories": len(mask.z), "folds": folds, "order_weight": order_weight,
                 "margin": margin, "resamples": resamples}
    for t, d in data.items():
        out[t] = summarise(oof[t], d.z, resamples)
    if with_confidences:
        out["confidences"] = {"fold": fold, **oof}
    return out


def trajectory_records(mask: Trajectories, blur: Trajectories, confidences: dict,
                       severities: Sequence[float]) -> list[dict]:
    """One record per question and test: its fold, and per severity the label and each
    row's out-of-fold confidence (full floats, so the report recomputes exactly)."""
    recs = []
    for t, d in (("mask", mask), ("blur", blur)):
        for r, qid in enumerate(d.groups):
            recs.append({"id": qid, "test": t, "fold": int(confidences["fold"][r]),
                         "severities": [float(s) for s in severities],
                         "correct": [int(v) for v in d.z[r]],
                         **{row: [float(v) for v in confidences[t][row][r]] for row in ROWS}})
    return recs


def summarise_records(records: Sequence[dict], resamples: int = 1000) -> dict[str, dict]:
    """`summarise` per test from `trajectory_records` (e.g. read back from the JSONL)."""
    out = {}
    for t in ("mask", "blur"):
        rs = [r for r in records if r["test"] == t]
        z = np.array([r["correct"] for r in rs], float)
        out[t] = summarise({row: np.array([r[row] for r in rs], float) for row in ROWS}, z,
                           resamples)
    return out


def collect(actor, items: Sequence, severities: Sequence[float], batch: int = 32,
            max_new_tokens: int = 64, fill: str = MASK_FILL
            ) -> tuple[Trajectories, Trajectories]:
    """Mask and blur trajectories of the actor's readouts for items with a critical box:
    features [h_close ; mean answer log-prob ; mean answer entropy], label = correct.
    The box and the mask are the EMVR probe's own (`critical_box`, `mask_region` with its
    default fill), so the head trains and tests on the masks EMVR measures."""
    from models.canon import is_correct

    jobs = []                                            # (row, variant, k, image)
    rows, boxes = [], []
    for it in items:
        box = critical_box(it)
        if box is not None:
            rows.append(it)
            boxes.append(box)
    for r, (it, box) in enumerate(zip(rows, boxes)):
        img = it.image()
        for k, lam in enumerate(severities):
            if lam <= 0:                                 # the clean image starts both
                jobs.append((r, "clean", k, img))
                continue
            jobs.append((r, "mask", k, mask_region(img, box, lam, fill)))
            jobs.append((r, "blur", k, blur_region(img, box, lam)))
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

    def ci(r: dict, key: str) -> str:
        if r.get(key) is None:
            return "–"
        lo, hi = r[key + "_ci"]
        return f"{f(r[key])} [{f(lo)}, {f(hi)}]"

    names = {"native": "native confidence", "bce": "BCE-only head", "order": "BCE + order head"}
    lines = ["## Evidence-order head (docs/method.md §4)", "", f"`{command}`", "",
             f"{res['n_trajectories']} trajectories, {res['folds']} folds grouped by question; "
             "linear heads on [h_close ; mean answer log-prob ; mean answer entropy], trained "
             f"on mask trajectories (order weight {res['order_weight']}, margin "
             f"{res['margin']}), out-of-fold confidences; native confidence = exp(mean answer "
             "log-prob), the actor's own score (no fit; the paper's reference row; no Brier: "
             "it is a score, not a probability of correctness). Lower is better for EMVR, TVR, "
             "AURC, Brier. Per-trajectory confidences: `trajectories.jsonl`.", ""]
    for t in ("mask", "blur"):
        r = res[t]
        lines += [f"### {t} ({'trained on, out of fold' if t == 'mask' else 'unseen'})", "",
                  "| row | EMVR | TVR | AUROC | AURC | Brier |", "|---|---|---|---|---|---|"]
        for row in ROWS:
            lines.append(f"| {names[row]} | " + " | ".join(
                f(r[f"{m}_{row}"]) for m in METRICS) + " |")
        for row in ("order", "native"):
            lines.append(f"| {names[row]} − BCE-only [95% CI] | " + " | ".join(
                ci(r, f"{m}_{row}_minus_bce") for m in METRICS) + " |")
        lines += ["", f"Actor accuracy over all states: {f(r['accuracy'])}. Diagnostic, not "
                  f"EMVR: counting only rises larger than {SMALL_RISE:g}, EMVR is " + ", ".join(
                      f"{names[row]} {f(r[f'emvr_above_small_rise_{row}'])}" for row in ROWS)
                  + ".", ""]
    lines.append(f"CIs: paired bootstrap over whole trajectories ({res.get('resamples', 1000)} "
                 "resamples, seed 42, the same draws for every row and metric).")
    return "\n".join(lines) + "\n"
