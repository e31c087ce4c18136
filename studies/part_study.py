"""What the image parts' development studies share: the fitting/calibration images, the
loop over the development suites, and writing the page."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from heads.suites import suite_kinds
from models.data import load, sample


def unique_images(items: Sequence[Any]) -> list[Any]:
    """The first item of each image, in order."""
    seen, out = set(), []
    for it in items:
        if it.image_id not in seen:
            seen.add(it.image_id)
            out.append(it)
    return out


def fit_and_calibration_images(n_fit: int, n_cal: int) -> tuple[list[Any], list[Any]]:
    """Two disjoint image samples of `easyvqa:heldout`, the same in every study."""
    imgs = sample(unique_images(load("easyvqa:heldout")), n_fit + n_cal, seed=1)
    order = np.random.default_rng(0).permutation(len(imgs))
    return [imgs[i] for i in order[:n_fit]], [imgs[i] for i in order[n_fit:]]


def suite_rows(part: Any, describe: Callable[[list], Any], per_suite: int, alpha: float,
               split: str = "dev", extra: Callable[[Any], str] | None = None,
               seed: int | None = 2, digits: int = 3) -> tuple[list[str], float]:
    """One table row per suite of `split` (`| spec | kind | images | flagged | median
    score |`, plus `extra(descriptors)` as a last column), and the cost in ms an image of
    describing and scoring. `seed` None samples items first, as `dualread evaluate` does."""
    rows, secs, n_img = [], 0.0, 0
    for spec, kind in suite_kinds(split):
        items = (sample(unique_images(load(spec)), per_suite, seed=seed) if seed is not None
                 else unique_images(sample(load(spec), per_suite)))
        ims = [it.image() for it in items]
        t = time.perf_counter()
        x = describe(ims)
        s = part.score(x)
        secs += time.perf_counter() - t
        n_img += len(ims)
        flagged = float((part.p_values_of(s) < alpha).mean())
        row = f"| `{spec}` | {kind} | {len(ims)} | {flagged:.3f} | {np.median(s):.{digits}f} |"
        rows.append(row + (f" {extra(x)} |" if extra else ""))
        print(rows[-1], flush=True)
    return rows, 1000 * secs / max(1, n_img)


def load_note() -> str:
    return f"wall time on a shared machine, os.getloadavg() {os.getloadavg()[0]:.1f} at the end"


def write(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)
