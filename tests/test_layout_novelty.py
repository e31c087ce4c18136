"""The scene-layout part of the defer rule's detector (heads/layout_novelty.py): its
descriptor worked out by hand, its fitting on data, and its place in the composite."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import heads.layout_novelty as ln
from heads.layout_novelty import (
    LAYOUT_FEATURE,
    LayoutNovelty,
    layout_descriptors,
    scene_descriptor,
    with_layout,
)
from heads.novelty import CompositeNovelty, Novelty, load_detector, load_part
from models.data import COLOURS, SHAPES
from models.render import Scene, _background, _place, render
from tests.helpers import edit_card

BG = (240, 240, 240)


def _slot(d: np.ndarray, k: int) -> np.ndarray:
    o = 1 + k * ln.OBJECT_DIM
    return d[o: o + ln.OBJECT_DIM]


def test_thumbnail_shares_pixels_by_area():
    soft = np.zeros((10, 10))
    soft[:, :5] = 1.0                    # the left half
    t = ln._thumbnail(soft)
    # 5 cells over 10 pixels: 2 pixels a cell; the middle cell is half covered
    assert np.allclose(t, np.tile([1.0, 1.0, 0.5, 0.0, 0.0], (5, 1)))
    soft = np.zeros((4, 7))
    soft[0, 0] = 1.0
    t = ln._thumbnail(soft)
    # cells of 0.8 × 1.4 px; pixel (0, 0) covers 0.8 × 1 of cell (0, 0) and 0.2 × 1 of
    # cell (1, 0), none of cell (0, 1)
    assert t[0, 0] == pytest.approx(0.8 / (0.8 * 1.4))
    assert t[1, 0] == pytest.approx(0.2 / (0.8 * 1.4))
    assert t[0, 1] == 0.0 and t.sum() == pytest.approx(1.0 / (0.8 * 1.4))


def test_descriptor_of_a_hand_drawn_scene():
    im = Image.new("RGB", (64, 64), BG)
    draw = ImageDraw.Draw(im)
    draw.rectangle([(10, 20), (33, 31)], fill=(255, 0, 0))        # 24 × 12 px, red
    draw.rectangle([(44, 40), (49, 45)], fill=(0, 0, 255))        # 6 × 6 px, blue
    im.putpixel((60, 5), (0, 0, 0))                               # a speck: not an object
    d = scene_descriptor(im)
    assert d.shape == (ln.DIM,)
    assert d[0] == 2 * ln.COUNT_WEIGHT                            # two objects
    big, small, empty = _slot(d, 0), _slot(d, 1), _slot(d, 2)
    assert big[0] == pytest.approx(ln.AREA_WEIGHT * np.sqrt(24 * 12 / 64 ** 2))
    assert big[1] == pytest.approx(ln.ASPECT_WEIGHT * np.log(2.0))
    assert np.allclose(big[2:5], [1.0, 0.0, 0.0])                 # interior colour
    assert big[5] == 0.0                                          # not cut by the frame
    assert np.allclose(big[6:], ln.THUMB_WEIGHT)                  # a full box: every cell
    assert small[0] == pytest.approx(ln.AREA_WEIGHT * 6 / 64) and small[1] == 0.0
    assert np.allclose(small[2:5], [0.0, 0.0, 1.0])
    assert not empty.any()
    # an object touching the edge: only its colour and the mark
    im = Image.new("RGB", (64, 64), BG)
    ImageDraw.Draw(im).ellipse([(0, 10), (20, 30)], fill=(0, 0, 0))
    o = _slot(scene_descriptor(im), 0)
    assert o[5] == 1.0 and o[0] == o[1] == 0.0 and not o[6:].any()
    assert np.allclose(o[2:5], 0.0)
    # nothing on the background: no object at all
    assert not scene_descriptor(Image.new("RGB", (64, 64), BG)).any()


def test_the_descriptor_reads_the_image_at_its_side():
    im = render(Scene(_place(np.random.default_rng(3), ["circle"], ["teal"]), BG))
    big = im.resize((128, 128), Image.BICUBIC)
    a, b = scene_descriptor(im), scene_descriptor(big)
    assert a[0] == b[0] == 1 and np.abs(a - b).max() < 0.05


def _scenes(n: int, seed: int, colours, shapes, objects: int = 1) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        idx = rng.choice(len(shapes), objects, replace=objects > len(shapes))
        s = [shapes[i] for i in idx]
        c = [colours[i] for i in rng.choice(len(colours), objects, replace=False)]
        hi = 64 if objects == 1 else 40
        out.append(render(Scene(_place(rng, s, c, hi=hi), _background(rng))))
    return out


def test_refit_without_a_shape_and_two_colours_flags_them():
    """Fitted on the recipe's scenes without triangles, red and green, the part flags
    scenes showing them, and two-object scenes; scenes of what it was fitted on it flags
    about as often as α. Nothing in it names a shape, a colour or a count: refitted on
    every shape and colour, the same triangles are not flagged."""
    kept_c = tuple(c for c in COLOURS if c not in ("red", "green"))
    kept_s = tuple(s for s in SHAPES if s != "triangle")
    alpha = 0.05

    def fitted(colours, shapes):
        det = LayoutNovelty().fit(layout_descriptors(_scenes(300, 0, colours, shapes)))
        return det.calibrate(layout_descriptors(_scenes(99, 1, colours, shapes)))

    def flagged(det, images):
        return float((det.p_value(layout_descriptors(images)) < alpha).mean())

    det = fitted(kept_c, kept_s)
    assert flagged(det, _scenes(60, 2, kept_c, kept_s)) <= 0.15
    assert flagged(det, _scenes(40, 3, kept_c, ("triangle",))) >= 0.8
    assert flagged(det, _scenes(40, 4, ("red",), kept_s)) >= 0.8
    assert flagged(det, _scenes(40, 5, ("green",), kept_s)) >= 0.8
    assert flagged(det, _scenes(40, 6, kept_c, kept_s, objects=2)) >= 0.95
    every = fitted(COLOURS, SHAPES)
    assert flagged(every, _scenes(40, 3, kept_c, ("triangle",))) <= 0.15


def test_the_layout_part_saves_loads_and_joins_the_composite(tmp_path):
    ims = _scenes(40, 7, COLOURS, SHAPES)
    x = layout_descriptors(ims)
    part = LayoutNovelty().fit(x[:30]).calibrate(x[30:])
    q = Novelty("knn", "h_pre", k=1).fit(torch.randn(20, 4)).calibrate(torch.randn(19, 4))
    det = CompositeNovelty({"question": q, "layout": part})
    assert det.reads_pixels and det.image_features == (LAYOUT_FEATURE,)
    assert not CompositeNovelty({"question": q}).reads_pixels
    det.save(tmp_path)
    back = load_detector(tmp_path)
    assert isinstance(back.parts["layout"], LayoutNovelty)
    two = _scenes(2, 8, COLOURS, SHAPES, objects=2)
    feats = with_layout({"h_pre": torch.zeros(3, 4)}, [ims[0], *two])
    assert feats[LAYOUT_FEATURE].shape == (3, ln.DIM)
    assert np.allclose(back.part_p_values(feats)["layout"], part.p_value(feats[LAYOUT_FEATURE]))
    assert back.part_p_values(feats)["layout"][1:].max() == pytest.approx(1 / 11)
    with pytest.raises(ValueError, match="layout"):
        LayoutNovelty().fit(torch.zeros(2, 3, ln.DIM))


@pytest.mark.parametrize("field,value", [("side", 128), ("descriptor", "object count"),
                                         ("descriptor", None)])
def test_a_layout_part_recording_other_vectors_is_refused(tmp_path, field, value):
    x = layout_descriptors(_scenes(20, 9, COLOURS, SHAPES))
    LayoutNovelty().fit(x[:12]).calibrate(x[12:]).save(tmp_path, "novelty.layout")
    assert LayoutNovelty.load(tmp_path, "novelty.layout").t["bank"].shape[1] == ln.DIM
    edit_card(tmp_path / "novelty.layout.json", field, value)
    with pytest.raises(ValueError, match=f"{field}: the part records"):
        load_part(tmp_path, "novelty.layout")     # as a composite loads its parts


def test_a_layout_bank_of_other_width_is_refused(tmp_path):
    x = layout_descriptors(_scenes(20, 9, COLOURS, SHAPES))
    part = LayoutNovelty().fit(x[:12]).calibrate(x[12:])
    part.t["bank"] = part.t["bank"][:, :-1].contiguous()
    part.save(tmp_path, "novelty.layout")
    with pytest.raises(ValueError, match="bank: rows of"):
        LayoutNovelty.load(tmp_path, "novelty.layout")
