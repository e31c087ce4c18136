"""The pixel part's fast path (heads.pixel_novelty) computes what the shipped detector was
fitted and evaluated with: the same descriptors up to float rounding, the exact largest
nearest-bank distance of an image (a brute-force float64 `cdist` is the reference), and a
saved part is refused when it records other descriptors."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import heads.pixel_novelty as pn
from heads.dualread import EMBEDDED_HEADS
from heads.novelty import load_detector
from heads.pixel_novelty import (
    BINS,
    COLOUR_WINDOWS,
    DIM,
    GRADIENT_WEIGHT,
    GRADIENT_WINDOWS,
    STRIDE,
    BankIndex,
    PixelNovelty,
    distinct,
    largest_nearest,
    pixel_descriptors,
)
from models.data import load
from tests.helpers import edit_card


def reference_maps(x: torch.Tensor) -> torch.Tensor:
    """The descriptors as the detector was fitted with them: a k×k `avg_pool2d` at every
    pixel and the Sobel gradients by convolution, subsampled afterwards."""
    def box(v, k):
        p = k // 2
        return F.avg_pool2d(F.pad(v, (p, p, p, p), mode="replicate"), k, stride=1)

    n, c, h, w = x.shape
    maps = [box(x, k) for k in COLOUR_WINDOWS]
    padded = F.pad(x.reshape(n * c, 1, h, w), (1, 1, 1, 1), mode="replicate")
    sob = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8.0
    gx, gy = F.conv2d(padded, sob[None, None]), F.conv2d(padded, sob.T.contiguous()[None, None])
    mag = (gx * gx + gy * gy).sqrt()
    pos = torch.atan2(gy, gx) % np.pi / np.pi * BINS - 0.5
    lo = pos.floor()
    frac = pos - lo
    votes = torch.zeros(n * c, BINS, h, w)
    votes.scatter_add_(1, lo.long() % BINS, mag * (1 - frac))
    votes.scatter_add_(1, (lo.long() + 1) % BINS, mag * frac)
    votes = votes.reshape(n, c, BINS, h, w).sum(1) * GRADIENT_WEIGHT
    maps += [box(votes, k) for k in GRADIENT_WINDOWS]
    return torch.cat(maps, 1)[:, :, ::STRIDE, ::STRIDE].flatten(2).transpose(1, 2)


def brute_force(x: torch.Tensor, bank: torch.Tensor) -> np.ndarray:
    return np.array([float(torch.cdist(img.double(), bank.double()).min(1).values.max())
                     for img in x])


@pytest.fixture(scope="module")
def shipped():
    return load_detector(EMBEDDED_HEADS).parts["pixels"]


@pytest.fixture(scope="module")
def test_images():
    seen, out = set(), []
    for it in load("easyvqa:test")[:60]:
        if it.image_id not in seen:
            seen.add(it.image_id)
            out.append(it.image())
    return out[:12]


def test_descriptors_equal_the_fitted_ones_up_to_rounding(test_images):
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8))
    ims = test_images[:6] + [noisy, test_images[0].resize((100, 100))]
    x = torch.stack([pn._as_tensor(im, pn.SIDE) for im in ims])
    ref = reference_maps(x)
    new = pixel_descriptors(ims)
    assert new.shape == ref.shape == (len(ims), (pn.SIDE // STRIDE) ** 2, DIM)
    assert torch.allclose(new, ref, rtol=0, atol=1e-5)
    # equal windows give equal descriptors wherever they are: a flat image is one row
    flat = pixel_descriptors([Image.new("RGB", (64, 64), (240, 200, 10))])[0]
    assert len(torch.unique(flat, dim=0)) == 1


def test_an_image_repeated_in_a_batch_is_described_as_alone(test_images):
    ims = [test_images[1], test_images[2], test_images[1], test_images[1].copy()]
    d = pixel_descriptors(ims)
    assert torch.equal(d[0], d[2]) and torch.equal(d[0], d[3])
    assert torch.equal(d[1], pixel_descriptors([test_images[2]])[0])


def test_distinct_rows_are_exact_even_when_their_keys_collide(monkeypatch):
    g = torch.Generator().manual_seed(0)
    base = torch.rand(50, DIM, generator=g)
    flat = base[torch.randint(0, 50, (400,), generator=g)]
    rows, inv = distinct(flat)
    assert torch.equal(rows[inv], flat) and len(rows) == len(torch.unique(flat, dim=0))
    # every row under one key: the check still keeps unequal rows apart
    monkeypatch.setattr(torch, "unique", lambda t, return_inverse: (
        t[:1], torch.zeros(len(t), dtype=torch.long)))
    rows, inv = distinct(flat)
    assert torch.equal(rows[inv], flat)


@pytest.mark.parametrize("spread", [0.02, 0.3, 3.0])
def test_largest_nearest_is_the_brute_force_value_on_random_descriptors(spread):
    g = torch.Generator().manual_seed(int(spread * 100))
    bank = torch.rand(3000, DIM, generator=g, dtype=torch.float64)
    # near the bank, far from it, and repeated rows (flat regions)
    x = (bank[torch.randint(0, 3000, (5, 700), generator=g)]
         + spread * torch.randn(5, 700, DIM, generator=g, dtype=torch.float64)).float()
    x[:, 300:] = x[:, :1]
    got = largest_nearest(x, BankIndex(bank)).numpy()
    assert np.allclose(got, brute_force(x, bank), rtol=1e-12, atol=1e-12)


def test_a_small_bank_is_read_whole():
    bank = torch.rand(40, DIM, dtype=torch.float64)
    x = torch.rand(3, 64, DIM)
    got = largest_nearest(x, BankIndex(bank)).numpy()
    assert np.allclose(got, brute_force(x, bank), rtol=1e-12, atol=1e-12)
    assert len(largest_nearest(x[:0], BankIndex(bank))) == 0


def test_the_shipped_part_scores_real_images_exactly(shipped, test_images):
    x = pixel_descriptors(test_images)
    bank = shipped.t["bank"]
    got = shipped.score(x)
    assert np.allclose(got, brute_force(x, bank), rtol=1e-12, atol=1e-12)
    # one image at a time or all together: the same scores
    alone = np.concatenate([shipped.score(x[i:i + 1]) for i in range(len(x))])
    assert np.array_equal(alone, got)
    # as before the fast path, within float32 rounding: the calibration scores the
    # shipped p-values compare with were read by the float32 matrix product
    assert shipped.index() is shipped.index()           # built once per bank
    old = np.array([float(PixelNovelty._nearest(shipped, torch.unique(img, dim=0), 1).max())
                    for img in x])
    assert np.allclose(got, old, rtol=1e-4, atol=0)


def test_extending_the_bank_rebuilds_the_index(shipped, test_images):
    part = PixelNovelty(max_bank=500).fit(pixel_descriptors(test_images[:4])).prepare()
    before = part.index()
    part.extend_bank(pixel_descriptors(test_images[4:6]))
    # rebuilt by the extension itself, for the new bank: the next score pays nothing
    assert part._index[0] is part.t["bank"] and part._index[1] is not before
    x = pixel_descriptors(test_images[6:])
    assert np.array_equal(part.score(x), largest_nearest(x, BankIndex(part.t["bank"])).numpy())
    assert np.allclose(part.score(x), brute_force(x, part.t["bank"]), rtol=1e-12, atol=1e-12)
    empty = PixelNovelty()
    assert empty.prepare() is empty and not hasattr(empty, "_index")


@pytest.mark.parametrize("field,value", [("side", 128), ("stride", 4),
                                         ("descriptor", "mean colour over (5,) px windows"),
                                         ("descriptor", None)])
def test_a_part_recording_other_descriptors_is_refused(tmp_path, test_images, field, value):
    part = PixelNovelty(max_bank=200).fit(pixel_descriptors(test_images[:3]))
    part.calibrate(pixel_descriptors(test_images[3:6]))
    part.save(tmp_path, "novelty.pixels")
    assert PixelNovelty.load(tmp_path, "novelty.pixels").t["bank"].shape[1] == DIM
    edit_card(tmp_path / "novelty.pixels.json", field, value)
    with pytest.raises(ValueError, match=f"{field}: the part records"):
        PixelNovelty.load(tmp_path, "novelty.pixels")


def test_a_bank_of_other_width_is_refused(tmp_path, test_images):
    part = PixelNovelty(max_bank=200).fit(pixel_descriptors(test_images[:3]))
    part.t["bank"] = part.t["bank"][:, :DIM - 2].contiguous()
    part.save(tmp_path, "novelty.pixels")
    with pytest.raises(ValueError, match="bank: rows of"):
        PixelNovelty.load(tmp_path, "novelty.pixels")


def test_many_descriptors_are_read_in_blocks_with_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(3)
    bank = torch.rand(2000, DIM, generator=g, dtype=torch.float64)
    x = (bank[torch.randint(0, 2000, (6, 300), generator=g)]
         + 0.05 * torch.randn(6, 300, DIM, generator=g, dtype=torch.float64)).float()
    whole = largest_nearest(x, BankIndex(bank))
    monkeypatch.setattr(pn, "ROWS", 7)          # blocks of 7 and 112 rows
    assert torch.equal(largest_nearest(x, BankIndex(bank)), whole)
    assert np.allclose(whole.numpy(), brute_force(x, bank), rtol=1e-12, atol=1e-12)


class _SkewedIndex(BankIndex):
    """A bank index whose float32 nearest distances err by up to the bound the score
    allows for (F32_SLACK): up for rows of large norm, down for small ones."""

    def nearest(self, rows: torch.Tensor) -> torch.Tensor:
        exact = torch.cdist(rows.double(), self.bank64).min(1).values ** 2
        tol = pn.F32_SLACK * ((rows * rows).sum(1).double() + self.b2max)
        big = (rows * rows).sum(1) > 1.0
        return (exact + torch.where(big, 0.99, -0.99) * tol).float()


def test_the_score_stays_exact_when_float32_errs_by_its_whole_bound():
    # a small-norm descriptor holds the score (d² 1 to the origin); a large-norm one
    # (d² 0.5 to a far bank row) has the larger error bound, and its float32 value errs
    # up by nearly all of it: the exact recheck must still read the small one
    far = torch.zeros(DIM, dtype=torch.float64)
    far[1] = 1000.0
    bank = torch.stack([torch.zeros(DIM, dtype=torch.float64), far])
    small, large = torch.zeros(DIM), far.float().clone()
    small[0], large[0] = 1.0, 0.5 ** 0.5
    x = torch.stack([small, large])[None]
    got = largest_nearest(x, _SkewedIndex(bank)).numpy()
    assert np.allclose(got, brute_force(x, bank), rtol=1e-12, atol=1e-12)
