"""Analysis half of `python -m studies.shift_study`: tables from cached readouts.

(1) the shipped heads per family × severity; (2) novelty scores, clean vs corrupted;
(3) leave-one-family-out: (a) novelty conformal p-value, (b) corruption-augmented heads,
(c) both, against the target of issue 11.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from heads import registry
from heads.defer import choose_threshold
from heads.dualread import Heads
from heads.fit import fit_methods, image_split
from heads.methods import dualread as dm
from heads.metrics import auroc, ece
from heads.novelty import Novelty, features, p_values
from heads.registry import FitData
from models.data import Item
from models.shift import FAMILIES

ALPHAS = (0.01, 0.05)
UNSUPERVISED = [(f, k) for f in ("h_pre", "h_close", "h_mid", "img_mean", "img_std",
                                 "img_mean_std", "pre_img_mean", "img_tokens", "pixels")
                for k in ("mahalanobis", "knn")] + [("img_token_set", "token_knn")]
SUPERVISED_FEATURE = "pre_img_mean_std"
# The registry methods whose fits set DualRead's readers and temperatures, in fitting order
DUALREAD_FITS = ("psr", "p_state", "per")
# docs/shift-study's approach (b) was fitted with post-answer L2 1e-3 and no answer flips.
# The shipped post branch has since moved (answer flips, POST_L2), so the study passes its
# own settings to the fits rather than inheriting whatever the service ships.
STUDY_POST = {"flip_weight": 0.0, "l2": 1e-3}
HEAD_KEYS = ("h_pre", "h_close", "phi", "h_mid", "msp", "mean_logprob", "entropy", "mu")


# ------------------------------------------------------------------ small pieces
def pixels(items: list[Item], side: int = 8) -> torch.Tensor:
    """A reference that is not the actor's: the image itself at 8×8 (what corrupts it)."""
    rows = [np.asarray(it.image().resize((side, side), Image.BOX), np.float64).ravel() / 255
            for it in items]
    return torch.tensor(np.stack(rows))


def feature(name: str, feats: dict) -> torch.Tensor:
    return feats["pixels"] if name == "pixels" else features(name, feats)


def cell(p: np.ndarray, z: np.ndarray, defer: np.ndarray) -> dict:
    keep = ~defer
    return {"n": int(len(z)), "accuracy": float(z.mean()), "ece": ece(p, z),
            "auroc": auroc(p, z), "defer_rate": float(defer.mean()),
            "n_kept": int(keep.sum()),
            "risk_kept": float(1 - z[keep].mean()) if keep.any() else float("nan")}


def meets(c: dict, r: float) -> bool:
    return c["defer_rate"] >= 0.9 or (c["n_kept"] > 0 and c["risk_kept"] <= 2 * r)


def subset(feats: dict, idx) -> dict:
    return {k: v[idx] for k, v in feats.items()}


def cat(parts: list[dict]) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def splits(meta: dict) -> np.ndarray:
    return np.array([image_split(i) for i in meta["image_ids"]])


# ------------------------------------------------------------------ (b) augmented heads
def study_methods(post: dict | None = None) -> list:
    """DUALREAD_FITS as the study fits them: the registry's PSR, and P-State/PER instances
    with the study's post-answer settings (`STUDY_POST` unless given)."""
    post = STUDY_POST if post is None else post
    return [dm.PState(**post) if n == "p_state" else dm.PER(**post) if n == "per"
            else registry.get(n) for n in DUALREAD_FITS]


class RefitDualRead:
    """DualRead's readers, temperatures and τ refitted by the registry's own fits
    (docs/method.md §1, `heads.fit.fit_methods` with PSR, P-State and PER, in registration
    order) on the study's split labels; τ on a clean defer split (its guarantee is for clean
    inputs)."""

    def __init__(self, dim: int) -> None:
        # Readers start from the global RNG state, as `fit_heads` creates them; only the
        # study's methods get readers (none left unfitted for PER to read).
        self.heads = Heads.new(dim, study_methods())
        self.tau = 1.5

    def p(self, f: dict) -> np.ndarray:
        return registry.get("dualread").score(self.heads, f)

    def fit(self, feats: dict, split: np.ndarray, clean_defer: dict, target_risk: float,
            delta: float, seed: int = 0) -> RefitDualRead:
        torch.manual_seed(seed)
        # PSR's early-stopping hold-out: the reader images `heads.fit` holds out
        es_val = np.array([image_split(i, "es") == "defer" for i in feats["_image_ids"]])
        reader = split == "reader"
        masks = {"reader": reader, "reader_train": reader & ~es_val,
                 "reader_val": reader & es_val, "temperature": split == "temperature"}
        splits = {k: torch.from_numpy(np.nonzero(m)[0]) for k, m in masks.items()}
        tensors = {k: v for k, v in feats.items() if torch.is_tensor(v)}
        # No `scoped` passes: the study caches natural readouts only, so no extra-pass rows
        # (answer flips) join the post-answer readers' fits.
        fit_methods(self.heads, FitData(tensors, feats["z"], splits, seed=seed),
                    study_methods())
        pol = choose_threshold(self.p(clean_defer), clean_defer["z"].numpy(), target_risk,
                               delta)
        self.tau = pol.tau
        return self


# ------------------------------------------------------------------ the analysis
def analyse(data: dict, sets: dict[str, list[Item]], out: Path, command: str = "") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    heads = Heads.load()
    tau, r, delta = heads.policy.tau, heads.policy.target_risk, heads.policy.delta
    dim = data["fit"][0]["h_pre"].shape[1]
    feats = {}
    for name, (f, m) in data.items():
        f = {k: f[k] for k in (*HEAD_KEYS, "z", "h_image")}
        f["pixels"] = pixels(sets[name])
        f["_image_ids"] = np.array(m["image_ids"])
        feats[name] = f
    tensors = {n: {k: v for k, v in f.items() if not k.startswith("_")}
               for n, f in feats.items()}
    fit_split = splits(data["fit"][1])
    fit = tensors["fit"]
    rd, tp, df = (np.nonzero(fit_split == s)[0] for s in ("reader", "temperature", "defer"))
    cells = [n for n in tensors if n.startswith("test")]
    fam_of = {n: n.split("~")[1].split(":")[0] if "~" in n else "clean" for n in cells}
    z = {n: tensors[n]["z"].numpy().astype(int) for n in tensors}
    p_dr = {n: heads.score(tensors[n])["dualread"] for n in tensors}
    report: dict = {"command": command, "tau": tau, "target_risk": r,
                    "n": {n: len(v) for n, v in z.items()},
                    "fit_splits": {"reader": len(rd), "temperature": len(tp),
                                   "defer": len(df)}}

    # (1) shipped heads, no novelty
    report["shipped"] = {n: cell(p_dr[n], z[n], p_dr[n] < tau) for n in cells}

    # (2) unsupervised novelty scores: fitted on clean reader, calibrated on clean defer
    pool_names = [n for n in tensors if n.startswith("pool~")]
    pool_split = {n: splits(data[n][1]) for n in pool_names}
    scorers, scores = {}, {}
    for fname, kind in UNSUPERVISED:
        key = f"{kind}:{fname}"
        # a token bank of 8,000 (a fixed random subsample) keeps token_knn affordable here
        nov = Novelty(kind, fname, max_bank=8000).fit(feature(fname, subset(fit, rd)))
        nov.calibrate(feature(fname, subset(fit, df)))
        scorers[key] = nov
        scores[key] = {n: nov.score(feature(fname, tensors[n])) for n in tensors}
        print(f"novelty {key} scored", flush=True)
    auc = {key: {n: auroc(np.r_[s["test"], s[n]], np.r_[np.zeros(len(s["test"])),
                                                        np.ones(len(s[n]))])
                 for n in cells if n != "test"} for key, s in scores.items()}
    report["novelty_auroc"] = auc

    pv = {key: {n: p_values(nov.t["calibration"].numpy(), scores[key][n]) for n in tensors}
          for key, nov in scorers.items()}
    report["novelty_flagged"] = {key: {n: float((p[n] < ALPHAS[0]).mean()) for n in cells}
                                 for key, p in pv.items()}
    # pairs of scorers, Bonferroni-combined (p = min(1, 2·min(p1, p2)) stays valid)
    singles = list(pv)
    for i, a in enumerate(singles):
        for b in singles[i + 1:]:
            pv[f"{a} + {b}"] = {n: np.minimum(1.0, 2 * np.minimum(pv[a][n], pv[b][n]))
                                for n in tensors}

    def pool_power(p: dict, fam: str, alpha: float) -> float:
        """Share flagged at α among a family's pool items off the reader images."""
        n = f"pool~{fam}"
        return float((p[n][pool_split[n] != "reader"] < alpha).mean())

    def supervised(held: str | None) -> tuple[Novelty, dict[str, np.ndarray]]:
        """p-values of a logistic detector fitted to tell the clean reader split from the
        pool (reader images) of every family but `held`, calibrated on the clean defer
        split."""
        shifted = [subset(tensors[f"pool~{f}"],
                          np.nonzero(pool_split[f"pool~{f}"] == "reader")[0])
                   for f in FAMILIES if f != held]
        nov = Novelty("logistic", SUPERVISED_FEATURE).fit(
            feature(SUPERVISED_FEATURE, subset(fit, rd)),
            torch.cat([feature(SUPERVISED_FEATURE, t) for t in shifted]))
        nov.calibrate(feature(SUPERVISED_FEATURE, subset(fit, df)))
        return nov, {n: nov.p_value(feature(SUPERVISED_FEATURE, t)) for n, t in tensors.items()}

    # the refit recipe on clean data alone: what (b) would be without the corrupted pool
    b0 = RefitDualRead(dim).fit(feats["fit"], fit_split, subset(fit, df), r, delta)
    p_b0 = {n: b0.p(tensors[n]) for n in cells}
    report["refit_clean"] = {n: cell(p_b0[n], z[n], p_b0[n] < b0.tau) for n in cells}
    report["refit_clean_tau"] = b0.tau

    # (3) leave one family out (needs every family's pool)
    lofo: dict = {}
    if len(pool_names) < len(FAMILIES):
        print("pool incomplete: leave-one-family-out skipped", flush=True)
    for held in FAMILIES if len(pool_names) == len(FAMILIES) else ():
        others = [f for f in FAMILIES if f != held]
        row: dict = {}
        a0 = ALPHAS[0]
        # (a) the unsupervised scorer with the most power at α on the other families
        power = {key: float(np.mean([pool_power(pv[key], f, a0) for f in others]))
                 for key in pv}
        best = max(power, key=power.get)
        _, p_sup = supervised(held)
        row["a_choice"] = {"unsupervised": best, "pool_power": power[best],
                           "supervised_pool_power": float(np.mean(
                               [pool_power(p_sup, f, a0) for f in others]))}
        test_names = [n for n in cells if fam_of[n] in (held, "clean")]
        for alpha in ALPHAS:
            for tag, p in (("a_unsup", pv[best]), ("a_sup", p_sup)):
                row[f"{tag}@{alpha}"] = {
                    n: {**cell(p_dr[n], z[n], (p_dr[n] < tau) | (p[n] < alpha)),
                        "novel_rate": float((p[n] < alpha).mean())} for n in test_names}
        # (b) heads refitted on clean + the other families' pool
        parts, sp = [feats["fit"]], [fit_split]
        for f in others:
            parts.append(feats[f"pool~{f}"])
            sp.append(pool_split[f"pool~{f}"])
        aug = {k: (torch.cat([q[k] for q in parts]) if torch.is_tensor(parts[0][k])
                   else np.concatenate([q[k] for q in parts])) for k in parts[0]}
        hb = RefitDualRead(dim).fit(aug, np.concatenate(sp), subset(fit, df), r, delta)
        pb = {n: hb.p(tensors[n]) for n in test_names}
        row["b"] = {n: cell(pb[n], z[n], pb[n] < hb.tau) for n in test_names}
        row["b_tau"] = hb.tau
        for alpha in ALPHAS:
            row[f"c@{alpha}"] = {n: cell(pb[n], z[n], (pb[n] < hb.tau) |
                                         (p_sup[n] < alpha)) for n in test_names}
        lofo[held] = row
        print(f"held out {held}: (a) {best}", flush=True)
    report["lofo"] = lofo
    # what would ship: the logistic detector fitted on every family's pool (in-sample
    # families, so only its clean behaviour is a fair number here)
    if len(pool_names) == len(FAMILIES):
        nov, p_all = supervised(None)
        report["deploy"] = {
            "novelty": nov.to_dict(), "alpha": ALPHAS[0],
            "clean_test_flagged": float((p_all["test"] < ALPHAS[0]).mean()),
            "clean_test_defer": float(((p_dr["test"] < tau) |
                                       (p_all["test"] < ALPHAS[0])).mean())}
    (out / "results.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "report.md").write_text(markdown(report))
    return report


# ------------------------------------------------------------------ report
def _f(v: float, d: int = 3) -> str:
    return "–" if v != v else f"{v:.{d}f}"


def markdown(rep: dict) -> str:
    r, tau = rep["target_risk"], rep["tau"]
    L = ["# DualRead under generic corruptions: measurement study", "",
         f"Command: `{rep['command']}`", "",
         f"Shipped heads: τ = {tau:.4f}, r = {r}; target (issue 11): on a held-out family at "
         f"severity 5, risk among kept ≤ 2r = {2 * r:.2f} or defer rate ≥ 0.90; in "
         "distribution the defer rate rises by ≤ 5 points.", "",
         f"Items: {rep['n']['fit']} clean `easyvqa:heldout` (fit splits {rep['fit_splits']}), "
         f"{rep['n']['test']} `easyvqa:test` items per cell, "
         f"{rep['n'].get('pool~noise', 0)} corrupted heldout items per family (pool)."]
    L += _summary(rep)
    L += ["", "## 1. Shipped heads per family × severity", "",
         "DualRead p_DR, defer = p_DR < τ. Last two columns: the same recipe refitted here on "
         f"the clean fit data alone (τ = {rep['refit_clean_tau']:.4f}), the baseline of (b).",
         "", "| cell | acc | ECE | AUROC | defer | risk kept (n kept) | refit AUROC | "
         "refit defer / risk kept |", "|---|---|---|---|---|---|---|---|"]
    for n, c in rep["shipped"].items():
        b = rep["refit_clean"][n]
        L.append(f"| {n} | {_f(c['accuracy'])} | {_f(c['ece'])} | {_f(c['auroc'])} | "
                 f"{_f(c['defer_rate'])} | {_f(c['risk_kept'])} ({c['n_kept']}) | "
                 f"{_f(b['auroc'])} | {_f(b['defer_rate'])} / {_f(b['risk_kept'])} |")
    L += ["", "## 2. Novelty scores: AUROC clean test vs corrupted test", "",
          "Fitted on the clean reader split; mean over severities 1/3/5, and per family at "
          "severity 5.", ""]
    keys = list(rep["novelty_auroc"])
    fams = sorted({n.split("~")[1].split(":")[0] for n in rep["novelty_auroc"][keys[0]]},
                  key=FAMILIES.index)
    L += ["| scorer | mean | " + " | ".join(f"{f}:5" for f in fams) + " |",
          "|---" * (len(fams) + 2) + "|"]
    for k in keys:
        a = rep["novelty_auroc"][k]
        sev5 = [a.get(f"test~{f}:5", float("nan")) for f in fams]
        L.append(f"| {k} | {_f(np.nanmean(list(a.values())))} | "
                 + " | ".join(_f(v) for v in sev5) + " |")
    L += ["", f"Share flagged novel (p < {ALPHAS[0]}), clean test and per family at "
          "severity 5:", "",
          "| scorer | clean | " + " | ".join(f"{f}:5" for f in fams) + " |",
          "|---" * (len(fams) + 2) + "|"]
    for k, a in rep["novelty_flagged"].items():
        L.append(f"| {k} | {_f(a['test'])} | "
                 + " | ".join(_f(a.get(f"test~{f}:5", float("nan"))) for f in fams) + " |")
    L += ["", "## 3. Leave one family out, held-out family at severity 5", "",
          "defer / risk among kept (n kept); ✓ = target met. (a) conformal p-value of a "
          "novelty score (unsupervised: chosen by power at α on the other families' pool; "
          "supervised: logistic clean vs other families), (b) DualRead refitted on clean + "
          "other families, τ on clean, (c) = (b) + supervised (a); rule = the shipped defer "
          "rule of reports made while the pixel image check shipped (shipped heads' τ, "
          "the supervised detector of (a) refitted without the held-out family, and that "
          "image check, fitted on clean images only; retired since).",
          ""]
    L += _lofo_table(rep, 5)
    L += ["", "### Same, severities 3 and 1", ""]
    L += _lofo_table(rep, 3) + [""] + _lofo_table(rep, 1)
    L += ["", "### In distribution (clean `easyvqa:test`): defer rate", ""]
    shipped = rep["shipped"]["test"]["defer_rate"]
    L += [f"Shipped heads alone: {shipped:.3f}.", "",
          "| held-out fold | " + " | ".join(_methods(rep)) + " |",
          "|---" * (len(_methods(rep)) + 1) + "|"]
    for held, row in rep["lofo"].items():
        L.append(f"| {held} | " + " | ".join(
            _f(row[m]["test"]["defer_rate"]) for m in _methods(rep)) + " |")
    L += ["", "Scorer chosen for (a) per fold: " + ", ".join(
        f"{h}: {row['a_choice']['unsupervised']}" for h, row in rep["lofo"].items()), ""]
    return "\n".join(L) + "\n"


def _summary(rep: dict) -> list[str]:
    if not rep["lofo"]:
        return []
    r = rep["target_risk"]
    base = rep["shipped"]["test"]["defer_rate"]
    L = ["", "## Summary", "",
         "Per method: held-out families meeting the target at severity 5 (of "
         f"{len(rep['lofo'])}), and the largest in-distribution rise of the defer rate over "
         f"the shipped heads alone ({base:.3f}) across the folds.", "",
         "| method | families meeting target at severity 5 | max in-distribution rise |",
         "|---|---|---|"]
    shipped = sum(meets(rep["shipped"][f"test~{h}:5"], r) for h in rep["lofo"])
    L.append(f"| shipped heads alone | {shipped} | 0 |")
    for m in _methods(rep):
        ok = sum(meets(row[m][f"test~{h}:5"], r) for h, row in rep["lofo"].items())
        rise = max(row[m]["test"]["defer_rate"] for row in rep["lofo"].values()) - base
        L.append(f"| {m} | {ok} | {100 * rise:+.1f} points |")
    if "deploy" in rep:
        d = rep["deploy"]
        L += ["", f"The logistic detector fitted on all eight families (what would ship) "
              f"flags {d['clean_test_flagged']:.3f} of clean test items at α = {d['alpha']}; "
              f"with the shipped τ the clean defer rate is {d['clean_test_defer']:.3f}."]
    return L


# "rule@0.01": the column of reports made while the retired image check shipped
_METHODS = ("a_unsup@0.01", "a_sup@0.01", "a_unsup@0.05", "a_sup@0.05", "b", "c@0.01",
            "c@0.05", "rule@0.01")


def _methods(rep: dict) -> tuple[str, ...]:
    """The methods every fold of this report has (older reports have no rule column)."""
    return tuple(m for m in _METHODS if all(m in row for row in rep["lofo"].values()))


def _lofo_table(rep: dict, sev: int) -> list[str]:
    r = rep["target_risk"]
    methods = _methods(rep)
    L = ["| held out (shipped) | " + " | ".join(methods) + " |",
         "|---" * (len(methods) + 1) + "|"]
    for held, row in rep["lofo"].items():
        n = f"test~{held}:{sev}"
        if n not in row["b"]:
            continue
        s = rep["shipped"][n]
        cells = [f"{_f(s['defer_rate'], 2)} / {_f(s['risk_kept'], 2)}"]
        for m in methods:
            c = row[m][n]
            mark = " ✓" if meets(c, r) else ""
            cells.append(f"{_f(c['defer_rate'], 2)} / {_f(c['risk_kept'], 2)} "
                         f"({c['n_kept']}){mark}")
        L.append(f"| {held}:{sev} ({cells[0]}) | " + " | ".join(cells[1:]) + " |")
    return L
