"""`dualread fit-heads`: readouts once, image-disjoint splits, every head, one artefact."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from rich.console import Console

from heads.calibration import fit_platt, fit_temperature, logit
from heads.collect import Collector
from heads.defer import choose_threshold
from heads.dualread import Heads
from heads.metrics import METRICS
from heads.modules import fit_linear, fit_mlp
from models.data import Item

console = Console(stderr=True)
SPLITS = {"reader": 0.6, "temperature": 0.8, "defer": 1.0}   # cumulative shares of images


def image_split(image_id: str, salt: str = "dualread") -> str:
    """Deterministic image-disjoint split: hash of the image id."""
    u = int(hashlib.sha256((salt + image_id).encode()).hexdigest()[:8], 16) / 16 ** 8
    return next(name for name, edge in SPLITS.items() if u < edge)


def _idx(meta: dict, split: str, sub: str | None = None) -> torch.Tensor:
    out = []
    for k, img in enumerate(meta["image_ids"]):
        if image_split(img) != split:
            continue
        if sub is not None and (image_split(img, "es") == "defer") != (sub == "val"):
            continue
        out.append(k)
    return torch.tensor(out, dtype=torch.long)


def fit_heads(actor, items: list[Item], cache_dir: str | Path | None = None,
              target_risk: float = 0.05, delta: float = 0.1, seed: int = 0,
              max_new_tokens: int = 64) -> tuple[Heads, dict]:
    """Fit PSR, P-State, P-Visual, baselines' readers, temperatures, Platt maps and τ."""
    torch.manual_seed(seed)
    col = Collector(actor, cache_dir, max_new_tokens)
    feats, meta = col.run(items, extras=("bicr",), label="readouts (fit)")
    z = feats["z"]
    rd, tp, df = (_idx(meta, s) for s in SPLITS)
    rd_tr, rd_val = _idx(meta, "reader", "train"), _idx(meta, "reader", "val")
    for name, ix in (("reader", rd), ("temperature", tp), ("defer", df)):
        if len(ix) == 0 or z[ix].min() == z[ix].max():
            raise ValueError(f"the {name} split needs both correct and wrong answers; "
                             f"give more data (it has {len(ix)} items)")
    heads = Heads.new(feats["h_pre"].shape[1])
    heads.actor_fingerprint = actor.fingerprint
    log = {}
    # PSR first, independently: MLP, class-weighted BCE, early stopping on held-out images.
    log["psr"] = fit_mlp(heads.psr, feats["h_pre"][rd_tr], z[rd_tr], feats["h_pre"][rd_val],
                         z[rd_val], seed=seed)
    # P-State, fitted then frozen; P-Visual on the residual.
    log["p_state"] = fit_linear(heads.state, feats["h_close"][rd], z[rd])
    with torch.no_grad():
        l_state = heads.state(feats["h_close"][rd])
    log["p_visual"] = fit_linear(heads.visual, feats["phi"][rd], z[rd], offset=l_state)
    heads.offsets["psr"] = log["psr"]["prior_offset"]
    log["saplma"] = fit_mlp(heads.saplma, feats["h_mid"][rd_tr], z[rd_tr],
                            feats["h_mid"][rd_val], z[rd_val], seed=seed)
    bicr_x = torch.cat([feats["h_close"], feats["h_close"] - feats["h_close_black"]], -1)
    log["bicr"] = fit_mlp(heads.bicr, bicr_x[rd_tr], z[rd_tr], bicr_x[rd_val], z[rd_val],
                          seed=seed)
    heads.offsets["saplma"] = log["saplma"]["prior_offset"]
    heads.offsets["bicr"] = log["bicr"]["prior_offset"]
    # Temperatures on the image-disjoint temperature split, everything else fixed.
    with torch.no_grad():
        lg = heads.logits({k: v[tp] for k, v in feats.items()})
        heads.t_pre = fit_temperature(lg["pre"], z[tp])
        heads.t_post = fit_temperature(lg["post"], z[tp])
        heads.t_state = fit_temperature(lg["state"], z[tp])
        heads.t_saplma = fit_temperature(heads.saplma_logits(feats["h_mid"][tp]), z[tp])
        heads.t_bicr = fit_temperature(
            heads.bicr_logits(feats["h_close"][tp], feats["h_close_black"][tp]), z[tp])
        heads.t_msp = fit_temperature(logit(feats["msp"][tp].flatten()).float(), z[tp])
    heads.platt["mean_token_logprob"] = fit_platt(feats["mean_logprob"][tp].flatten().numpy(),
                                                  z[tp].numpy())
    heads.platt["predictive_entropy"] = fit_platt(-feats["entropy"][tp].flatten().numpy(),
                                                  z[tp].numpy())
    # SC@K and semantic uncertainty are Platt-mapped on the same split (K samples each).
    tp_items = [items[i] for i in tp.tolist()]
    sfeats, _ = Collector(actor, cache_dir, max_new_tokens).run(
        tp_items, extras=("samples",), label="samples (SC/semantic)")
    for k in (2, 4, 8):
        heads.platt[f"sc{k}"] = fit_platt(sfeats[f"sc{k}"].numpy(), sfeats["z"].numpy())
    heads.platt["semantic"] = fit_platt(-sfeats["semantic"].numpy(), sfeats["z"].numpy())
    # Defer policy on its own calibration split.
    scores = heads.score({k: v[df] for k, v in feats.items()})
    heads.policy = choose_threshold(scores["dualread"], z[df].numpy(), target_risk, delta)
    held = {}
    for name, c in scores.items():
        held[name] = {m: round(fn(c, z[df].numpy()), 4) for m, fn in METRICS.items()}
    info = {
        "splits": {"reader": len(rd), "reader_train": len(rd_tr), "reader_val": len(rd_val),
                   "temperature": len(tp), "defer_calibration": len(df),
                   "rule": "sha256(image_id) bins: 60% reader / 20% temperature / 20% defer"},
        "accuracy": round(float(z.mean()), 4),
        "fit_log": log,
        "defer_split_metrics": held,
        "seconds": dict(col.seconds),
    }
    console.log(f"fitted heads: AUROC on defer split {held['dualread']['auroc']}, "
                f"ECE-15 {held['dualread']['ece']}, tau {heads.policy.tau:.3f}, "
                f"coverage {heads.policy.coverage:.3f}")
    return heads, info


def summary_table(held: dict) -> str:
    rows = ["| method | AUROC | ECE-15 | Brier |", "|---|---|---|---|"]
    for name, m in held.items():
        rows.append(f"| {name} | {m['auroc']:.3f} | {m['ece']:.3f} | {m['brier']:.3f} |")
    return "\n".join(rows)

