"""Image-quality statistics of the image check (heads.image_check), each against a value
worked out by hand for a constructed image."""

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from heads.fit import fit_image_check
from heads.image_check import (
    LEVEL,
    MAX_SIDE,
    MIN_SIDE,
    PIXEL_FEATURES,
    SCALE_FLOOR,
    pixel_features,
)
from heads.novelty import Novelty

F = {name: k for k, name in enumerate(PIXEL_FEATURES)}


def gray(values: np.ndarray) -> Image.Image:
    """An RGB image whose three channels all hold `values` (in [0, 1])."""
    u8 = np.round(np.clip(values, 0, 1) * 255).astype(np.uint8)
    return Image.fromarray(np.stack([u8] * 3, -1))


def test_a_flat_gray_image():
    x = pixel_features(gray(np.full((16, 16), 128 / 255)))
    assert x.shape == (len(PIXEL_FEATURES),) and x.dtype == np.float64
    assert x[F["luminance_mean"]] == pytest.approx(128 / 255)
    assert x[F["luminance_std"]] == pytest.approx(0, abs=1e-12)
    # offsets of one grey level: finite, graded values for a flat, noise-free image
    assert x[F["log_laplacian_var"]] == pytest.approx(math.log(LEVEL ** 2))
    assert x[F["log_noise_sigma"]] == pytest.approx(math.log(LEVEL))
    assert x[F["log_high_freq_share"]] == pytest.approx(0.0)       # (0 + ε) / (0 + ε)
    assert x[F["blockiness"]] == pytest.approx(1.0)                # LEVEL / LEVEL, both axes
    assert x[F["colourfulness"]] == pytest.approx(0, abs=1e-12)
    assert x[F["clipped_share"]] == 0 and x[F["edge_density"]] == 0
    assert x[F["log_palette"]] == pytest.approx(math.log(1 / 256))  # one colour, 256 pixels


def test_a_pure_red_image_has_the_hasler_suesstrunk_colourfulness():
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    x = pixel_features(red)
    # rg = 1, yb = (1 + 0)/2 - 0 = 0.5 everywhere: no spread, 0.3·|mean|
    assert x[F["colourfulness"]] == pytest.approx(0.3 * math.hypot(1.0, 0.5))
    assert x[F["luminance_mean"]] == pytest.approx(0.299)


def test_half_black_half_white():
    v = np.zeros((8, 8))
    v[:, 4:] = 1.0
    x = pixel_features(gray(v))
    assert x[F["clipped_share"]] == 1.0
    assert x[F["luminance_std"]] == pytest.approx(0.5)
    # np.gradient: central differences of 0.5 at columns 3 and 4, 0 elsewhere
    assert x[F["edge_density"]] == pytest.approx(2 / 8)
    assert x[F["log_palette"]] == pytest.approx(math.log(2 / 64))


def test_a_one_pixel_checkerboard_is_all_high_frequency():
    yy, xx = np.mgrid[:16, :16]
    x = pixel_features(gray(((yy + xx) % 2).astype(float)))
    # all the power sits at the Nyquist frequency (0.5, 0.5): share 1, log 0 — bar the
    # border pixels, which the 3×3 median filter (edge mode "nearest") changes
    assert -0.02 < x[F["log_high_freq_share"]] <= 0.0
    # one period of a cosine across the image: all power at frequency 1/16 (< 1/4), bar
    # the uint8 rounding
    wave = 0.5 + 0.4 * np.cos(2 * np.pi * xx / 16)
    assert pixel_features(gray(wave))[F["log_high_freq_share"]] < math.log(0.01)


def test_one_stray_pixel_does_not_move_sharpness_or_high_frequencies():
    """Sharpness and the high-frequency share read a median-filtered copy: a single black
    pixel on a flat image with one shape leaves them as they were (it moved them by 9
    standard deviations of clean easy-VQA images before the filter); the noise estimate
    and palette, on the raw pixels, may see it."""
    v = np.full((64, 64), 0.95)
    v[20:40, 20:40] = 0.3
    speck = v.copy()
    speck[5, 50] = 0.0
    a, b = pixel_features(gray(v)), pixel_features(gray(speck))
    for name in ("log_laplacian_var", "log_high_freq_share"):
        assert b[F[name]] == pytest.approx(a[F[name]], abs=1e-9)


def test_the_noise_estimate_recovers_a_known_sigma():
    rng = np.random.default_rng(0)
    sigma = 0.05
    x = pixel_features(gray(0.5 + sigma * rng.standard_normal((128, 128))))
    # diagonal detail (a - b - c + d)/2 of i.i.d. noise has std σ; MAD/0.6745 estimates it
    assert math.exp(x[F["log_noise_sigma"]]) == pytest.approx(sigma, rel=0.1)


def test_blocks_of_eight_pixels_are_blocky_and_noise_is_not():
    rng = np.random.default_rng(1)
    blocks = np.kron(rng.uniform(0.2, 0.8, (4, 4)), np.ones((8, 8)))   # 32×32, 8-px blocks
    # steps only on borders: the largest value there is, 1 / LEVEL + 1 on each axis
    assert pixel_features(gray(blocks))[F["blockiness"]] > 10
    noise = pixel_features(gray(rng.uniform(0, 1, (64, 64))))[F["blockiness"]]
    assert noise == pytest.approx(1.0, abs=0.15)


def test_blockiness_of_one_edge_on_and_off_a_block_border_by_hand():
    """A black left half on white: the only step lies on a block border (between columns
    31 and 32) or, one pixel to the right, off it. Bounded either way (no ratio of two
    near-zeros, which put the first at 5·10^4 before the one-grey-level offset)."""
    for black, want_h in ((32, (1 / 7 + LEVEL) / LEVEL), (33, LEVEL / (1 / 56 + LEVEL))):
        v = np.ones((64, 64))
        v[:, :black] = 0.0
        # horizontal steps: one column of 1s among 63 (7 of them on block borders, 56
        # not); vertical steps: none, ratio LEVEL / LEVEL = 1
        assert pixel_features(gray(v))[F["blockiness"]] == pytest.approx((want_h + 1) / 2)


def test_a_one_grey_level_change_is_not_millions_of_standard_deviations():
    """Fitted on noise-free images (the noise estimate never varies there), a copy with
    one grey level of noise in 60% of its pixels must stay within a few units of the
    fitting images, as the scale floors make it; with the bare 1e-6 floor it scored ~10^7."""
    rng = np.random.default_rng(6)

    def shapes(n):
        out = []
        for _ in range(n):
            v = np.full((64, 64), 0.95)
            r, c, h = rng.integers(4, 30), rng.integers(4, 30), rng.integers(8, 30)
            v[r: r + h, c: c + h] = rng.uniform(0.1, 0.6)
            out.append(v)
        return out

    x = torch.from_numpy(np.stack([pixel_features(gray(v)) for v in shapes(60)]))
    assert x[:, F["log_noise_sigma"]].std() < 1e-12                  # never varies
    chk = fit_image_check(x[:40], x[40:])
    assert (chk.t["scale"] >= torch.tensor(SCALE_FLOOR, dtype=torch.float64)).all()
    v = shapes(1)[0]
    dithered = np.round(v * 255) - (rng.random(v.shape) < 0.6)
    score = chk.score(torch.from_numpy(pixel_features(gray(dithered / 255)))[None])[0]
    assert score < 10


def test_edge_orientation_shares_by_hand():
    """A vertical edge: all gradient energy points along x (0°); turned by 90° it is a
    horizontal edge (90°); a centred square keeps equal 0° and 90° shares either way."""
    names = [f"orientation_{d}" for d in range(0, 180, 30)]
    v = np.ones((32, 32))
    v[:, :16] = 0.0
    x = pixel_features(gray(v))
    assert [x[F[n]] for n in names] == pytest.approx([1, 0, 0, 0, 0, 0], abs=1e-6)
    x = pixel_features(gray(v.T))
    assert [x[F[n]] for n in names] == pytest.approx([0, 0, 0, 1, 0, 0], abs=1e-6)
    sq = np.ones((32, 32))
    sq[8:24, 8:24] = 0.3
    x = pixel_features(gray(sq))
    assert x[F["orientation_0"]] == pytest.approx(x[F["orientation_90"]])
    assert sum(x[F[n]] for n in names) == pytest.approx(1.0)
    # two edges of different contrast: shares weigh each pixel by its gradient magnitude
    # (central differences: 0.3 along the vertical edge, 0.1 along the horizontal one,
    # both on the 4 crossing pixels, whose direction atan(0.1 / 0.3) = 18.4° falls in 30°)
    two = np.zeros((32, 32))
    two[:, 16:] += 0.6
    two[16:, :] += 0.2
    x = pixel_features(gray(two))
    e0, e90, e30 = 30 * 2 * 0.3, 30 * 2 * 0.1, 4 * math.hypot(0.3, 0.1)
    total = e0 + e90 + e30
    assert [x[F[n]] for n in names] == pytest.approx(
        [e0 / total, e30 / total, 0, e90 / total, 0, 0], abs=1e-6)
    # a flat image has no gradient energy: every share is 0, not NaN
    flat = pixel_features(gray(np.full((16, 16), 0.5)))
    assert [flat[F[n]] for n in names] == [0.0] * 6


def test_blur_lowers_sharpness():
    rng = np.random.default_rng(2)
    img = gray(np.kron(rng.uniform(0, 1, (8, 8)), np.ones((8, 8))))
    sharp = pixel_features(img)[F["log_laplacian_var"]]
    blurred = pixel_features(img.filter(ImageFilter.GaussianBlur(2)))[F["log_laplacian_var"]]
    assert blurred < sharp - 1.0


def test_large_images_are_shrunk_with_a_box_filter_first():
    rng = np.random.default_rng(3)
    big = Image.fromarray(rng.integers(0, 256, (400, 600, 3), dtype=np.uint8))
    small = big.copy()
    small.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BOX)
    assert max(small.size) == MAX_SIDE
    np.testing.assert_allclose(pixel_features(big), pixel_features(small))
    assert big.size == (600, 400)                    # the caller's image is not touched


@pytest.mark.parametrize("size", [(1, 1), (3, 40), (3000, 2)])
def test_tiny_and_thin_images_are_enlarged_to_a_measurable_size(size):
    """Any image the service accepts gets a reading: below MIN_SIDE on a side it is
    enlarged (nearest neighbour, an integer factor) first."""
    rng = np.random.default_rng(5)
    im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    x = pixel_features(im)
    assert np.isfinite(x).all()
    small = im.copy()
    small.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BOX)
    k = -(-MIN_SIDE // min(small.size))
    big = small.resize((small.width * k, small.height * k), Image.Resampling.NEAREST)
    assert min(big.size) >= MIN_SIDE
    np.testing.assert_allclose(x, pixel_features(big))


def test_a_one_class_check_on_clean_images_flags_blurred_ones():
    """Fitted on clean images only: blurred copies get p-values below α, fresh clean ones
    mostly do not."""
    rng = np.random.default_rng(4)

    def clean(n):
        return [gray(np.kron(rng.uniform(0, 1, (8, 8)), np.ones((8, 8)))) for _ in range(n)]

    fit = torch.from_numpy(np.stack([pixel_features(im) for im in clean(150)]))
    cal = torch.from_numpy(np.stack([pixel_features(im) for im in clean(199)]))
    chk = Novelty("mahalanobis", "pixels").fit(fit).calibrate(cal)
    fresh = chk.p_value(torch.from_numpy(np.stack([pixel_features(im) for im in clean(50)])))
    blurred = chk.p_value(torch.from_numpy(np.stack(
        [pixel_features(im.filter(ImageFilter.GaussianBlur(2))) for im in clean(50)])))
    assert (blurred < 0.01).mean() == 1.0
    assert (fresh < 0.01).mean() <= 0.1
