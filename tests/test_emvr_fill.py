"""EMVR's mask removes evidence without adding any: it is filled with the image's own
background estimate, not a colour and shape the data can name (easy-VQA's "gray"
"rectangle" was an answer to half its open questions)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

from clients.probes import images
from clients.probes.emvr import critical_box
from clients.probes.images import background_rgb, control_box, mask_region
from models.canon import canon, is_correct
from models.data import load, sample


def _scene(bg=(231, 244, 238), fg=(0, 0, 255)) -> tuple[Image.Image, tuple]:
    img = Image.new("RGB", (64, 64), bg)
    ImageDraw.Draw(img).ellipse((10, 14, 30, 34), fill=fg)
    return img, (10, 14, 31, 35)


def test_background_estimate_is_the_border_median():
    img, _ = _scene()
    img.paste((9, 9, 9), (0, 0, 5, 1))          # a few odd border pixels do not move it
    assert background_rgb(img) == (231, 244, 238)


def test_full_mask_leaves_only_background_and_control_leaves_the_image():
    img, box = _scene()
    masked = np.asarray(mask_region(img, box, 1.0))
    assert (masked == (231, 244, 238)).all()    # the shape is gone and nothing was drawn
    ctrl = control_box(box, img.size)
    assert (np.asarray(mask_region(img, ctrl, 1.0)) == np.asarray(img)).all()
    gray = np.asarray(mask_region(img, box, 1.0, "gray"))     # the old fill: a visible patch
    assert (gray == images.GRAY).all(-1).sum() == (box[2] - box[0]) * (box[3] - box[1])
    with pytest.raises(ValueError):
        mask_region(img, box, 1.0, "pink")


def _palette(items) -> dict[str, np.ndarray]:
    """Each colour answer's typical shape pixel, measured on the data (no hand-coded
    RGB values): what "naming the fill's colour" means for this dataset."""
    by: dict[str, list] = {}
    for it in items:
        a = np.asarray(it.image(), int)
        x0, y0, x1, y1 = it.box
        px = a[y0:y1, x0:x1].reshape(-1, 3)
        fg = px[np.abs(px - np.array(background_rgb(it.image()))).sum(1) > 40]
        if len(fg):
            by.setdefault(it.answer, []).append(np.median(fg, 0))
    return {k: np.median(v, 0) for k, v in by.items()}


def _named(fill: tuple, palette: dict, around: np.ndarray, shape_answers: set) -> set[str]:
    """Answers that describe the fill: colour names whose measured colour is closer to it
    than half the gap between any two named colours, and the mask's own shape when it
    stands out from what surrounds it."""
    pts = np.stack(list(palette.values()))
    gap = min(np.linalg.norm(a - b) for i, a in enumerate(pts) for b in pts[i + 1:])
    names = {k for k, v in palette.items() if np.linalg.norm(v - np.array(fill)) < gap / 2}
    if np.abs(around - np.array(fill)).sum(-1).mean() > 40:
        names |= {s for s in shape_answers if s.startswith("rect")}
    return names


@pytest.fixture(scope="module")
def embedded():
    from models.loading import load_actor
    return load_actor()


def test_mask_removes_evidence_without_adding_an_answer_on_easyvqa(embedded):
    """On held-out *training* images (a development split): the matched control costs
    ≤ .02 accuracy, the critical mask still costs accuracy, and at λ = 1 the share of
    open answers naming the fill (its colour or, if visible, its shape) stays at the
    unmasked rate."""
    pool = load("easyvqa:heldout")
    items = sample(pool, 64, seed=11)
    palette = _palette([it for it in pool[:600] if it.answer_type == "color"])
    shapes = {it.answer for it in pool if it.answer_type == "shape"}
    clean, crit, ctrl, named = [], [], [], []
    for it in items:
        img, box = it.image(), critical_box(it)
        cb = control_box(box, img.size)
        clean.append(img)
        crit.append(mask_region(img, box, 1.0))
        ctrl.append(mask_region(img, cb, 1.0) if cb else img)
        a = np.asarray(img, int)
        ring = np.concatenate([a[max(0, box[1] - 1), box[0]:box[2]],
                               a[min(a.shape[0] - 1, box[3]), box[0]:box[2]]])
        named.append(_named(background_rgb(img), palette, ring, shapes))

    def answer(imgs):
        res = embedded.answer(imgs, [it.question for it in items], readout="none")
        return [canon(r.answer) for r in res]

    a0, a1, a2 = answer(clean), answer(crit), answer(ctrl)
    z = [np.array([is_correct(a, it.answer) for a, it in zip(ans, items)], float)
         for ans in (a0, a1, a2)]
    assert z[0].mean() - z[2].mean() <= 0.02            # matched control: no cost
    assert z[0].mean() - z[1].mean() >= 0.15            # critical: evidence removed
    open_ = [k for k, it in enumerate(items) if it.answer_type != "yes/no"]
    base = np.mean([a0[k] in named[k] for k in open_])
    full = np.mean([a1[k] in named[k] for k in open_])
    assert full <= base + 0.05
