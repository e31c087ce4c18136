"""`dualread fit-heads`: readouts once, image-disjoint splits, every registered method, one
artefact."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from rich.console import Console

from heads import registry
from heads.collect import Collector
from heads.defer import choose_threshold
from heads.dualread import DEFER_METHOD, Heads
from heads.metrics import METRICS
from heads.registry import FitData, Method
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


def splits_of(meta: dict) -> dict[str, torch.Tensor]:
    """Item indices of every split (image-disjoint), by name."""
    out = {s: _idx(meta, s) for s in SPLITS}
    out["reader_train"], out["reader_val"] = _idx(meta, "reader", "train"), \
        _idx(meta, "reader", "val")
    return out


def fit_methods(heads: Heads, data: FitData, methods: list[Method] | None = None) -> dict:
    """Fit each method in registration order; their log entries by method name."""
    log = {}
    for m in methods if methods is not None else registry.registered():
        entry = m.fit(heads, data)
        if entry is not None:
            log[m.name] = entry
    return log


def fit_heads(actor, items: list[Item], cache_dir: str | Path | None = None,
              target_risk: float = 0.05, delta: float = 0.1, seed: int = 0,
              max_new_tokens: int = 64) -> tuple[Heads, dict]:
    """Fit every registered method on image-disjoint splits, then the defer threshold τ."""
    methods = registry.registered()
    col = Collector(actor, cache_dir, max_new_tokens)
    on_all = registry.passes_for([m for m in methods if m.fit_passes_on == "all"])
    feats, meta = col.run(items, passes=on_all, label="readouts (fit)")
    z = feats["z"]
    splits = splits_of(meta)
    for name in SPLITS:
        ix = splits[name]
        if len(ix) == 0 or z[ix].min() == z[ix].max():
            raise ValueError(f"the {name} split needs both correct and wrong answers; "
                             f"give more data (it has {len(ix)} items)")
    # Reader weights start from the seed; every fit that draws random numbers reseeds.
    torch.manual_seed(seed)
    heads = Heads.new(feats["h_pre"].shape[1])
    heads.actor_fingerprint = actor.fingerprint
    # Passes too costly for every item (K samples) run on the one split that needs them.
    scoped = {}
    for split in dict.fromkeys(m.fit_passes_on for m in methods
                               if m.fit_passes_on not in (None, "all")):
        need = registry.passes_for([m for m in methods if m.fit_passes_on == split])
        sub = [items[i] for i in splits[split].tolist()]
        scoped[split], _ = Collector(actor, cache_dir, max_new_tokens).run(
            sub, passes=need, label=f"{', '.join(need)} ({split} split)")
    data = FitData(feats, z, splits, scoped, seed)
    log = fit_methods(heads, data, methods)
    # Defer policy on its own calibration split.
    df = splits["defer"]
    scores = heads.score(data.on("defer"))
    heads.policy = choose_threshold(scores[DEFER_METHOD], z[df].numpy(), target_risk, delta)
    held = {}
    for name, c in scores.items():
        held[name] = {m: round(fn(c, z[df].numpy()), 4) for m, fn in METRICS.items()}
    info = {
        "splits": {"reader": len(splits["reader"]), "reader_train": len(splits["reader_train"]),
                   "reader_val": len(splits["reader_val"]),
                   "temperature": len(splits["temperature"]), "defer_calibration": len(df),
                   "rule": "sha256(image_id) bins: 60% reader / 20% temperature / 20% defer"},
        "accuracy": round(float(z.mean()), 4),
        "fit_log": log,
        "defer_split_metrics": held,
        "seconds": dict(col.seconds),
    }
    console.log(f"fitted heads: AUROC on defer split {held[DEFER_METHOD]['auroc']}, "
                f"ECE-15 {held[DEFER_METHOD]['ece']}, tau {heads.policy.tau:.3f}, "
                f"coverage {heads.policy.coverage:.3f}")
    return heads, info


def summary_table(held: dict) -> str:
    rows = ["| method | AUROC | ECE-15 | Brier |", "|---|---|---|---|"]
    for name, m in held.items():
        rows.append(f"| {name} | {m['auroc']:.3f} | {m['ece']:.3f} | {m['brier']:.3f} |")
    return "\n".join(rows)

