"""The layout part's optional outline numbers (heads/layout_novelty.py, `Outline`): worked
out by hand on drawn objects; the shipped descriptor (version 1) unchanged by them."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from scipy import stats

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


def test_moments_of_a_triangle_are_its_pixel_coordinates_moments():
    # a slanted triangle: skewed, correlated, not symmetric about either axis
    tri = (np.arange(12)[None, :] <= 1.3 * np.arange(9)[:, None] + 1).astype(float)
    ys, xs = np.nonzero(tri)
    zx, zy = (xs - xs.mean()) / xs.std(), (ys - ys.mean()) / ys.std()
    want = [np.mean(zx * zy), stats.skew(xs), stats.skew(ys),
            stats.kurtosis(xs, fisher=False), stats.kurtosis(ys, fisher=False),
            np.mean(zx ** 2 * zy ** 2), np.mean(zx ** 2 * zy), np.mean(zx * zy ** 2)]
    assert np.allclose(ln._moments(tri), want, atol=1e-9)
    assert len(set(np.round(want, 6))) == 8                        # no two alike


def test_moments_of_a_bar_two_pixels_thick():
    # a coordinate's variance under 1 (two rows: 1/4) is standardised like any other
    for bar, across in ((np.ones((2, 24)), 4), (np.ones((24, 2)), 3)):
        m = ln._moments(bar)
        assert m[across] == pytest.approx(1.0) and m[5] == pytest.approx(1.0)


def test_rays_of_drawn_masks_worked_out_by_hand():
    # an L: a 10 x 20 bar over a 10 x 10 block at its left; centroid (7⅚, 7⅚); a ray
    # leaves it at a pixel's edge: right 19.5 and down 19.5, up and left −0.5
    ell = np.zeros((20, 20))
    ell[:10, :] = 1.0
    ell[10:, :10] = 1.0
    r = np.array([19.5 - 47 / 6, 47 / 6 + 0.5, 47 / 6 + 0.5, 19.5 - 47 / 6])
    assert np.allclose(ln._rays(ell, 4), r / r.mean() - 1, atol=1e-9)
    # a 21 x 5 block with a 3-px bar to its right: centroid (10, 12); rightwards the ray
    # does not leave the object within the half diagonal + 2 and is read at its last
    # sample, 24.5 px
    flag = np.zeros((21, 40))
    flag[:, :5] = 1.0
    flag[9:12, 5:] = 1.0
    r = np.array([24.5, 1.5, 12.5, 1.5])
    assert np.allclose(ln._rays(flag, 4), r / r.mean() - 1, atol=1e-9)
    # a frame: the centroid is off the object, every ray 0 (−1 after the mean)
    frame = np.ones((12, 12))
    frame[2:-2, 2:-2] = 0.0
    assert np.array_equal(ln._rays(frame, 4), -np.ones(4))
    # a one-pixel diagonal line: the centroid sits where it is exactly ½; across it the
    # rays are 0, along the axes ½ px, along it ≈ 3.95 (2.5·√2 to the last pixel's centre,
    # then where the bilinear value falls to ½, (1 − √½)·√2 further)
    out = ln._rays(np.eye(6), 8)
    assert np.array_equal(out[[1, 5]], [-1.0, -1.0])
    assert np.allclose(out[[0, 2, 4, 6]], out[0]) and out[3] == pytest.approx(out[7])
    along = 2.5 * np.sqrt(2) + (1 - np.sqrt(0.5)) * np.sqrt(2)
    assert (1 + out[3]) / (1 + out[0]) == pytest.approx(along / 0.5, abs=0.02)


def test_outline_numbers_of_a_partial_mask_and_of_no_outline():
    soft = np.zeros((4, 4))
    soft[:2, :2] = 1.0                                   # the top-left quarter
    got = ln._outline(soft, Outline(grid=2, grid_weight=3.0), gain=5.0)
    assert np.allclose(got, [1.5, 0.0, 0.0, 0.0])        # weight/grid, not scaled by gain
    assert ln._outline(soft, Outline()).shape == (0,)


def test_outline_text_and_the_part_class_it_names():
    assert Outline().text() == "none"
    o = Outline(grid=6, grid_weight=2.0, moments=True, moment_weight=0.5, rays=16,
                ray_weight=3.0, sized=True, aspect_weight=1.0, area_weight=0.5,
                colour_weight=0.25, shape_factor=2.0)
    assert o.text() == ("6x6 thumbnail (weight 2), standardised moments (weight 0.5), "
                        "16-ray radial profile (weight 3), times 2·sqrt(area share) capped "
                        "at 1, aspect weight 1, area weight 0.5, colour weight 0.25, score "
                        "also 2 x nearest outline")
    cls = outline_part(o, "layout_knn_x", "scene_x")
    assert issubclass(cls, ln.OutlineLayoutNovelty) and cls.KIND == "layout_knn_x"
    assert cls.OUTLINE is o and cls.DIM == ln.DIM + ln.SLOTS * (36 + 8 + 16)
    assert cls.DESCRIBED == {"side": ln.SIDE, "descriptor": ln.DESCRIBED["descriptor"]
                             + "; outline: " + o.text()}
    part = cls()
    assert (part.kind, part.feature) == ("layout_knn_x", "scene_x")


def test_shape_columns_without_outline_numbers():
    keep = shape_columns(None)
    assert keep.dtype == bool and keep.shape == (ln.DIM,)
    assert keep.sum() == ln.DIM - 4 * ln.SLOTS


def test_the_outline_score_is_the_distances_written_out_bit_for_bit():
    # the bank's outline rows are kept between calls: the score is still the one written
    # out from the bank (as it was first computed), and follows a new bank
    part = load_part(SHIPPED, "novelty.layout")
    x = layout_descriptors([it.image() for it in load("render:plain:6")],
                           outline=ln.NEAR_OUTLINE).double()
    x[1, 3:6] = torch.tensor([0.1, 0.9, 0.4], dtype=torch.float64)    # an unseen colour
    cols = torch.from_numpy(shape_columns(ln.NEAR_OUTLINE))

    def as_written() -> np.ndarray:
        b, a = part.t["bank"].float(), x.float()
        scene = ((a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2.0 * (a @ b.T)).min(1).values
        outline = torch.cdist(a[:, cols], part.t["bank"][:, cols].float()).min(1).values
        return np.maximum(scene.clamp_min(0).sqrt().double().numpy(),
                          ln.NEAR_OUTLINE.shape_factor * outline.double().numpy())

    assert np.array_equal(part.score(x), as_written())
    x[:, 1 + 6] += 0.3                # a thumbnail cell no fitting outline has, now banked
    assert (part.score(x)[:2] > 0.5).all()
    part.extend_bank(x[:2])
    assert np.array_equal(part.score(x), as_written())
    assert (part.score(x)[:2] < 1e-3).all()


def test_prepare_builds_the_banks_the_score_reads_and_an_extension_rebuilds_them():
    part = load_part(SHIPPED, "novelty.layout")
    assert not hasattr(part, "_b32") and not hasattr(part, "_outlines")
    assert part.prepare() is part
    assert part._b32[0] is part.t["bank"] and part._outlines[0] is part.t["bank"]
    x = layout_descriptors([it.image() for it in load("render:plain:6")],
                           outline=ln.NEAR_OUTLINE).double()
    part.extend_bank(x[:2])
    assert part._b32[0] is part.t["bank"] and part._outlines[0] is part.t["bank"]
    fresh = type(part)()
    fresh.t = dict(part.t)
    assert np.array_equal(part.score(x), fresh.score(x))
    # without an outline score no outline rows; without a bank nothing
    for cls in (ln.LayoutNovelty, outline_part(Outline(), "layout_knn_no_shape_score")):
        plain = cls().fit(x[:, :ln.DIM]).prepare()
        assert plain._b32[0] is plain.t["bank"] and not hasattr(plain, "_outlines")
    for empty in (ln.LayoutNovelty(), ln.NearLayoutNovelty()):
        assert empty.prepare() is empty and not hasattr(empty, "_b32")


def test_outline_score_of_no_rows_and_of_more_rows_than_a_block():
    part = outline_part(Outline(shape_factor=2.0), "layout_knn_test")().fit(
        torch.zeros(3, ln.DIM, dtype=torch.float64))
    assert part.score(torch.zeros(0, ln.DIM)).shape == (0,)
    q = torch.zeros(1500, ln.DIM, dtype=torch.float64)
    q[:, 1] = torch.linspace(0.0, 1.0, 1500)             # an area only: scene distance
    q[:, 2] = 0.5                                        # and an aspect: the outline's
    want = np.maximum(np.hypot(q[:, 1].numpy(), 0.5), 2 * 0.5)
    assert np.allclose(part.score(q), want, atol=1e-6)


def test_a_large_object_keeps_its_outline_numbers_at_full_weight():
    im = Image.new("RGB", (64, 64), BG)
    ImageDraw.Draw(im).rectangle([(10, 12), (49, 51)], fill=(0, 128, 0))   # 40 × 40 px
    plain = scene_descriptor(im, outline=Outline(moments=True, rays=8))
    sized = scene_descriptor(im, outline=Outline(moments=True, rays=8, sized=True))
    assert 2 * np.sqrt(40 * 40 / 64 ** 2) > 1                     # the gain is capped at 1
    assert np.array_equal(sized, plain) and np.abs(plain[ln.DIM: ln.DIM + 16]).max() > 0.1


def test_layout_descriptors_of_no_images_have_the_outline_width():
    o = Outline(grid=3, rays=4)
    none = layout_descriptors([], outline=o)
    assert none.shape == (0, ln.DIM + ln.SLOTS * 13) and none.dtype == torch.float32
    assert layout_descriptors([]).shape == (0, ln.DIM)
