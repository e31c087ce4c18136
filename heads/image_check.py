"""Image-quality statistics of the input image itself, for the defer rule's image check.

The novelty detector on the actor's states misses corruptions that leave those states
close to clean ones (blur, JPEG, low resolution on easy-VQA: docs/eval-shift). These are
the textbook no-reference quality measures, computed from pixels, no model involved, so a
one-class detector fitted on clean images only sees every corruption as held out.
Most are ratios, logs or shares, but sharpness, edge density and palette size still
depend on the image's size: the check compares an input with fitting images of similar
sizes, and a very different size is itself flagged as unusual. Images over MAX_SIDE are
shrunk first (bounded cost; that also smooths 8-pixel JPEG blocks and fine noise in large
photographs), images under MIN_SIDE enlarged (nearest neighbour) so every statistic exists.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# names of `pixel_features`' entries, in order (the card lists them)
PIXEL_FEATURES = (
    "luminance_mean",      # brightness
    "luminance_std",       # RMS contrast
    "log_laplacian_var",   # sharpness (blur lowers it)
    "log_noise_sigma",     # noise level: MAD of the finest diagonal detail (Donoho)
    "log_high_freq_share",  # spectral energy above half the Nyquist frequency
    "blockiness",          # gradient on 8-pixel block borders / elsewhere (JPEG)
    "colourfulness",       # Hasler and Suesstrunk (2003)
    "clipped_share",       # pixels at black or white
    "edge_density",        # share of pixels with a strong gradient
    "log_palette",         # distinct colours (5 bits per channel) per pixel
)
EPS = 1e-6
MAX_SIDE = 256             # larger images are shrunk (box filter) before measuring
MIN_SIDE = 8               # smaller ones are enlarged (nearest neighbour)


def _luminance(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114])


def _laplacian(y: np.ndarray) -> np.ndarray:
    return (y[:-2, 1:-1] + y[2:, 1:-1] + y[1:-1, :-2] + y[1:-1, 2:] - 4 * y[1:-1, 1:-1])


def _blockiness(y: np.ndarray, block: int = 8) -> float:
    """Mean absolute step across block borders over the mean step elsewhere (both axes);
    1 for an image with no block structure, above 1 for JPEG blocking."""
    ratios = []
    for d in (np.abs(np.diff(y, axis=1)), np.abs(np.diff(y, axis=0)).T):
        border = np.zeros(d.shape[1], bool)
        border[block - 1:: block] = True
        if border.all() or not border.any():
            continue
        ratios.append((d[:, border].mean() + EPS) / (d[:, ~border].mean() + EPS))
    return float(np.mean(ratios)) if ratios else 1.0


def pixel_features(image: Image.Image) -> np.ndarray:
    """`PIXEL_FEATURES` of one image, float64."""
    image = image.convert("RGB")
    if max(image.size) > MAX_SIDE:       # bounded cost; fitting and serving shrink alike
        image = image.copy()
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BOX)
    if min(image.size) < MIN_SIDE:       # a 1×1 or 3000×2 input still gets a reading
        k = -(-MIN_SIDE // min(image.size))
        image = image.resize((image.width * k, image.height * k), Image.Resampling.NEAREST)
    rgb = np.asarray(image, dtype=np.float64) / 255.0
    y = _luminance(rgb)
    lap = _laplacian(y)
    h2, w2 = (y.shape[0] // 2) * 2, (y.shape[1] // 2) * 2
    q = y[:h2, :w2]
    diag = (q[0::2, 0::2] - q[1::2, 0::2] - q[0::2, 1::2] + q[1::2, 1::2]) / 2
    sigma = np.median(np.abs(diag)) / 0.6745
    power = np.abs(np.fft.fft2(y - y.mean())) ** 2
    fy = np.abs(np.fft.fftfreq(y.shape[0]))[:, None]
    fx = np.abs(np.fft.fftfreq(y.shape[1]))[None, :]
    high = power[np.maximum(fy, fx) > 0.25].sum()
    rg = rgb[..., 0] - rgb[..., 1]
    yb = (rgb[..., 0] + rgb[..., 1]) / 2 - rgb[..., 2]
    colourful = np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean())
    gy, gx = np.gradient(y)
    q5 = (rgb * 255).astype(np.int64) >> 3                       # 5 bits per channel
    palette = np.count_nonzero(np.bincount(
        ((q5[..., 0] << 10) | (q5[..., 1] << 5) | q5[..., 2]).ravel(), minlength=1 << 15))
    return np.array([
        y.mean(),
        y.std(),
        np.log(lap.var() + EPS),
        np.log(sigma + EPS),
        np.log((high + EPS) / (power.sum() + EPS)),
        _blockiness(y),
        colourful,
        float(np.mean((y < 0.02) | (y > 0.98))),
        float(np.mean(np.hypot(gx, gy) > 0.1)),
        np.log(palette / y.size),
    ])
