"""Tests for mutants of heads/pixel_novelty.py that its own tests did not see: the side
the descriptors are read at, distinct rows of no images, the coreset's subsample and its
greedy k-centre against a reference run here, the bank index's routing rows, a batch
added to the bank, an image's score held outside its largest routed upper bounds, and
two descriptors that float32 orders the other way round; images of another mode or size,
no images, the Sobel taps, the defaults' stride, the index built once (and by `prepare`),
the score's refusal, and more candidates than two blocks of the exact read.

No actor is built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from heads.pixel_novelty import (
    DIM,
    NEAR_CENTRE,
    PIXEL_FEATURE,
    ROWS,
    BankIndex,
    PixelNovelty,
    _d2,
    _nearest_d2,
    coreset,
    coreset_order,
    distinct,
    distinct_rows,
    with_pixels,
)


def _k_centre(z: np.ndarray, size: int) -> list[int]:
    """Greedy farthest-point traversal from row 0, in float64: the reference."""
    chosen = [0]
    d = ((z - z[0]) ** 2).sum(1)
    for _ in range(size - 1):
        i = int(d.argmax())
        chosen.append(i)
        d = np.minimum(d, ((z - z[i]) ** 2).sum(1))
    return sorted(chosen)


def _index_of(z: torch.Tensor, rows: torch.Tensor) -> list[int]:
    return [int(torch.nonzero((z == r).all(1))[0]) for r in rows]


def test_pixels_are_read_at_the_side_asked_for():
    im = Image.new("RGB", (64, 64), (240, 240, 240))
    ImageDraw.Draw(im).ellipse([(10, 10), (40, 40)], fill=(200, 30, 30))
    assert with_pixels({}, [im], side=32)[PIXEL_FEATURE].shape == (1, 16 * 16, DIM)
    assert with_pixels({}, [im])[PIXEL_FEATURE].shape == (1, 32 * 32, DIM)


def test_distinct_rows_per_image_and_of_no_images():
    x = torch.tensor([[[1.0, 2.0], [1.0, 2.0], [0.0, 5.0]],
                      [[1.0, 2.0], [3.0, 3.0], [3.0, 3.0]]])
    assert distinct_rows(x).tolist() == [[0.0, 5.0], [1.0, 2.0], [1.0, 2.0], [3.0, 3.0]]
    assert distinct_rows(torch.zeros(0, 5, 3)).shape == (0, 3)


def test_coreset_is_greedy_k_centre_from_row_zero():
    z = torch.from_numpy(np.random.default_rng(0).normal(size=(30, 4)))
    got = coreset(z, 6)
    assert _index_of(z, got) == _k_centre(z.numpy(), 6)
    assert torch.equal(coreset(z, 30), z) and torch.equal(coreset(z, 31), z)
    twice = torch.cat([z[:3], z[2:3]])                 # a row in two images' descriptors
    assert torch.equal(coreset(twice, 4), twice)


def test_coreset_draws_its_pool_without_replacement_and_with_its_seed():
    z = torch.from_numpy(np.random.default_rng(1).normal(size=(10, 3)))
    got = coreset(z, 9, pool=9)          # every pooled row is chosen: the pool itself
    rows = _index_of(z, got)
    assert len(set(rows)) == 9 and rows == sorted(rows)
    assert torch.equal(coreset(z, 9, pool=9, seed=0), got)
    others = {tuple(_index_of(z, coreset(z, 9, pool=9, seed=s))) for s in range(1, 6)}
    assert others - {tuple(rows)}                      # another seed, another pool


def test_extend_bank_takes_a_batch_of_images():
    rng = np.random.default_rng(2)
    part = PixelNovelty(max_bank=100).fit(torch.from_numpy(rng.random((1, 4, DIM))))
    batch = torch.from_numpy(rng.random((2, 3, DIM)))
    part.extend_bank(batch)
    assert part.t["bank"].shape == (4 + 6, DIM)
    assert np.allclose(part.score(batch.float()), 0.0, atol=1e-3)


def test_coreset_order_is_the_k_centre_order():
    z = torch.from_numpy(np.random.default_rng(3).normal(size=(40, 5)))
    zn = z.numpy()
    chosen = [0]
    d = ((zn - zn[0]) ** 2).sum(1)
    for _ in range(7):
        chosen.append(int(d.argmax()))
        d = np.minimum(d, ((zn - zn[chosen[-1]]) ** 2).sum(1))
    assert coreset_order(z, 8).tolist() == chosen
    assert coreset_order(z, 1).tolist() == [0]
    none = coreset_order(z, 0)
    assert none.shape == (0,) and none.dtype == torch.long


def test_the_bank_index_keeps_the_rows_nearest_each_centre():
    bank = torch.from_numpy(np.random.default_rng(4).normal(size=(NEAR_CENTRE + 60, 3)))
    index = BankIndex(bank)
    assert index.b2max == float((bank.float() ** 2).sum(1).max())
    for c, kept in zip(index.centres, index.groups):
        d = ((bank.float() - c) ** 2).sum(1)
        far = d.topk(len(bank) - NEAR_CENTRE).values            # the rows left out
        assert ((kept - c) ** 2).sum(1).max() <= far.min() + 1e-5
    assert BankIndex(torch.zeros(0, 3)).b2max == 0.0


def test_a_one_row_bank_scores_the_distance_to_it():
    row = torch.zeros(1, 1, DIM, dtype=torch.float64)
    part = PixelNovelty().fit(row)
    x = torch.zeros(1, 2, DIM)
    x[0, 1, 0] = 3.0
    assert part.score(x) == pytest.approx([3.0])


def test_distinct_groups_rows_exactly_even_when_their_keys_collide():
    # the key weighs the columns by the square roots of 1 and 2 (as torch computes them):
    # (√2, 0) and (0, 1) share a key
    r2 = float(torch.linspace(1.0, 2.0, 2, dtype=torch.float64).sqrt()[1])
    flat = torch.tensor([[r2, 0.0], [0.0, 1.0], [r2, 0.0], [5.0, 5.0]], dtype=torch.float64)
    w = torch.tensor([1.0, r2], dtype=torch.float64)
    assert float(flat[0] @ w) == float(flat[1] @ w)
    rows, inv = distinct(flat)
    assert torch.equal(rows[inv], flat)
    assert len(rows) == 3 and inv[0] == inv[2] and len({int(inv[0]), int(inv[1]),
                                                         int(inv[3])}) == 3
    # two rows alone in one call: (0, 1) shares (√2, 0)'s key, (0, 2) shares (2√2, 0)'s
    flat = torch.tensor([[r2, 0.0], [0.0, 1.0], [2 * r2, 0.0], [0.0, 2.0]],
                        dtype=torch.float64)
    rows, inv = distinct(flat)
    assert torch.equal(rows[inv], flat) and len(set(inv.tolist())) == 4
    rows, inv = distinct(torch.zeros(0, 2))
    assert rows.shape == (0, 2) and inv.shape == (0,)


def test_squared_distances_of_several_rows():
    a = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    bank = torch.tensor([[0.0, 1.0], [3.0, 0.0], [6.0, 8.0]])
    b2 = (bank * bank).sum(1)
    by_hand = torch.cdist(a, bank) ** 2
    assert torch.allclose(_d2(a, bank, b2), by_hand, atol=1e-5)
    assert torch.allclose(_nearest_d2(a, bank, b2), by_hand.amin(1), atol=1e-5)


def test_upper_is_the_distance_to_the_rows_kept_with_the_nearest_centre():
    rng = np.random.default_rng(5)
    bank = torch.from_numpy(rng.normal(size=(NEAR_CENTRE + 200, 3)))
    index = BankIndex(bank)
    rows = torch.from_numpy(rng.normal(size=(700, 3))).float()
    c = torch.cdist(rows, index.centres).argmin(1)
    by_hand = torch.stack([((index.groups[k] - r) ** 2).sum(1).min() for r, k in zip(rows, c)])
    got = index.upper(rows)
    assert torch.allclose(got, by_hand, rtol=1e-4, atol=1e-4)
    assert (got >= index.nearest(rows) - 1e-4).all()
    many = torch.from_numpy(rng.normal(size=(16 * ROWS + 5, 3))).float()   # in blocks
    got = index.upper(many)
    assert got.shape == (len(many),)
    assert torch.allclose(got[-5:], index.upper(many[-5:]))


def test_nothing_to_score_gives_nothing():
    bank = torch.from_numpy(np.random.default_rng(6).random((1, 5, DIM)))
    part = PixelNovelty().fit(bank)
    got = part.score(torch.zeros(0, 5, DIM))
    assert got.shape == (0,) and got.dtype == np.float64
    assert part.index().nearest(torch.zeros(0, DIM)).shape == (0,)


def test_the_score_is_the_brute_force_largest_nearest_distance():
    rng = np.random.default_rng(7)
    bank = torch.from_numpy(rng.random((1, 400, DIM)))
    part = PixelNovelty().fit(bank)
    x = torch.from_numpy(rng.random((6, 300, DIM))).float()
    x[2, 17] += 0.5                                          # one odd descriptor
    by_hand = [float(torch.cdist(img.double(), part.t["bank"]).min(1).values.max())
               for img in x]
    assert part.score(x) == pytest.approx(by_hand, rel=1e-9, abs=1e-9)


def test_a_score_held_outside_the_images_top_upper_bounds_is_still_found():
    """An image whose largest nearest distance is held by a descriptor that is not among
    its TOP largest routed upper bounds: the second read must match it."""
    from heads.pixel_novelty import TOP, largest_nearest

    rng = np.random.default_rng(0)
    # row 0 the first centre; 300 rows within 1 of it (all of its NEAR_CENTRE rows); one
    # row r at (5, 0), within every later centre's reach, so never a centre; the other
    # centres spread over a far square (they keep every k-centre radius above 5)
    angle, radius = rng.uniform(0, 2 * np.pi, 300), np.sqrt(rng.uniform(0, 1, 300))
    disc = np.c_[radius * np.cos(angle), radius * np.sin(angle)]
    far = rng.uniform(1000, 2000, size=(400, 2))
    bank = torch.from_numpy(np.r_[[[0.0, 0.0]], disc, [[5.0, 0.0]], far]).float()
    index = BankIndex(bank)
    assert not (index.centres == bank[301]).all(1).any()
    # TOP decoys 0.5 from r (routed to row 0, whose rows are ≥ 3.5 away) and the holder,
    # 2 below the disc, its bound exact
    decoys = np.c_[np.full(TOP, 4.5), np.linspace(-0.1, 0.1, TOP)]
    x = torch.from_numpy(np.r_[decoys, [[0.0, -3.0]]][None]).float()
    up, exact = index.upper(x[0]), torch.cdist(x[0].double(), bank.double()).min(1).values
    assert (up[:TOP] > up[TOP]).all() and (exact[:TOP] < exact[TOP]).all()
    assert largest_nearest(x, index).item() == pytest.approx(exact.max().item(), rel=1e-12)


def test_distinct_matches_repeats_of_a_row_once_when_its_key_is_its_own():
    # a row and a permutation of it (a red patch and a green one) must not share a key:
    # the repeats of the second would each stand alone and be matched again
    flat = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0],
                         [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    rows, inv = distinct(flat)
    assert torch.equal(rows[inv], flat)
    assert len(rows) == 3 and len(set(inv[[0, 1, 3]].tolist())) == 3
    assert inv[1] == inv[2] == inv[5] and inv[3] == inv[4]


def test_the_score_is_exact_where_float32_orders_two_descriptors_the_other_way():
    """Two descriptors of one image whose float32 distances to the bank (one row, at 0)
    are one float32 step apart in the order opposite to their exact distances: both
    stay candidates (each within its float32 bound of the largest), and the exact
    largest is the score."""
    from heads.pixel_novelty import largest_nearest

    a, b = [71.14817810058594, 69.97972869873047], [71.14818572998047, 69.97972106933594]
    x = torch.tensor([[a, b]], dtype=torch.float32)
    f32 = (x[0] * x[0]).sum(1)                          # what the float32 products give
    exact = (x[0].double() ** 2).sum(1)
    assert f32[0] > f32[1] and exact[0] < exact[1]
    index = BankIndex(torch.zeros(1, 2))
    assert largest_nearest(x, index).item() == float(exact[1].sqrt())


def test_a_descriptor_equal_to_a_bank_row_of_zeros_scores_zero():
    # no float32 slack at all (every norm 0): the nearest row is still read
    from heads.pixel_novelty import largest_nearest

    assert largest_nearest(torch.zeros(1, 2, 3), BankIndex(torch.zeros(1, 3))).tolist() == [0.0]


def test_images_of_any_mode_and_size_are_read_as_rgb_resized_bilinearly():
    from heads.pixel_novelty import pixel_descriptors

    rng = np.random.default_rng(10)
    grey = Image.fromarray(rng.integers(0, 255, (64, 64), dtype=np.uint8), mode="L")
    assert torch.equal(pixel_descriptors([grey]), pixel_descriptors([grey.convert("RGB")]))
    big = Image.fromarray(rng.integers(0, 255, (96, 80, 3), dtype=np.uint8))
    assert torch.equal(pixel_descriptors([big]),
                       pixel_descriptors([big.resize((64, 64), Image.BILINEAR)]))


def test_no_images_give_no_descriptors_of_the_stated_shape():
    from heads.pixel_novelty import pixel_descriptors

    for side, stride, p in ((64, 2, 32 * 32), (32, 2, 16 * 16), (64, 4, 16 * 16)):
        got = pixel_descriptors([], side, stride)
        assert got.shape == (0, p, DIM) and got.dtype == torch.float32


def test_box_means_and_descriptor_maps_default_to_every_pixel():
    from heads.pixel_novelty import _box, descriptor_maps

    x = torch.from_numpy(np.random.default_rng(11).random((1, 3, 6, 8), dtype=np.float32))
    assert _box(x, 3).shape == x.shape
    assert descriptor_maps(x).shape == (1, DIM, 6, 8)


def test_sobel_is_the_sobel_kernel_over_eight_on_a_non_square_map():
    from heads.pixel_novelty import _sobel

    p = torch.from_numpy(np.random.default_rng(12).random((1, 2, 7, 10)))
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]],
                      dtype=torch.float64) / 8.0
    w = torch.stack([kx, kx.T])[:, None]                      # [2 (x, y), 1, 3, 3]
    want = F.conv2d(p.reshape(2, 1, 7, 10), w).reshape(1, 2, 2, 5, 8)
    gx, gy = _sobel(p)
    assert gx.shape == gy.shape == (1, 2, 5, 8)
    assert torch.allclose(gx, want[:, :, 0]) and torch.allclose(gy, want[:, :, 1])


def test_the_coreset_pool_is_the_same_on_every_call():
    z = torch.from_numpy(np.random.default_rng(13).normal(size=(200, 3)))
    assert torch.equal(coreset(z, 50, pool=50), coreset(z, 50, pool=50))


def test_prepare_builds_the_index_that_scores_read(monkeypatch):
    import heads.pixel_novelty as pn

    rng = np.random.default_rng(14)
    part = PixelNovelty().fit(torch.from_numpy(rng.random((1, 5, DIM))))
    assert PixelNovelty().prepare().t == {}                  # nothing to build yet
    assert part.prepare() is part

    def refused(bank: torch.Tensor) -> None:
        raise AssertionError("the index is built again at scoring")

    monkeypatch.setattr(pn, "BankIndex", refused)
    assert part.score(torch.from_numpy(rng.random((2, 3, DIM))).float()).shape == (2,)


def test_the_index_is_built_once_per_bank():
    rng = np.random.default_rng(15)
    part = PixelNovelty().fit(torch.from_numpy(rng.random((1, 5, DIM))))
    first = part.index()
    assert part.index() is first
    part.extend_bank(torch.from_numpy(rng.random((1, 2, DIM))))
    assert part.index() is not first and part.index() is part.index()
    assert torch.equal(part.index().bank64, part.t["bank"])


def test_score_refuses_what_is_not_a_batch_of_descriptor_sets():
    part = PixelNovelty().fit(torch.zeros(1, 2, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^a pixel novelty part scores \[N, P, D\] "
                                         r"descriptors$"):
        part.score(torch.zeros(2, DIM))


def test_more_candidates_than_two_blocks_of_rows_are_each_read():
    """Every descriptor of an image within the float32 slack of its largest distance is a
    candidate: over 2·ROWS of them (points of one circle about the one bank row) are read
    in blocks of ROWS, and the one holding the score comes last (the largest key)."""
    from heads.pixel_novelty import largest_nearest

    n = 2 * ROWS + 100
    angle = np.linspace(np.pi, 2 * np.pi, n - 1, endpoint=False)   # keys below the holder's
    holder = (1 + 1e-6) * np.array([np.cos(np.arctan(np.sqrt(2))),
                                    np.sin(np.arctan(np.sqrt(2)))])
    x = torch.from_numpy(np.r_[np.c_[np.cos(angle), np.sin(angle)], [holder]][None]).float()
    rows, _ = distinct(x[0])
    assert len(rows) == n and torch.equal(rows[-1], x[0, -1])
    want = float(x[0].double().square().sum(1).max().sqrt())
    assert float(x[0, -1].double().square().sum().sqrt()) == want
    assert largest_nearest(x, BankIndex(torch.zeros(1, 2))).item() == want
