"""Which one-class score should the image check use? Measured on training images only.

    python -m heads.image_check_study [--out docs/image-check-study]

Clean easy-VQA training images: the actor split (3,200 images) to fit on, the held-out
split (800) to calibrate on (all but its temperature-split images) and to corrupt (the
first 300, every family of `models.shift` at severities 3 and 5, and `rotate` at 45° and
180°, outside the suite's means, and changes a check should leave alone: one grey level
of noise or dither, one black pixel); the held-out temperature-split images give the clean flag
rate. No test image is read. Writes
`results.json` and `results.md`: the share flagged at α = 0.01 per family × severity.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from heads.fit import image_split
from heads.image_check import SCALE_FLOOR, pixel_features_many
from heads.novelty import Novelty
from models.data import load
from models.shift import EXTRA_FAMILIES, FAMILIES, corrupt

ALPHA = 0.01
N_CORRUPTED = 300
Scorer = Callable[[np.ndarray], np.ndarray]


def _distinct(spec: str) -> list:
    return list({it.image_id: it for it in load(spec)}.values())


def shipped(kind: str) -> Callable[[np.ndarray], Scorer]:
    """A score as `fit-heads` builds the image check: `heads.novelty.Novelty` on the
    statistics standardised with floored scales (`SCALE_FLOOR`)."""
    floor = torch.tensor(SCALE_FLOOR, dtype=torch.float64)

    def fit(x: np.ndarray) -> Scorer:
        det = Novelty(kind, "pixels").fit(torch.from_numpy(x), min_scale=floor)
        return lambda q: det.score(torch.from_numpy(q))
    return fit


def scorers() -> dict[str, Callable[[np.ndarray], Scorer]]:
    from sklearn.covariance import LedoitWolf
    from sklearn.ensemble import IsolationForest
    from sklearn.neighbors import NearestNeighbors
    from sklearn.preprocessing import PowerTransformer, QuantileTransformer

    def mahalanobis(tf):
        def fit(x):
            t = tf().fit(x)
            lw = LedoitWolf().fit(t.transform(x))
            return lambda q: lw.mahalanobis(np.clip(t.transform(q), -50, 50))
        return fit

    def knn(tf):
        def fit(x):
            t = tf().fit(x)
            nn = NearestNeighbors(n_neighbors=5).fit(t.transform(x))
            return lambda q: nn.kneighbors(t.transform(q))[0][:, -1]
        return fit

    def quantile():
        return QuantileTransformer(n_quantiles=1000, output_distribution="normal")

    def forest(x):
        f = IsolationForest(n_estimators=300, random_state=0).fit(x)
        return lambda q: -f.score_samples(q)

    return {"mahalanobis": shipped("mahalanobis"),
            "yeo-johnson + mahalanobis": mahalanobis(PowerTransformer),
            "quantile + mahalanobis": mahalanobis(quantile),
            "5-NN (shipped)": shipped("knn"),
            "quantile + 5-NN": knn(quantile),
            "isolation forest": forest}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/image-check-study")
    args = ap.parse_args(argv)
    actor, held = _distinct("easyvqa:actor"), _distinct("easyvqa:heldout")
    x_fit = pixel_features_many([it.image() for it in actor])
    x_held = pixel_features_many([it.image() for it in held])
    split = np.array([image_split(it.image_id) for it in held])
    cells = {f"{f}:{s}": pixel_features_many([corrupt(it.image(), f, s, it.image_id)
                                              for it in held[:N_CORRUPTED]])
             for f in (*FAMILIES, *EXTRA_FAMILIES) for s in (3, 5)}
    # changes no one can see, which a check should leave alone: one grey level of noise
    rng = np.random.default_rng(0)
    def speck(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a[rng.integers(0, a.shape[0]), rng.integers(0, a.shape[1])] = 0
        return a

    for name, change in (("grey-level noise", lambda a: a + rng.normal(0, 1, a.shape)),
                         ("grey-level dither", lambda a: a - (rng.random(a.shape[:2]) < 0.6
                                                              )[..., None]),
                         ("one black pixel", speck)):
        cells[name] = pixel_features_many([
            Image.fromarray(np.clip(change(np.asarray(it.image().convert("RGB"), float)),
                                    0, 255).round().astype(np.uint8))
            for it in held[:N_CORRUPTED]])
    setups = [(name, make, fit) for name, make in scorers().items()
              for fit in (("reader split of held-out (the previous check's data)",)
                          if name == "mahalanobis"
                          else ()) + ("actor split",)]
    rows = []
    for name, make, on in setups:
        fit = x_held[split == "reader"] if on.startswith("reader") else x_fit
        cal = x_held[split == "defer"] if on.startswith("reader") else \
            x_held[split != "temperature"]
        score = make(fit)
        ref = np.sort(score(cal))

        def flagged(x: np.ndarray, score=score, ref=ref) -> float:
            p = (1 + len(ref) - np.searchsorted(ref, score(x), side="left")) / (len(ref) + 1)
            return round(float((p < ALPHA).mean()), 4)

        row = {"score": name, "fitted_on": on, "n_fit": len(fit), "n_calibration": len(cal),
               "clean": flagged(x_held[split == "temperature"]),
               "cells": {c: flagged(x) for c, x in cells.items()}}
        for s in (3, 5):          # the suite's families (rotate is reported on its own)
            row[f"mean_severity_{s}"] = round(float(np.mean(
                [v for c, v in row["cells"].items()
                 if c.endswith(f":{s}") and c.split(":")[0] in FAMILIES])), 4)
        rows.append(row)
        print(f"{name} ({on}): severity 5 {row['mean_severity_5']}, "
              f"severity 3 {row['mean_severity_3']}, clean {row['clean']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    meta = {"command": " ".join(["python -m heads.image_check_study", *argv]),
            "alpha": ALPHA, "n_corrupted_per_cell": N_CORRUPTED,
            "n_clean_check": int((split == "temperature").sum())}
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    cols = list(cells)
    lines = [f"Command: `{meta['command']}`. Share flagged at α = {ALPHA}; "
             f"{N_CORRUPTED} corrupted held-out training images per cell, "
             f"{meta['n_clean_check']} clean ones (temperature split) for the clean rate.", "",
             "| score | fitted on | clean | mean sev 5 | mean sev 3 | " + " | ".join(cols) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['score']} | {r['fitted_on']} ({r['n_fit']}) | {r['clean']} | "
                     f"{r['mean_severity_5']} | {r['mean_severity_3']} | "
                     + " | ".join(f"{r['cells'][c]:.2f}" for c in cols) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
