"""Design study of the scene-layout novelty part on development suites only (no actor).

    python -m studies.layout_novelty_study --out docs/defer/layout-dev.md

Fits `heads.layout_novelty.LayoutNovelty` on images of `easyvqa:heldout` (+ each of them
re-encoded once by every development benign family, as the shipped fit does), calibrates on other
images of it, and prints the share of images of each development suite the part flags at
its own α (α / 4 of the shipped α = 0.02: the Bonferroni share of one part of four), the
median score, and the cost per image. Nothing is fitted on a suite.

    python -m studies.layout_novelty_study --shipped heads/embedded --split heldout \
        --per-suite 60 --out docs/defer/layout-heldout.md

reads the shipped heads' layout part instead (fitted by `dualread fit-detectors`) on the
suites of one side of the split: on the held-out side a diagnostic of which share of each
suite's images that part alone flags, run after the held-out evaluation, never a design
input.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from heads.detectors import AUGMENT_FAMILIES
from heads.layout_novelty import LayoutNovelty, layout_descriptors
from models.shift import per_family
from studies.part_study import fit_and_calibration_images, load_note, suite_rows, write

COMMAND = "python -m studies.layout_novelty_study --per-suite 200 --out docs/defer/layout-dev.md"
SHIPPED_COMMAND = ("python -m studies.layout_novelty_study --shipped heads/embedded --split "
                   "heldout --per-suite 60 --out docs/defer/layout-heldout.md")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-images", type=int, default=475)
    ap.add_argument("--cal-images", type=int, default=314)
    # as the shipped fit (heads.detectors.detector_stage): every fitting image once a family
    ap.add_argument("--per-family", type=int, default=None)
    ap.add_argument("--per-suite", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.02 / 4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shipped", type=Path, default=None,
                    help="heads folder: read its layout part instead of fitting one")
    ap.add_argument("--split", choices=("dev", "heldout"), default="dev")
    a = ap.parse_args(argv)
    if a.shipped is not None:
        return shipped(a)

    fit, cal = fit_and_calibration_images(a.fit_images, a.cal_images)
    aug = per_family(fit, AUGMENT_FAMILIES, a.per_family or len(fit), 200)
    t = time.perf_counter()
    det = LayoutNovelty().fit(layout_descriptors([it.image() for it in fit + aug]))
    fit_s = time.perf_counter() - t
    cal_x = layout_descriptors([it.image() for it in cal])
    det.calibrate(cal_x)
    lines = ["# Scene-layout novelty part on the development suites", "",
             f"    {COMMAND}", "",
             f"Layout part alone, development suites only: fitted on {len(fit)} "
             f"`easyvqa:heldout` images + {len(aug)} benign re-encodings "
             f"({', '.join(AUGMENT_FAMILIES)}; fit {fit_s:.1f} s), calibrated on {len(cal)} "
             f"other images; part alpha {a.alpha:.4f} (a fourth of 0.02). `objects`: the "
             "share of images whose descriptor counts 1 / 2 / 3+ objects.", "",
             "| suite | kind | images | flagged | median score | objects 1 / 2 / 3+ |",
             "|---|---|---|---|---|---|",
             f"| calibration (`easyvqa:heldout`) | clean | {len(cal)} | – | "
             f"{np.median(det.clean_scores()):.3f} | {_objects(cal_x)} |"]
    rows, ms = suite_rows(det, layout_descriptors, a.per_suite, a.alpha, extra=_objects)
    lines += rows + ["", f"Cost: {ms:.2f} ms an image (descriptor + nearest scene, one CPU "
                         f"thread; {load_note()})."]
    write(lines, a.out)


def shipped(a: argparse.Namespace) -> None:
    from heads.novelty import load_detector

    det = load_detector(a.shipped)
    part = det.parts["layout"]
    alpha = 0.02 / len(det.parts)
    lines = ["# The shipped layout part alone on the " + a.split + " suites", "",
             f"    {SHIPPED_COMMAND if a.split == 'heldout' else ''}", "",
             f"The layout part of the detector in `{a.shipped}` (as `dualread fit-detectors` "
             f"fitted it: {part.n_fit} fitting scenes, {len(part.t['calibration'])} calibration "
             f"images), read alone at its Bonferroni share alpha {alpha:.4f} on the images of "
             f"{a.per_suite} items of each suite (their images; the same items "
             f"`dualread evaluate --limit {a.per_suite}` reads). What the whole rule did is in "
             "results.md; this says which share of each suite's images this part flags.", "",
             "| suite | kind | images | flagged | median score | objects 1 / 2 / 3+ |",
             "|---|---|---|---|---|---|"]
    rows, _ = suite_rows(part, layout_descriptors, a.per_suite, alpha, split=a.split,
                         extra=_objects, seed=None)
    write(lines + rows, a.out)


def _objects(x) -> str:
    """Shares of scenes whose descriptor counts 1 / 2 / 3+ objects (its first number)."""
    counts = x[:, 0].numpy()
    n = max(1, len(counts))
    return " / ".join(f"{v / n:.2f}" for v in (
        (counts == 1).sum(), (counts == 2).sum(), (counts >= 3).sum()))


if __name__ == "__main__":
    main()
