"""Image-quality statistics of the input image itself, for the defer rule's image check.

The novelty detector on the actor's states misses corruptions that leave those states
close to clean ones (blur, JPEG, low resolution on easy-VQA: docs/eval-shift). Ten of
these are the textbook no-reference quality measures, six are shares of gradient
magnitude by direction (they see a turned picture); all are computed from pixels, no
model involved, and the one-class detector on them is fitted on clean images only.
Most are ratios, logs or shares, but sharpness, edge density and palette size still
depend on the image's size: the check compares an input with fitting images of similar
sizes, and a very different size is itself flagged as unusual. Images over MAX_SIDE are
shrunk first (bounded cost; that also smooths 8-pixel JPEG blocks and fine noise in large
photographs), images under MIN_SIDE enlarged (nearest neighbour) so every statistic exists.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import scipy.fft
from PIL import Image

# names of `pixel_features`' entries, in order (the card lists them)
PIXEL_FEATURES = (
    "luminance_mean",      # brightness
    "luminance_std",       # RMS contrast
    "log_laplacian_var",   # sharpness (blur lowers it), on a 3×3-median-filtered copy
    "log_noise_sigma",     # noise level: MAD of the finest diagonal detail (Donoho)
    "log_high_freq_share",  # spectral energy above half Nyquist, same filtered copy
    "blockiness",          # gradient on 8-pixel block borders / elsewhere (JPEG)
    "colourfulness",       # Hasler and Suesstrunk (2003)
    "clipped_share",       # pixels at black or white
    "edge_density",        # share of pixels with a strong gradient
    "log_palette",         # distinct colours (5 bits per channel) per pixel
    # gradient magnitude by direction (mod 180°, six 30° bins centred on 0°, ..., 150°;
    # 0° = vertical edges): pixel statistics above do not change when the picture turns,
    # these do (a shape turned by 45° was read as another one, confidently, and nothing
    # flagged it)
    *(f"orientation_{d}" for d in range(0, 180, 30)),
)
ORIENTATION_BINS = 6
EPS = 1e-6
# One grey level: the offset inside logs and ratios of pixel differences, so that a flat
# image or a noise-free one gives a finite, graded value rather than log(1e-6) or a ratio
# of two near-zeros (a one-pixel shift of an edge moved blockiness by 10^4 with EPS alone)
LEVEL = 1 / 255
# Smallest standardisation scale of each statistic (same order as PIXEL_FEATURES). A
# statistic that never varies on the fitting images (the noise estimate on noise-free
# synthetic images) would otherwise count a one-grey-level change as millions of standard
# deviations. log 2 is what one grey level of noise does to the noise estimate; the other
# floors (0.05 of the gradient magnitude for the orientation shares, whose spread on
# easy-VQA is 0.06-0.19) sit below the spread of clean photographs and synthetic images
# alike and only guard against degenerate fitting sets.
SCALE_FLOOR = (0.01, 0.01, 0.1, float(np.log(2)), 0.1, 0.1, 0.01, 0.01, 0.005, 0.1,
               *(0.05,) * 6)
MAX_SIDE = 256             # larger images are shrunk (box filter) before measuring
MIN_SIDE = 8               # smaller ones are enlarged (nearest neighbour)


def _pad_edge(y: np.ndarray) -> np.ndarray:
    """`np.pad(y, ((0, 0), (1, 1), (1, 1)), mode="edge")`, without its generality's cost."""
    n, h, w = y.shape
    p = np.empty((n, h + 2, w + 2), dtype=y.dtype)
    p[:, 1:-1, 1:-1] = y
    p[:, 0, 1:-1] = y[:, 0]
    p[:, -1, 1:-1] = y[:, -1]
    p[:, :, 0] = p[:, :, 1]
    p[:, :, -1] = p[:, :, -2]
    return p


def _median3(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c))


def median3x3(y: np.ndarray) -> np.ndarray:
    """3×3 median of every image of a stack [N, H, W], edges repeated: equal, bit for bit,
    to scipy's `median_filter(y, size=(1, 3, 3), mode="nearest")` (a median selects, it does
    not round), at a tenth of its cost on small images. Each column's three values are
    sorted once and shared by the three windows over it; a window's median is then the
    median of (the largest of its three minima, the median of its three middles, the
    smallest of its three maxima)."""
    p = _pad_edge(y)
    a, b, c = p[:, :-2], p[:, 1:-1], p[:, 2:]
    low, high = np.minimum(a, b), np.maximum(a, b)
    mid = np.maximum(low, np.minimum(high, c))
    low, high = np.minimum(low, c), np.maximum(high, c)
    left, centre, right = slice(None, -2), slice(1, -1), slice(2, None)
    most_low = np.maximum(np.maximum(low[..., left], low[..., centre]), low[..., right])
    least_high = np.minimum(np.minimum(high[..., left], high[..., centre]), high[..., right])
    return _median3(most_low, _median3(mid[..., left], mid[..., centre], mid[..., right]),
                    least_high)


def _row_median(x: np.ndarray) -> np.ndarray:
    """`np.median(x, axis=1)` of a 2-D array without NaNs, the same numbers (the middle
    order statistic, or the mean of the two middle ones) at a third of its cost."""
    k = x.shape[1]
    if k % 2:
        return np.partition(x, k // 2, axis=1)[:, k // 2]
    part = np.partition(x, [k // 2 - 1, k // 2], axis=1)
    return (part[:, k // 2 - 1] + part[:, k // 2]) / 2


def _gradient(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.gradient(y, axis=(1, 2))` of a stack [N, H, W] (H, W ≥ 2), the same numbers:
    central differences inside, one-sided ones on the edges."""
    gy, gx = np.empty_like(y), np.empty_like(y)
    gy[:, 1:-1] = (y[:, 2:] - y[:, :-2]) / 2.0
    gy[:, 0] = y[:, 1] - y[:, 0]
    gy[:, -1] = y[:, -1] - y[:, -2]
    gx[:, :, 1:-1] = (y[:, :, 2:] - y[:, :, :-2]) / 2.0
    gx[:, :, 0] = y[:, :, 1] - y[:, :, 0]
    gx[:, :, -1] = y[:, :, -1] - y[:, :, -2]
    return gy, gx


def bounded(image: Image.Image) -> np.ndarray:
    """RGB bytes [H, W, 3] after the size bounds: what the statistics read (small to send
    to the process that measures them)."""
    image = image.convert("RGB")
    if max(image.size) > MAX_SIDE:       # bounded cost; fitting and serving shrink alike
        image = image.copy()
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BOX)
    if min(image.size) < MIN_SIDE:       # a 1×1 or 3000×2 input still gets a reading
        k = -(-MIN_SIDE // min(image.size))
        image = image.resize((image.width * k, image.height * k), Image.Resampling.NEAREST)
    return np.asarray(image, dtype=np.uint8)


@lru_cache(maxsize=64)
def _spectrum_tables(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """For an H×W image's half spectrum (`rfft2`): the weight of each column (2 for one
    with a mirror, 1 for the zero and Nyquist columns) and which bins lie above half
    Nyquist. Read-only: shared by every image of that size."""
    twice = np.full(w // 2 + 1, 2.0)
    twice[0] = 1.0
    if w % 2 == 0:
        twice[-1] = 1.0                               # the Nyquist column has no mirror
    fy = np.abs(np.fft.fftfreq(h))[:, None]
    fx = np.abs(np.fft.rfftfreq(w))[None, :]
    high = np.maximum(fy, fx) > 0.25
    twice.flags.writeable = high.flags.writeable = False
    return twice, high


def _mean_std(x: np.ndarray, axis: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """`x.mean(axis)` and `x.std(axis)` with one sum for both: numpy's own steps (sum,
    divide, centre, square, sum, divide, root), so the same numbers bit for bit."""
    count = np.prod([x.shape[a] for a in axis])
    mean = x.sum(axis=axis, keepdims=True) / count
    d = x - mean
    np.multiply(d, d, out=d)
    return mean.squeeze(axis), np.sqrt(d.sum(axis=axis) / count)


def _blockiness(y: np.ndarray, block: int = 8) -> np.ndarray:
    """Mean absolute step across block borders over the mean step elsewhere (both axes),
    per image of a stack [N, H, W], each plus one grey level; 1 for an image with no block
    structure, above 1 for JPEG blocking, at most 1 / LEVEL + 1."""
    ratios = []
    for d in (np.abs(np.diff(y, axis=2)), np.abs(np.diff(y, axis=1)).transpose(0, 2, 1)):
        rows, steps = d.shape[1], d.shape[2]
        borders = len(range(block - 1, steps, block))
        if borders in (0, steps):
            continue
        # sums over a strided slice and the whole, not boolean selections (which copied
        # both parts): the same means up to rounding in the last bits
        on = d[:, :, block - 1:: block].sum(axis=(1, 2))
        off = d.sum(axis=(1, 2)) - on
        ratios.append((on / (rows * borders) + LEVEL) / (off / (rows * (steps - borders))
                                                          + LEVEL))
    # the mean of one or two arrays, written out: `np.mean` of their stack cost more than
    # the ratios themselves (same numbers: (a + b) / 2)
    return sum(ratios) / len(ratios) if ratios else np.ones(len(y))


def _stack_features(rgb8: np.ndarray) -> np.ndarray:
    """`PIXEL_FEATURES` of a stack of same-size RGB byte images [N, H, W, 3] -> [N, 16]
    (served and fitted images go through it one at a time: `pixel_features_many`)."""
    n = len(rgb8)
    ax = (1, 2)
    rgb = rgb8 / 255.0
    y = rgb @ np.array([0.299, 0.587, 0.114])
    # Sharpness and the high-frequency share read a 3×3-median-filtered copy: one stray
    # pixel on a clean synthetic image (almost no high-frequency energy) otherwise moved
    # them by 9 standard deviations and flagged one image in seven; edges and blur survive
    # the filter, fine noise is the noise estimate's to see (on the unfiltered image).
    ym = median3x3(y)
    lap = (ym[:, :-2, 1:-1] + ym[:, 2:, 1:-1] + ym[:, 1:-1, :-2] + ym[:, 1:-1, 2:]
           - 4 * ym[:, 1:-1, 1:-1])
    h2, w2 = (y.shape[1] // 2) * 2, (y.shape[2] // 2) * 2
    q = y[:, :h2, :w2]
    diag = (q[:, 0::2, 0::2] - q[:, 1::2, 0::2] - q[:, 0::2, 1::2] + q[:, 1::2, 1::2]) / 2
    sigma = _row_median(np.abs(diag).reshape(n, -1)) / 0.6745
    # the spectrum of a real image is symmetric, so the half spectrum (`rfft2`) holds all
    # of it: each column with a mirror counts twice (the full `fft2`'s share up to rounding,
    # ~1e-15, at half the cost)
    power = np.abs(scipy.fft.rfft2(ym - ym.mean(axis=ax, keepdims=True), axes=ax)) ** 2
    twice, above_half = _spectrum_tables(y.shape[1], y.shape[2])
    power = power * twice
    high = power[:, above_half].sum(axis=1)
    rg = rgb[..., 0] - rgb[..., 1]
    yb = (rgb[..., 0] + rgb[..., 1]) / 2 - rgb[..., 2]
    (rg_mean, rg_std), (yb_mean, yb_std) = _mean_std(rg, ax), _mean_std(yb, ax)
    colourful = np.hypot(rg_std, yb_std) + 0.3 * np.hypot(rg_mean, yb_mean)
    gy, gx = _gradient(y)
    # sqrt(gx² + gy²), not `np.hypot` (which guards against overflow, at four times the
    # cost here): the same magnitudes to the last bit or so
    mag = np.sqrt(gx * gx + gy * gy)
    turn = np.arctan2(gy, gx)
    turn = np.where(turn < 0, turn + np.pi, turn)       # direction mod 180° (π itself: bin 0)
    bins = (np.floor(turn / np.pi * ORIENTATION_BINS + 0.5).astype(np.int64)
            % ORIENTATION_BINS).reshape(n, -1) + (np.arange(n)[:, None] * ORIENTATION_BINS)
    energy = np.bincount(bins.ravel(), weights=mag.reshape(n, -1).ravel(),
                         minlength=n * ORIENTATION_BINS).reshape(n, ORIENTATION_BINS)
    orientation = energy / (energy.sum(axis=1, keepdims=True) + EPS)
    q5 = (rgb8 >> 3).astype(np.intp)                            # 5 bits per channel
    codes = ((q5[..., 0] << 10) | (q5[..., 1] << 5) | q5[..., 2]).reshape(n, -1)
    seen = np.zeros((n, 1 << 15), bool)                           # one table per image
    seen[np.arange(n)[:, None], codes] = True
    palette = np.count_nonzero(seen, axis=1)
    size = y.shape[1] * y.shape[2]
    y_mean, y_std = _mean_std(y, ax)
    return np.stack([
        y_mean,
        y_std,
        np.log(lap.var(axis=ax) + LEVEL ** 2),
        np.log(sigma + LEVEL),
        np.log((high + EPS) / (power.sum(axis=ax) + EPS)),
        _blockiness(y),
        colourful,
        np.count_nonzero((y < 0.02) | (y > 0.98), axis=ax) / size,
        np.count_nonzero(mag > 0.1, axis=ax) / size,
        np.log(palette / size),
        *orientation.T,
    ], axis=1)


def pixel_features(image: Image.Image) -> np.ndarray:
    """`PIXEL_FEATURES` of one image, float64."""
    return pixel_features_many([image])[0]


def pixel_features_many(images: list[Image.Image | np.ndarray]) -> np.ndarray:
    """`pixel_features` of every image (PIL, or a `bounded` array), [N, 16]. Each image is
    measured alone: measured as one stack, an image's statistics changed in their last
    bits with the images beside it, and a reading must not depend on its batch."""
    out = np.empty((len(images), len(PIXEL_FEATURES)))
    for k, im in enumerate(images):
        rgb8 = im if isinstance(im, np.ndarray) else bounded(im)
        out[k] = _stack_features(np.asarray(rgb8, dtype=np.uint8)[None])[0]
    return out
