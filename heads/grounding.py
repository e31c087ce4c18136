"""Grounding in `evaluate`, on the same frozen readouts as the calibration table.

- CCG-AUC (docs/method.md §2) for every method: each evaluated item gets a donor from
  `HardNegativeIndex` over the evaluated items (assigned before anything is scored); the
  actor's run on (donor image, same question) is the donor item's own run when the
  question text is identical, else one extra run on that pair. Natural and strict
  CCG-AUC, the decisive set, source-image-cluster CIs, and an underpowered flag that
  counts the source *and* the donor images of the decisive set.
- AUROC per answer type (yes/no, colour, shape), by the canonical gold answer.
- Paired image-cluster bootstrap of DualRead − each other method, for AUROC and CCG-AUC.
- The defer policy of the heads applied to the evaluated data.

The maths is the numpy one of `clients.maths` (the probes use the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from clients.maths import Pair, ccg_auc, decisive, resample_clusters_counted
from heads.metrics import auroc
from models.canon import canon
from models.data import COLOURS, SHAPES, HardNegativeIndex, Item

UNDERPOWERED_IMAGES = 30   # docs/method.md §2: E must span at least this many independent images


def answer_type(gold: str) -> str:
    """yes/no, colour or shape by the canonical gold answer; anything else is other."""
    g = canon(gold)
    if g in ("yes", "no"):
        return "yes/no"
    if g in COLOURS:
        return "colour"
    if g in SHAPES:
        return "shape"
    return "other"


def auroc_by_type(c: np.ndarray, z: np.ndarray, types: Sequence[str]) -> dict[str, dict]:
    """AUROC (NaN with one class only) and n within each answer type."""
    types = np.asarray(types)
    out = {}
    for t in sorted(set(types.tolist())):
        m = types == t
        out[t] = {"auroc": auroc(c[m], z[m]), "n": int(m.sum()),
                  "accuracy": float(np.mean(z[m]))}
    return out


@dataclass(frozen=True)
class DonorPlan:
    """For each evaluated item with a donor: where its donor run comes from."""

    source: list[int]          # index of the source item
    donor: list[Item]          # the donor item (its image and its gold answer)
    reuse: list[int | None]    # index of the donor's own run, or None (an extra run)


def plan_donors(items: list[Item], seed: int = 0) -> DonorPlan:
    """Donors assigned, deterministically, before any confidence is scored."""
    index = HardNegativeIndex(items, seed)
    pos = {it.id: k for k, it in enumerate(items)}
    src, donors, reuse = [], [], []
    for k, it in enumerate(items):
        d = index.assign(it)
        if d is None:
            continue
        src.append(k)
        donors.append(d)
        # same question text: the actor's run on (donor image, q) is the donor's own run
        reuse.append(pos[d.id] if d.question == it.question else None)
    return DonorPlan(src, donors, reuse)


def extra_items(items: list[Item], plan: DonorPlan) -> list[Item]:
    """Items to run for donors whose question text differs: donor image, source question,
    donor gold answer."""
    out = []
    for k, d, r in zip(plan.source, plan.donor, plan.reuse):
        if r is None:
            it = items[k]
            out.append(replace(d, id=f"{it.id}@hn:{d.id}", question=it.question))
    return out


@dataclass
class DonorRuns:
    """Correctness, canonical answer and every method's confidence on each donor run."""

    z: np.ndarray
    canonical: list[str]
    scores: dict[str, np.ndarray]
    image_ids: list[str]


def donor_runs(plan: DonorPlan, z: np.ndarray, canonical: list[str],
               scores: dict[str, np.ndarray], z_extra: np.ndarray, canonical_extra: list[str],
               scores_extra: dict[str, np.ndarray]) -> DonorRuns:
    """Gather each pair's donor run from the evaluated items or from the extra runs."""
    zs, cans, order = [], [], []
    e = 0
    for r in plan.reuse:
        if r is not None:
            zs.append(z[r])
            cans.append(canonical[r])
            order.append(("main", r))
        else:
            zs.append(z_extra[e])
            cans.append(canonical_extra[e])
            order.append(("extra", e))
            e += 1
    out = {}
    for m, c in scores.items():
        ce = scores_extra.get(m, np.zeros(0))
        out[m] = np.array([c[i] if where == "main" else ce[i] for where, i in order], float)
    return DonorRuns(np.asarray(zs, int), cans, out, [d.image_id for d in plan.donor])


def pairs_for(plan: DonorPlan, items: list[Item], z: np.ndarray, canonical: list[str],
              c: np.ndarray, runs: DonorRuns, method: str) -> list[Pair]:
    out = []
    for j, k in enumerate(plan.source):
        same = canonical[k] == runs.canonical[j] and canonical[k] != ""
        out.append(Pair(items[k].id, items[k].image_id, bool(z[k]), bool(runs.z[j]),
                        float(c[k]), float(runs.scores[method][j]), bool(same)))
    return out


def ccg_summary(pairs: list[Pair], donor_images: list[str], bootstrap: int = 1000,
                seed: int = 42) -> dict:
    """Natural and strict CCG-AUC with source-image-cluster CIs, |P|, |E|, |E_strict|,
    and the underpowered flag counting source and donor images of E."""
    out: dict = {"n_eligible": len(pairs)}
    for tag, strict in (("natural", False), ("strict", True)):
        e = decisive(pairs, strict)
        keep = {id(p) for p in e}
        donors = {d for p, d in zip(pairs, donor_images) if id(p) in keep}
        sources = {p.image_id for p in e}
        out[f"ccg_{tag}"] = ccg_auc(pairs, strict)
        out[f"ccg_{tag}_n_decisive"] = len(e)
        out[f"ccg_{tag}_source_images"] = len(sources)
        out[f"ccg_{tag}_donor_images"] = len(donors)
        out[f"ccg_{tag}_underpowered"] = min(len(sources), len(donors)) < UNDERPOWERED_IMAGES
        if bootstrap:
            lo, hi, nan = resample_clusters_counted(
                [p.image_id for p in pairs], lambda idx, s=strict: ccg_auc(
                    [pairs[i] for i in idx], s), bootstrap, seed)
            out[f"ccg_{tag}_ci"] = (lo, hi)
            out[f"ccg_{tag}_ci_nan_resamples"] = nan
    return out


def paired_diff(clusters: Sequence[str], stat_a, stat_b, bootstrap: int = 1000,
                seed: int = 42) -> dict:
    """Point difference stat_a − stat_b on all items, and its 95% CI from one paired
    cluster bootstrap (the same resampled images for both)."""
    every = np.arange(len(clusters))
    diff = stat_a(every) - stat_b(every)
    out = {"diff": float(diff)}
    if bootstrap:
        lo, hi, nan = resample_clusters_counted(
            clusters, lambda idx: stat_a(idx) - stat_b(idx), bootstrap, seed)
        out["ci"], out["nan_resamples"] = (lo, hi), nan
    return out


def paired_vs(ref: str, scores: dict[str, np.ndarray], z: np.ndarray, clusters: list[str],
              pairs: dict[str, list[Pair]], bootstrap: int = 1000) -> dict[str, dict]:
    """DualRead (or `ref`) minus each other method: AUROC over items (clusters: images) and
    CCG-AUC over eligible pairs (clusters: source images)."""
    out = {}
    pc = [p.image_id for p in pairs.get(ref, [])]
    for m in scores:
        if m == ref:
            continue
        row = {"auroc": paired_diff(clusters, lambda i: auroc(scores[ref][i], z[i]),
                                    lambda i, m=m: auroc(scores[m][i], z[i]), bootstrap)}
        if pairs.get(ref) and pairs.get(m):
            a, b = pairs[ref], pairs[m]
            row["ccg_natural"] = paired_diff(
                pc, lambda i, a=a: ccg_auc([a[k] for k in i]),
                lambda i, b=b: ccg_auc([b[k] for k in i]), bootstrap)
        out[m] = row
    return out


def defer_on(z: np.ndarray, reasons: dict[str, np.ndarray], tau: float,
             target_risk: float) -> dict:
    """The heads' defer rule on the evaluated data: coverage, risk among kept answers,
    whether that risk is within r, and the share of items each reason defers.

    `reasons` holds one boolean array per reason (`Heads.defer_reasons`: "tau",
    "novelty", "problem"); an item is kept when none holds. Leave "novelty" out for heads
    without a detector. An item can be deferred for several reasons, so the shares may add
    up to more than 1 − coverage."""
    z = np.asarray(z)
    flags = {k: np.asarray(v, bool) for k, v in reasons.items()}
    deferred = np.zeros(len(z), bool)
    for v in flags.values():
        deferred |= v
    kept = ~deferred

    def share(x: np.ndarray) -> float:
        return float(x.mean()) if len(x) else float("nan")

    out: dict = {"deferred_share": {k: share(v) for k, v in flags.items()}}
    if "novelty" in flags:
        out["novelty_flag_rate"] = share(flags["novelty"])
    if "tau" in flags:
        out["coverage_tau_only"] = share(~flags["tau"])
    risk = float(1 - np.mean(z[kept])) if kept.any() else float("nan")
    return {"tau": float(tau), "target_risk": float(target_risk),
            "coverage": share(kept), "risk": risk, "n_kept": int(kept.sum()),
            "risk_within_target": bool(kept.any() and risk <= target_risk), **out}
