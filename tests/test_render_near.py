"""The development family of near unseen shapes (docs/defer/suites.md): drawn as they say,
asked about with their own names as gold answers, and apart from every held-out shape."""

import numpy as np

from heads.suites import suite_specs
from models.data import COLOURS, SHAPES, load
from models.render import SUITES, UNSEEN_SHAPES, Obj, Scene, render

NEAR = UNSEEN_SHAPES["near-dev"]


def test_near_family_is_development_novel_and_apart_from_held_out_shapes():
    assert SUITES["shape-near-dev"]["split"] == "dev"
    assert SUITES["shape-near-dev"]["kind"] == "novel"
    assert "render:shape-near-dev" in suite_specs("dev")
    assert "render:shape-near-dev" not in suite_specs("heldout")
    held = set(UNSEEN_SHAPES["heldout"]) | set(UNSEEN_SHAPES["fresh"])
    assert not set(NEAR) & (held | set(SHAPES) | set(UNSEEN_SHAPES["dev"]))


def test_near_shapes_are_drawn_and_asked_about_by_their_names():
    items = load("render:shape-near-dev:24")
    assert len(items) == 72
    seen = set()
    for it in items:
        obj = it.scene.objects[0]
        assert obj.shape in NEAR and obj.colour in COLOURS
        seen.add(obj.shape)
        if it.question in ("what shape is in the image?", "what shape is present?",
                           "what shape does the image contain?",
                           f"what is the {obj.colour} shape?"):
            assert it.answer == obj.shape
        if it.question in (f"is there a {obj.shape}?", f"does the image contain a {obj.shape}?"):
            assert it.answer == "yes"
        for s in SHAPES:
            if it.question == f"is there a {s}?":
                assert it.answer == "no"       # an octagon is not a circle here
    assert seen == set(NEAR)
    # the boxes of the flattened shapes are as wide as their heights say
    for it in items:
        o = it.scene.objects[0]
        w, h = o.box[2] - o.box[0], o.box[3] - o.box[1]
        want = {"octagon": 1.0, "ellipse": 0.6, "trapezoid": 0.6, "parallelogram": 0.55}
        assert abs(h - want[o.shape] * w) <= 0.5


def _mask(shape: str, box=(24, 24, 104, 104)) -> np.ndarray:
    im = np.asarray(render(Scene((Obj(shape, "black", box),), (240, 240, 240))))
    return im.max(-1) < 120


def test_each_near_shape_covers_what_its_outline_says():
    octagon, circle = _mask("octagon"), _mask("circle")
    # an octagon and a circle in the same 40-px box: the octagon's flat sides touch the
    # box as the circle does, its area is 8·tan(π/8)/π ≈ 1.055 of the circle's
    assert octagon[32, 32] and octagon[32, 12] and octagon[12, 32]
    for m in (octagon, circle):
        rows, cols = np.nonzero(m)
        assert np.ptp(rows) + 1 in (40, 41) and np.ptp(cols) + 1 in (40, 41)
    assert 1.02 < octagon.sum() / circle.sum() < 1.09
    # its corners at 22.5° off the axes stand out of the circle
    assert octagon[13, 23] and octagon[23, 13] and not circle[13, 23] and not circle[23, 13]
    ellipse = _mask("ellipse", (24, 40, 104, 88))                  # 80 × 48
    rows, cols = np.nonzero(ellipse)
    assert np.ptp(rows) + 1 in (24, 25) and np.ptp(cols) + 1 in (40, 41)
    assert not ellipse[20, 12] and ellipse[32, 32]                 # no corner, a full middle
    trap = _mask("trapezoid", (24, 40, 104, 88))
    top, bottom = trap[21].sum(), trap[43].sum()
    assert 0.4 < top / bottom < 0.65                              # the top half the base
    par = _mask("parallelogram", (24, 42, 104, 86))
    rows = [np.nonzero(par[r])[0] for r in (22, 42)]
    # slanted: the top row starts right of the bottom row by about 0.3 × 40 px
    assert 9 <= rows[0][0] - rows[1][0] <= 14
    assert abs(len(rows[0]) - len(rows[1])) <= 2                  # sides parallel
