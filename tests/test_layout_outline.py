"""The layout part's optional outline numbers (heads/layout_novelty.py, `Outline`): worked
out by hand on drawn objects; the shipped descriptor (version 1) unchanged by them."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import heads.layout_novelty as ln
from heads.layout_novelty import (
    LayoutNovelty,
    Outline,
    layout_descriptors,
    outline_part,
    scene_descriptor,
    shape_columns,
)
from heads.novelty import load_part
from models.data import load
from models.render import Obj, Scene, render

BG = (240, 240, 240)
SHIPPED = Path(__file__).resolve().parents[1] / "heads" / "embedded"


def _box_scene() -> Image.Image:
    im = Image.new("RGB", (64, 64), BG)
    draw = ImageDraw.Draw(im)
    draw.rectangle([(10, 20), (33, 31)], fill=(255, 0, 0))        # 24 × 12 px, red
    draw.rectangle([(44, 40), (49, 45)], fill=(0, 0, 255))        # 6 × 6 px, blue
    return im


def _uniform_kurtosis(n: int) -> float:
    """Kurtosis of n equally spaced, equally weighted positions (a row of pixels)."""
    return 3 - 6 * (n * n + 1) / (5 * (n * n - 1))


def test_outline_numbers_of_a_hand_drawn_box():
    o = Outline(grid=6, grid_weight=2.0, moments=True, moment_weight=0.5, rays=4,
                ray_weight=3.0)
    assert o.dim == 36 + 8 + 4
    im = _box_scene()
    d = scene_descriptor(im, outline=o)
    assert d.shape == (ln.DIM + ln.SLOTS * o.dim,)
    assert np.array_equal(d[:ln.DIM], scene_descriptor(im))        # version 1 first, as is
    big = d[ln.DIM: ln.DIM + o.dim]
    assert np.allclose(big[:36], 2.0 / 6)                         # a full box: every cell
    m = big[36:44] / 0.5 + ln.DISC_MOMENTS                        # the moments themselves
    # a 24 × 12 box: coordinates independent and uniform, no skew, no correlation
    want = [0.0, 0.0, 0.0, _uniform_kurtosis(24), _uniform_kurtosis(12), 1.0, 0.0, 0.0]
    assert np.allclose(m, want, atol=1e-5)
    # from the centre, the box's half-widths right, up, left, down: 12, 6, 12, 6; mean 9
    assert np.allclose(big[44:] / (3.0 / 2), [1 / 3, -1 / 3, 1 / 3, -1 / 3], atol=1e-4)
    small = d[ln.DIM + o.dim: ln.DIM + 2 * o.dim]
    assert np.allclose(small[:36], 2.0 / 6) and np.allclose(small[44:], 0.0, atol=1e-4)
    assert not d[ln.DIM + 2 * o.dim:].any()                       # the empty third slot


def test_sized_outline_numbers_and_reweighted_slots():
    im = _box_scene()
    plain = scene_descriptor(im, outline=Outline(moments=True))
    o = Outline(moments=True, sized=True, aspect_weight=1.0, area_weight=0.5,
                colour_weight=0.25)
    d = scene_descriptor(im, outline=o)
    share = np.sqrt(24 * 12 / 64 ** 2)                            # the red box's
    gain = 2 * share                                               # below 1: scaled
    assert np.allclose(d[ln.DIM: ln.DIM + 8], gain * plain[ln.DIM: ln.DIM + 8], atol=1e-6)
    assert d[2] == pytest.approx(np.log(2.0))                     # aspect at weight 1
    assert d[1] == pytest.approx(0.5 * share)                     # area at weight 0.5
    assert np.allclose(d[3:6], [0.25, 0.0, 0.0])                  # colour at weight 0.25
    blue = 1 + ln.OBJECT_DIM
    assert np.allclose(d[blue + 2: blue + 5], [0.0, 0.0, 0.25])


def test_drawn_disc_box_and_octagon_moments():
    def moments(shape):
        im = render(Scene((Obj(shape, "black", (24, 24, 104, 104)),), BG))
        return scene_descriptor(im, outline=Outline(moments=True))[ln.DIM: ln.DIM + 8]

    disc, box, octagon = moments("circle"), moments("rectangle"), moments("octagon")
    assert np.abs(disc).max() < 0.01                              # close to a true disc
    # a 40-px square: kurtoses 1.8 (less the disc's 2), E[x²y²] 1 (less 2/3)
    assert np.allclose(box[3:6], [_uniform_kurtosis(40) - 2, _uniform_kurtosis(40) - 2,
                                  1 / 3], atol=0.01)
    # an octagon is within 0.02 of the disc in every moment: why moments do not part them
    assert np.abs(octagon).max() < 0.02 and np.abs(octagon - disc).max() > 0.005


def test_shape_columns_leave_out_area_and_colour():
    o = Outline(grid=4)
    keep = shape_columns(o)
    assert keep.shape == (ln.DIM + 3 * 16,) and keep[ln.DIM:].all() and keep[0]
    for slot in range(ln.SLOTS):
        b = 1 + slot * ln.OBJECT_DIM
        assert list(keep[b: b + 6]) == [False, True, False, False, False, True]
        assert keep[b + 6: b + ln.OBJECT_DIM].all()
    assert keep.sum() == len(keep) - 4 * ln.SLOTS


def test_outline_score_is_the_larger_of_scene_and_outline_distance():
    part_cls = outline_part(Outline(shape_factor=2.0), "layout_knn_test")
    bank = torch.zeros(2, ln.DIM, dtype=torch.float64)
    bank[:, 0] = 1.0
    bank[0, 3:6] = torch.tensor([1.0, 0.0, 0.0])                  # a red object
    bank[1, 3:6] = torch.tensor([0.0, 0.0, 1.0])                  # a blue one
    part = part_cls().fit(bank)
    q = bank[:1].clone()
    q[0, 3:6] = torch.tensor([0.0, 1.0, 0.0])                     # green: far as a scene,
    assert part.score(q)[0] == pytest.approx(np.sqrt(2.0))        # its outline is known
    q = bank[:1].clone()
    q[0, 2] = 0.3                                                 # another aspect only
    assert part.score(q)[0] == pytest.approx(2.0 * 0.3)           # the outline's, ×2
    assert LayoutNovelty().fit(bank).score(q)[0] == pytest.approx(0.3)


def test_the_shipped_layout_part_is_the_outline_version_and_scores_by_hand():
    card = json.loads((SHIPPED / "novelty.layout.json").read_text())
    cls = ln.NearLayoutNovelty
    assert card["kind"] == cls.KIND and card["descriptor"] == cls.DESCRIBED["descriptor"]
    part = load_part(SHIPPED, "novelty.layout")
    assert type(part) is cls and part.t["bank"].shape[1] == cls.DIM
    ims = [it.image() for it in load("render:plain:6")]
    x = layout_descriptors(ims, outline=ln.NEAR_OUTLINE).double()
    bank = part.t["bank"]
    cols = torch.from_numpy(shape_columns(ln.NEAR_OUTLINE))
    scene = torch.cdist(x, bank).min(1).values
    outline = torch.cdist(x[:, cols].float(), bank[:, cols].float()).min(1).values.double()
    by_hand = torch.maximum(scene, ln.NEAR_OUTLINE.shape_factor * outline).numpy()
    assert np.allclose(part.score(x), by_hand, atol=1e-4)


def test_an_outline_part_saves_loads_and_refuses_version_1_vectors(tmp_path):
    ims = [it.image() for it in load("render:plain:20")]
    cls = ln.NearLayoutNovelty
    x = layout_descriptors(ims, outline=cls.OUTLINE)
    assert x.shape[1] == cls.DIM == ln.DIM + ln.SLOTS * cls.OUTLINE.dim
    part = cls().fit(x[:12]).calibrate(x[12:])
    part.save(tmp_path, "novelty.layout")
    back = load_part(tmp_path, "novelty.layout")
    assert type(back) is cls
    assert np.allclose(back.score(x), part.score(x))
    with pytest.raises(ValueError, match="a layout novelty part is of kind"):
        LayoutNovelty.load(tmp_path, "novelty.layout")            # not read as version 1
    v1 = layout_descriptors(ims)
    LayoutNovelty().fit(v1[:12]).calibrate(v1[12:]).save(tmp_path, "old")
    with pytest.raises(ValueError, match="a layout novelty part is of kind"):
        cls.load(tmp_path, "old")                                 # version 1: another kind
    other = outline_part(Outline(grid=3, shape_factor=2.0), cls.KIND, cls.FEATURE)
    y = layout_descriptors(ims, outline=other.OUTLINE)
    other().fit(y[:12]).calibrate(y[12:]).save(tmp_path, "other")
    with pytest.raises(ValueError, match="descriptor: the part records"):
        cls.load(tmp_path, "other")                               # same kind, other outline
