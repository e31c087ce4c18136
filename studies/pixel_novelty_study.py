"""Design study of the pixel novelty part on development suites only (no actor needed).

    python -m studies.pixel_novelty_study --out docs/defer/pixel-dev.md

Fits `heads.pixel_novelty.PixelNovelty` on images of `easyvqa:heldout` (+ benign
re-encodings of development families), calibrates on other images of it, and prints the
share of images each development suite has flagged at the part's α (α / 3 of the shipped
α = 0.02: the Bonferroni share of one part of three), with the cost per image.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from heads.detectors import AUGMENT_FAMILIES
from heads.pixel_novelty import PixelNovelty, pixel_descriptors
from models.shift import per_family
from studies.part_study import fit_and_calibration_images, load_note, suite_rows, write


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-images", type=int, default=475)
    ap.add_argument("--cal-images", type=int, default=314)
    ap.add_argument("--per-family", type=int, default=60)
    ap.add_argument("--per-suite", type=int, default=60)
    ap.add_argument("--alpha", type=float, default=0.02 / 3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    fit, cal = fit_and_calibration_images(a.fit_images, a.cal_images)
    aug = per_family(fit, AUGMENT_FAMILIES, a.per_family, 200)
    t = time.perf_counter()
    x = pixel_descriptors([it.image() for it in fit + aug])
    det = PixelNovelty().fit(x)
    fit_s = time.perf_counter() - t
    det.calibrate(pixel_descriptors([it.image() for it in cal]))
    lines = ["# Pixel novelty part on the development suites", "",
             "    python -m studies.pixel_novelty_study --per-suite 40 --out "
             "docs/defer/pixel-dev.md", "",
             f"Pixel novelty part, development suites only (`python -m heads.pixel_novelty_"
             f"study`): fitted on {len(fit)} `easyvqa:heldout` images + {len(aug)} benign "
             f"re-encodings ({', '.join(AUGMENT_FAMILIES)}), bank "
             f"{det.t['bank'].shape[0]} descriptors (fit {fit_s:.0f} s), calibrated on "
             f"{len(cal)} other images; part alpha {a.alpha:.4f}.", "",
             "| suite | kind | images | flagged | median score |", "|---|---|---|---|---|"]
    rows, ms = suite_rows(det, pixel_descriptors, a.per_suite, a.alpha)
    lines += rows + ["", f"Cost: {ms:.1f} ms an image (descriptors + kNN, one CPU thread, "
                         f"batches of up to {a.per_suite}; {load_note()})."]
    write(lines, a.out)


if __name__ == "__main__":
    main()
