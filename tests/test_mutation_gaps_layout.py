"""Tests for mutants of heads/layout_novelty.py that its own tests did not see: no images,
the side the descriptors are read at, the bank's cap and its extension.

No actor is built; the images are drawn by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import heads.layout_novelty as ln
from heads.layout_novelty import LAYOUT_FEATURE, LayoutNovelty, layout_descriptors, with_layout


def _small_square() -> Image.Image:
    """A 3 × 3 px square at 64 px (9 px, an object); read at 32 px it is under MIN_AREA."""
    im = Image.new("RGB", (64, 64), (240, 240, 240))
    ImageDraw.Draw(im).rectangle([(30, 30), (32, 32)], fill=(0, 0, 255))
    return im


def _x(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).random((n, ln.DIM), dtype=np.float32))


def test_no_images_give_no_rows_of_the_descriptor_width():
    x = layout_descriptors([])
    assert x.shape == (0, ln.DIM) and x.dtype == torch.float32
    assert with_layout({}, [])[LAYOUT_FEATURE].shape == (0, ln.DIM)


def test_descriptors_are_read_at_the_side_asked_for():
    im = _small_square()
    assert layout_descriptors([im])[0, 0] == ln.COUNT_WEIGHT             # one object at 64
    assert layout_descriptors([im], side=32)[0, 0] == 0                   # a speck at 32
    assert with_layout({}, [im], side=32)[LAYOUT_FEATURE][0, 0] == 0


def test_a_bank_over_its_cap_keeps_that_many_distinct_rows_in_order():
    x = _x(10, 0)
    part = LayoutNovelty(max_bank=8).fit(x)
    bank = part.t["bank"]
    assert bank.shape == (8, ln.DIM)
    rows = [int(np.flatnonzero((x.double() == r).all(1))[0]) for r in bank]
    assert len(set(rows)) == 8 and rows == sorted(rows)                  # rows of x, in order
    assert torch.equal(LayoutNovelty(max_bank=8).fit(x).t["bank"], bank)  # the same subsample
    assert torch.equal(LayoutNovelty(max_bank=10).fit(x).t["bank"], x.double())


def test_extend_bank_adds_rows_keeps_the_reference_and_the_cap():
    x = _x(8, 1)
    part = LayoutNovelty(max_bank=6).fit(x[:3]).calibrate(x[3:5])
    cal = part.t["calibration"].clone()
    new = x[5:7]
    assert (part.score(new) > 0.5).all()
    assert part.extend_bank(new) is part
    assert torch.equal(part.t["bank"], torch.cat([x[:3], new]).double())
    assert (part.score(new) < 0.01).all()           # now in the bank (distances: float error)
    assert torch.equal(part.t["calibration"], cal)                        # the reference stays
    part.extend_bank(x[7].reshape(-1))                                    # one flat row
    assert torch.equal(part.t["bank"][-1], x[7].double())
    part.extend_bank(_x(3, 2))                                            # past the cap
    assert part.t["bank"].shape == (6, ln.DIM)


def _two_objects(side: int) -> Image.Image:
    im = Image.new("RGB", (side, side), (240, 240, 240))
    draw = ImageDraw.Draw(im)
    s = side / 128
    draw.ellipse([(20 * s, 30 * s), (70 * s, 90 * s)], fill=(200, 30, 60))
    draw.rectangle([(90 * s, 90 * s), (97 * s, 97 * s)], fill=(0, 0, 255))
    return im


def test_an_image_of_another_size_is_read_as_its_bilinear_copy_at_the_side():
    im = _two_objects(128)
    d = ln.scene_descriptor(im)
    assert np.array_equal(d, ln.scene_descriptor(im.resize((64, 64), Image.BILINEAR)))
    # the filter matters (the bank was fitted with bilinear copies)
    assert not np.allclose(d, ln.scene_descriptor(im.resize((64, 64), Image.BICUBIC)))


def test_a_grey_image_is_read_as_its_rgb_copy():
    im = _two_objects(64).convert("L")
    assert ln.scene_descriptor(im)[0] == 2 * ln.COUNT_WEIGHT
    assert np.array_equal(ln.scene_descriptor(im), ln.scene_descriptor(im.convert("RGB")))


def test_background_is_the_median_of_each_channel_over_the_border_ring():
    v = np.full((5, 5), 0.9)                  # the inside: not border
    v[0], v[-1] = 0.0, 1.0                    # top and bottom rows
    v[1:-1, 0] = [0.2, 0.4, 0.6]              # left and right columns, inside rows
    v[1:-1, -1] = [0.3, 0.5, 0.7]
    v[1, 1:-1], v[-2, 1:-1] = 0.9, 0.1        # the rows next to the border
    x = np.stack([v, 1 - v, v], axis=-1)
    # 16 border pixels: five 0s, five 1s and .2 .3 .4 .5 .6 .7: the median is (.4 + .5) / 2
    assert np.allclose(ln.background(x), [0.45, 0.55, 0.45])


def test_the_score_is_the_distance_to_the_nearest_bank_row():
    bank = torch.zeros(2, ln.DIM)
    bank[1, 0] = 3.0
    part = LayoutNovelty().fit(bank)
    q = torch.zeros(1, ln.DIM)
    q[0, 0], q[0, 1] = 2.0, 1.0
    assert part.score(q) == pytest.approx([np.sqrt(2.0)], abs=1e-5)   # nearest: row 1
    two = torch.cat([q, torch.zeros(1, ln.DIM)])
    assert part.score(two) == pytest.approx([np.sqrt(2.0), 0.0], abs=1e-5)
    assert part.score(torch.zeros(0, ln.DIM)).shape == (0,)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 11, 37])
def test_quantile90_is_numpys_linear_quantile(n):
    v = np.random.default_rng(n).permutation(np.arange(n) ** 2).astype(float)
    assert ln._quantile90(v) == pytest.approx(np.quantile(v, 0.9))


def _on_grey(*boxes: tuple[tuple[int, int, int, int], tuple[int, int, int]]) -> Image.Image:
    im = Image.new("RGB", (64, 64), (240, 240, 240))
    draw = ImageDraw.Draw(im)
    for (x0, y0, x1, y1), fill in boxes:
        draw.rectangle([(x0, y0), (x1, y1)], fill=fill)
    return im


def test_an_object_differing_in_one_channel_is_found():
    for fill in [(100, 240, 240), (240, 100, 240), (240, 240, 100)]:
        assert ln.scene_descriptor(_on_grey(((20, 20, 30, 30), fill)))[0] == ln.COUNT_WEIGHT


def test_a_channel_exactly_the_threshold_off_the_background_is_not_an_object():
    # 51 of 255 on black: float32(51/255) is float32(0.2), and NumPy 2 compares a float32
    # array with the Python float FOREGROUND in float32, so only "more than" leaves it out
    im = Image.new("RGB", (64, 64), (0, 0, 0))
    ImageDraw.Draw(im).rectangle([(20, 20), (39, 39)], fill=(51, 0, 0))
    assert ln.scene_descriptor(im)[0] == 0
    ImageDraw.Draw(im).rectangle([(20, 20), (39, 39)], fill=(52, 0, 0))
    assert ln.scene_descriptor(im)[0] == ln.COUNT_WEIGHT


def test_objects_touching_at_a_corner_are_one_and_min_area_is_an_object():
    corner = _on_grey(((10, 10, 12, 12), (0, 0, 255)), ((13, 13, 15, 15), (0, 0, 255)))
    d = ln.scene_descriptor(corner)
    assert d[0] == ln.COUNT_WEIGHT                                  # 8-connected: one
    assert d[1] == pytest.approx(ln.AREA_WEIGHT * np.sqrt(18 / 64 ** 2))
    assert ln.scene_descriptor(_on_grey(((10, 10, 12, 11), (0, 0, 0))))[0] == 1   # 6 px
    assert ln.scene_descriptor(_on_grey(((10, 10, 14, 10), (0, 0, 0))))[0] == 0   # 5 px


def test_descriptors_are_float32():
    im = _two_objects(64)
    assert ln.scene_descriptor(im).dtype == np.float32
    assert layout_descriptors([im]).dtype == torch.float32


def _slot(d: np.ndarray, k: int) -> np.ndarray:
    o = 1 + k * ln.OBJECT_DIM
    return d[o: o + ln.OBJECT_DIM]


@pytest.mark.parametrize("box", [(20, 0, 30, 10), (20, 53, 30, 63), (0, 20, 10, 30),
                                 (53, 20, 63, 30)])
def test_an_object_touching_any_one_edge_gets_the_mark(box):
    o = _slot(ln.scene_descriptor(_on_grey((box, (0, 0, 255)))), 0)
    assert o[5] == 1.0 and o[0] == o[1] == 0.0 and not o[6:].any()
    x0, y0, x1, y1 = box                                 # one pixel off that edge: no mark
    inside = (x0 + (x0 == 0) - (x1 == 63), y0 + (y0 == 0) - (y1 == 63),
              x1 + (x0 == 0) - (x1 == 63), y1 + (y0 == 0) - (y1 == 63))
    o = _slot(ln.scene_descriptor(_on_grey((inside, (0, 0, 255)))), 0)
    assert o[5] == 0.0 and o[0] > 0


def test_another_object_inside_the_box_is_not_part_of_the_outline():
    im = _on_grey(((10, 10, 39, 39), (0, 0, 255)), ((12, 12, 37, 37), (240, 240, 240)),
                  ((20, 20, 29, 29), (255, 0, 0)))      # a blue frame round a red square
    d = ln.scene_descriptor(im)
    assert d[0] == 2 * ln.COUNT_WEIGHT
    frame = _slot(d, 0)[6:].reshape(ln.GRID, ln.GRID) / ln.THUMB_WEIGHT
    assert frame[2, 2] == 0.0                            # the red square is not the frame's
    assert np.allclose(_slot(d, 0)[2:5], [0, 0, 1])


def test_the_colour_is_the_full_contrast_pixels_and_the_outline_saturates():
    im = _on_grey(((20, 20, 40, 40), (0, 0, 255)), ((23, 23, 37, 37), (240, 240, 140)))
    ring = _slot(ln.scene_descriptor(im), 0)     # a blue ring (d = 240/255), core d = 100/255
    assert np.allclose(ring[2:5], [0, 0, 1])                # the core is not the colour
    thumb = ring[6:].reshape(ln.GRID, ln.GRID) / ln.THUMB_WEIGHT
    assert thumb[2, 2] == pytest.approx(100 / 240, abs=1e-5)
    # a few pixels of more contrast than the level (the 90th percentile) count as 1
    im = _on_grey(((20, 20, 40, 40), (240, 240, 100)), ((29, 29, 31, 31), (0, 0, 0)))
    thumb = _slot(ln.scene_descriptor(im), 0)[6:].reshape(ln.GRID, ln.GRID)
    assert np.allclose(thumb / ln.THUMB_WEIGHT, 1.0)


def test_faint_background_in_the_box_counts_in_the_outline_not_in_the_colour():
    im = _on_grey(((20, 20, 40, 40), (240, 240, 186)))      # d = 54/255: the level
    for xy in [(20, 20), (20, 21), (21, 20)]:              # d = 49/255: background
        im.putpixel(xy, (240, 240, 191))
    o = _slot(ln.scene_descriptor(im), 0)
    assert ln.scene_descriptor(im)[0] == 1
    assert o[4] == pytest.approx(186 / 255, abs=1e-5)       # the faint pixels: not its colour
    cell = 21 / ln.GRID                                     # 4.2 px a side
    by_hand = 1 - 3 * (1 - 49 / 54) / cell ** 2              # they count at 49/54
    assert o[6] / ln.THUMB_WEIGHT == pytest.approx(by_hand, abs=1e-4)


def test_equal_areas_fill_the_slots_in_reading_order():
    sizes = [12, 12, 9, 9, 9, 9, 9, 9, 16, 12, 16, 12, 12, 16, 16, 12, 12, 12, 16, 9, 16,
             16, 9, 12, 16, 12, 9, 16]              # numpy's default sort reorders these ties
    boxes = []
    for k, a in enumerate(sizes):
        x0, y0 = 2 + 9 * (k % 7), 4 + 9 * (k // 7)
        w, h = {9: (3, 3), 12: (4, 3), 16: (4, 4)}[a]
        boxes.append(((x0, y0, x0 + w - 1, y0 + h - 1), (0, k * 9, 255)))
    d = ln.scene_descriptor(_on_grey(*boxes))
    assert d[0] == 28
    first = [k for k, a in enumerate(sizes) if a == 16][:3]      # 8, 10, 13
    for slot, k in enumerate(first):
        assert _slot(d, slot)[3] == pytest.approx(k * 9 / 255, abs=1e-6)


def test_the_outline_rows_are_built_once_per_bank_and_again_after_an_extension():
    # the cache is the point of `_outline_bank` (building the rows cost more than a score)
    x = _x(6, 3)
    part = ln.NearLayoutNovelty().fit(x[:4])
    cols, rows = part._outline_bank()
    again = part._outline_bank()
    assert again[0] is cols and again[1] is rows                          # reused, not rebuilt
    assert torch.equal(rows, part.t["bank"][:, cols].float())
    part.extend_bank(x[4:])
    cols2, rows2 = part._outline_bank()
    assert rows2 is not rows and torch.equal(rows2, part.t["bank"][:, cols2].float())
    assert part._outline_bank()[1] is rows2


def test_the_ray_profile_averages_zero_for_an_object_whose_rays_average_under_a_pixel():
    # a bright 1 × 2 px core in a faint 4 × 3 px box (12 px, an object): the soft mask is
    # ½ or more only on the core, so its rays average about 0.96 px; the profile is the
    # rays over their mean, whatever that mean (the floor only guards an empty mask)
    im = Image.new("RGB", (64, 64), (0, 0, 0))
    draw = ImageDraw.Draw(im)
    draw.rectangle([(30, 30), (33, 32)], fill=(54, 54, 54))              # 54/255 > 0.2
    draw.rectangle([(31, 31), (32, 31)], fill=(255, 255, 255))
    v = ln.scene_descriptor(im, outline=ln.Outline(rays=8))
    assert v[0] == ln.COUNT_WEIGHT
    prof = v[ln.DIM: ln.DIM + 8]
    assert abs(float(prof.mean())) < 1e-6
    assert np.isclose(prof[0], prof[4]) and np.isclose(prof[2], prof[6])
    assert prof[0] > 0 > prof[2]                                          # wider than tall
