"""Design study of the pixel novelty part on development suites only (no actor needed).

    python -m studies.pixel_novelty_study --out docs/defer/pixel-dev.md

Fits `heads.pixel_novelty.PixelNovelty` on images of `easyvqa:heldout` (+ benign
re-encodings of development families), calibrates on other images of it, and prints the
share of images each development suite has flagged at the part's α (α / 3 of the shipped
α = 0.02: the Bonferroni share of one part of three), with the cost per image.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from heads.detectors import AUGMENT_FAMILIES
from heads.pixel_novelty import PixelNovelty, pixel_descriptors
from heads.suites import suite_kinds
from models.data import load, sample
from models.shift import per_family


def unique_images(items):
    seen, out = set(), []
    for it in items:
        if it.image_id not in seen:
            seen.add(it.image_id)
            out.append(it)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-images", type=int, default=475)
    ap.add_argument("--cal-images", type=int, default=314)
    ap.add_argument("--per-family", type=int, default=60)
    ap.add_argument("--per-suite", type=int, default=60)
    ap.add_argument("--alpha", type=float, default=0.02 / 3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    imgs = sample(unique_images(load("easyvqa:heldout")), a.fit_images + a.cal_images, seed=1)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(imgs))
    fit = [imgs[i] for i in order[: a.fit_images]]
    cal = [imgs[i] for i in order[a.fit_images:]]
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
    secs, n_img = 0.0, 0
    for spec, kind in suite_kinds("dev"):
        items = sample(unique_images(load(spec)), a.per_suite, seed=2)
        ims = [it.image() for it in items]
        t = time.perf_counter()
        s = det.score(pixel_descriptors(ims))
        secs += time.perf_counter() - t
        n_img += len(ims)
        flagged = float((det.p_values_of(s) < a.alpha).mean())
        lines.append(f"| `{spec}` | {kind} | {len(ims)} | {flagged:.3f} | {np.median(s):.3f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Cost: {1000 * secs / max(1, n_img):.1f} ms an image (descriptors + "
                  f"kNN, one CPU thread, batches of up to {a.per_suite}; wall time on a "
                  f"shared machine, os.getloadavg() {os.getloadavg()[0]:.1f} at the end)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
