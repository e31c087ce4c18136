"""`dualread fit-heads`: readouts once, image-disjoint splits, every registered method, one
artefact."""

from __future__ import annotations

import subprocess
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from heads import registry
from heads.collect import Collector
from heads.defer import choose_threshold
from heads.detectors import AUGMENT_PER_FAMILY, DETECTOR_ALPHA, detector_stage
from heads.dualread import DEFER_METHOD, Heads
from heads.metrics import METRICS
from heads.novelty import ALPHA, SHIPPED_FEATURE, SHIPPED_KIND, Novelty, features
from heads.registry import FitData, Method
from heads.splits import SPLITS, image_split, splits_of  # noqa: F401  (older import site)
from models.data import Item, normalise_question
from models.shift import FAMILIES
from models.shift import per_family as per_family_items

console = Console(stderr=True)
# corrupted copies of reader-split items per corruption family for the novelty detector
# (the shift study's pool: 250 per family)
NOVELTY_PER_FAMILY = 250


def fit_methods(heads: Heads, data: FitData, methods: list[Method] | None = None) -> dict:
    """Fit each method in registration order; their log entries by method name."""
    log = {}
    for m in methods if methods is not None else registry.registered():
        entry = m.fit(heads, data)
        if entry is not None:
            log[m.name] = entry
    return log


# pragma: no mutate start (reached only through the tiny actors: docs/testing.md)
def fit_heads(actor, items: list[Item], cache_dir: str | Path | None = None,
              target_risk: float = 0.05, delta: float = 0.1, seed: int = 0,
              max_new_tokens: int = 64, novelty: bool = True,
              novelty_per_family: int = AUGMENT_PER_FAMILY) -> tuple[Heads, dict]:
    """Fit every registered method on image-disjoint splits, then the defer threshold τ,
    then (with `novelty`) the novelty detector of the defer rule (docs/method.md §8,
    heads.detectors: image tokens and prompt state, fitted on clean data and benign
    re-encodings, `novelty_per_family` of each)."""
    methods = registry.registered()
    col = Collector(actor, cache_dir, max_new_tokens)
    on_all = registry.fit_passes_for(methods, "all")
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
        need = registry.fit_passes_for(methods, split)
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
        held[name]["bce"] = round(bce(c, z[df].numpy()), 5)
    novelty_log = None
    if novelty:
        heads.novelty, novelty_log = detector_stage(col, items, feats, splits,
                                                    novelty_per_family, seed)
        heads.novelty_alpha = DETECTOR_ALPHA
    prior = prior_check(scores, z.numpy(), {k: v.numpy() for k, v in splits.items()})
    info = {
        "splits": {"reader": len(splits["reader"]), "reader_train": len(splits["reader_train"]),
                   "reader_val": len(splits["reader_val"]),
                   "temperature": len(splits["temperature"]), "defer_calibration": len(df),
                   "rule": "sha256(image_id) bins: 60% reader / 20% temperature / 20% defer"},
        "accuracy": round(float(z.mean()), 4),
        "fit_log": log,
        "defer_split_metrics": held,
        "prior_check": prior,
        # the question-only baseline of `evaluate`: accuracy of each normalised question
        # form on the fitting data
        "question_prior": question_prior(items, z.numpy()),
        "novelty": novelty_log,
        "seconds": dict(col.seconds),
    }
    console.log(f"fitted heads: AUROC on defer split {held[DEFER_METHOD]['auroc']}, "
                f"ECE-15 {held[DEFER_METHOD]['ece']}, tau {heads.policy.tau:.3f}, "
                f"coverage {heads.policy.coverage:.3f}")
    return heads, info


# pragma: no mutate end
# ------------------------------------------------------------------ novelty stage
def novelty_items(items: list[Item], per_family: int = NOVELTY_PER_FAMILY, seed: int = 0
                  ) -> list[Item]:
    """Corrupted copies of `items`: for every family of `models.shift`, a deterministic
    sample of `per_family` of them (all when fewer), severities 1..5 in turn, as the shift
    study's pool was built."""
    return per_family_items(items, FAMILIES, per_family, seed + 100)


def fit_novelty(clean: dict, shifted: dict, calibration: dict) -> Novelty:
    """The shipped detector: logistic score, clean vs corrupted features, calibrated on a
    clean split disjoint from the fitting one (feature dicts with `extract`'s keys)."""
    nov = Novelty(SHIPPED_KIND, SHIPPED_FEATURE)
    nov.fit(features(nov.feature, clean), features(nov.feature, shifted))
    return nov.calibrate(features(nov.feature, calibration))


def _rows(feats: dict, idx) -> dict:
    idx = torch.as_tensor(idx, dtype=torch.long)
    return {k: v[idx] for k, v in feats.items()}


def clean_flag_rates(det: Novelty, x: torch.Tensor, first: torch.Tensor,
                     second: torch.Tensor, alpha: float) -> dict:
    """Flag rates at `alpha` of a detector calibrated on rows `first` + `second` of `x`:
    in sample (`calibration_flag_rate`), and out of sample (`cross_flag_rate`: calibrated
    on one of the two, read on the other, averaged over both directions; ≤ α expected)."""
    out: dict = {}
    cal = torch.cat([first, second])
    if len(cal):
        out["calibration_flag_rate"] = round(float((det.p_value(x[cal]) < alpha).mean()), 4)
    if len(first) and len(second):
        rates = [float((det.recalibrated(x[a]).p_value(x[b]) < alpha).mean())
                 for a, b in ((first, second), (second, first))]
        out["cross_flag_rate"] = round(float(np.mean(rates)), 4)
    return out


# pragma: no mutate start (reached only through the tiny actors: docs/testing.md)
def novelty_stage(col: Collector, items: list[Item], feats: dict, splits: dict,
                  per_family: int, seed: int = 0, alpha: float = ALPHA
                  ) -> tuple[Novelty, dict]:
    """Readouts of corrupted reader-split items (cached by the collector), the detector
    fitted on them and calibrated on every clean item it was not fitted on (temperature
    and defer splits), and what the card logs."""
    from sklearn.metrics import roc_auc_score

    reader = [items[i] for i in splits["reader"].tolist()]
    shifted_items = novelty_items(reader, per_family, seed)
    shifted, _ = col.run(shifted_items, label="readouts (novelty, corrupted reader items)")
    # Neither split is used by the detector's fit (the temperature split fits the readers'
    # temperatures, not this), so both calibrate it: a clean input's flag rate is at most
    # α over calibration draws (approximately: rows are questions, several per image), and
    # one draw's error shrinks with its size.
    tmp, dfr = splits["temperature"], splits["defer"]
    cal = torch.cat([tmp, dfr])
    nov = fit_novelty(_rows(feats, splits["reader"]), shifted, _rows(feats, cal))
    log: dict = {"per_family": per_family, "n_shifted": len(shifted_items),
                 "families": list(FAMILIES), "severities": "1..5 in turn",
                 "fitted_on": "clean reader split vs corrupted copies of reader-split items",
                 "calibrated_on": "clean temperature and defer splits",
                 # with n calibration scores no p-value is below 1/(n + 1): under 99 clean
                 # items the detector can never flag at α = 0.01
                 "smallest_p_value": round(1 / (len(cal) + 1), 6)}
    if log["smallest_p_value"] >= alpha:
        console.log(f"[yellow]novelty detector: {len(cal)} calibration items "
                    f"cannot give a p-value below alpha {alpha}; it will never flag[/yellow]")
    log.update(clean_flag_rates(nov, features(nov.feature, feats), tmp, dfr, alpha))
    # held-out separation: refit on reader_train images, score reader_val images, clean
    # vs their corrupted copies (no extra readouts; the shipped detector uses all of them)
    val_imgs = {items[i].image_id for i in splits["reader_val"].tolist()}
    in_val = np.array([it.image_id in val_imgs for it in shifted_items])
    tr, va = splits["reader_train"], splits["reader_val"]
    if len(tr) and len(va) and in_val.any() and not in_val.all():
        probe = fit_novelty(_rows(feats, tr), _rows(shifted, np.nonzero(~in_val)[0]),
                            _rows(feats, va))
        s_clean = probe.score(features(probe.feature, _rows(feats, va)))
        s_shift = probe.score(features(probe.feature, _rows(shifted, np.nonzero(in_val)[0])))
        y = np.r_[np.zeros(len(s_clean)), np.ones(len(s_shift))]
        log["heldout_auroc"] = round(float(roc_auc_score(y, np.r_[s_clean, s_shift])), 4)
        log["heldout"] = "fitted on reader_train images, scored on reader_val images"
    console.log(f"novelty detector: {len(shifted_items)} corrupted readouts, held-out AUROC "
                f"{log.get('heldout_auroc')}, clean flag rate (cross-calibrated) "
                f"{log.get('cross_flag_rate')} at alpha {alpha}")
    return nov, log


# pragma: no mutate end
def bce(c: np.ndarray, z: np.ndarray) -> float:
    c = np.clip(np.asarray(c, float), 1e-6, 1 - 1e-6)
    z = np.asarray(z, float)
    return float(-np.mean(z * np.log(c) + (1 - z) * np.log(1 - c)))


def prior_check(scores: dict[str, np.ndarray], z: np.ndarray,
                splits: dict[str, np.ndarray]) -> dict:
    """BCE of each method that trains a reader, on the defer split (images no reader or
    temperature saw; `scores` are on it), against predicting there the base rate of the
    reader split (what a reader could learn from its own data without any feature). `z`:
    every item's label; `splits`: item indices per split."""
    from heads.modules import prior_bce

    z = np.asarray(z, float)
    rate = float(z[np.asarray(splits["reader"])].mean())
    z = z[np.asarray(splits["defer"])]
    base = prior_bce(rate, float(np.mean(z)))
    out = {"prior_rate": round(rate, 5), "prior_bce": round(base, 5), "worse": []}
    for m in registry.registered():
        if m.readers and m.predicts_correctness and m.name in scores:
            b = bce(scores[m.name], z)
            out[m.name] = round(b, 5)
            if not b < base:
                out["worse"].append(m.name)
    return out


class WorseThanPrior(ValueError):
    """A fitted reader predicts held-out correctness worse than the base rate does."""


def refuse_worse_than_prior(info: dict) -> None:
    """`fit-heads` ships no reader whose held-out BCE is not below the prior's."""
    pc = info["prior_check"]
    if pc["worse"]:
        rows = ", ".join(f"{m} {pc[m]:.4f}" for m in pc["worse"])
        raise WorseThanPrior(
            f"refusing to ship: on the defer-calibration images these readers are no better "
            f"than predicting the base rate {pc['prior_rate']:.3f} (BCE {pc['prior_bce']:.4f}):"
            f" {rows}. Give more fitting data or check the fitting.")


def question_prior(items: list[Item], z: np.ndarray) -> dict[str, list[int]]:
    """[correct, total] per normalised question on the fitting data."""
    right, total = Counter(), Counter()
    for it, ok in zip(items, z):
        q = normalise_question(it.question)
        total[q] += 1
        right[q] += int(ok)
    return {q: [right[q], total[q]] for q in sorted(total)}


def question_only(table: dict[str, list[int]], questions: list[str]) -> np.ndarray:
    """The question-only confidence: Laplace-smoothed accuracy of the question's normalised
    form on the fitting data; the overall accuracy for a form never seen."""
    k = sum(v[0] for v in table.values())
    n = sum(v[1] for v in table.values())
    overall = (k + 1) / (n + 2)
    out = []
    for q in questions:
        r = table.get(normalise_question(q))
        out.append((r[0] + 1) / (r[1] + 2) if r else overall)
    return np.asarray(out, float)


def git_describe(cwd: str | Path | None = None) -> dict:
    """`git describe --always --dirty` of the tree the code runs from, and whether it is
    dirty (a card naming a commit must be reproducible from that commit)."""
    cwd = Path(cwd) if cwd else Path(__file__).parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, cwd=cwd, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"describe": "unknown", "dirty": None}
    return {"describe": out, "dirty": out.endswith("-dirty")}


class DirtyTree(RuntimeError):
    """Heads would be fitted from uncommitted code."""


def check_tree(allow_dirty: bool = False, cwd: str | Path | None = None) -> dict:
    """The tree's description; refuses a dirty tree unless allowed (then warns)."""
    g = git_describe(cwd)
    if g["dirty"]:
        msg = (f"the working tree is dirty ({g['describe']}): the card could not name the code "
               "that fitted it")
        if not allow_dirty:
            raise DirtyTree(msg + "; commit first, or pass --allow-dirty")
        warnings.warn(msg, stacklevel=2)
    return g


def summary_table(held: dict) -> str:
    rows = ["| method | AUROC | ECE-15 | Brier |", "|---|---|---|---|"]
    for name, m in held.items():
        rows.append(f"| {name} | {m['auroc']:.3f} | {m['ece']:.3f} | {m['brier']:.3f} |")
    return "\n".join(rows)

