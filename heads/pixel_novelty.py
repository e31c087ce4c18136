"""Patch-level novelty on the pixels (PatchCore-style), a part of the defer rule's detector.

The actor's image-token states place an unseen colour or shape where a known one is
(docs/defer/design.md), so this part reads the image itself. Each image is brought to the
fitting side (`SIDE`) and described at every `STRIDE`-th pixel by a small vector:
- the mean colour over a 3×3 and over an 11×11 window (what is there, and what is next to
  it: two objects side by side give a mixture no single object does);
- a histogram of gradient orientations (angle mod π, magnitude-weighted, every colour
  channel voting) over a 5×5 and an 11×11 window (the local outline: corners and edge
  directions of the shapes seen in fitting).
The score of an image is the largest distance of any of its descriptors to the nearest
descriptor of a bank built from the fitting images and benign re-encodings of them
(coreset-subsampled: greedy k-centre keeps the rare edge patches a random subsample would
drop). A conformal p-value on clean calibration images makes it a part like the others
(`heads.novelty.CompositeNovelty`). Nothing here knows a palette or a shape list: what is
far is whatever the fitting images never showed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from heads.novelty import FEATURES, PART_CLASSES, Novelty

PIXEL_FEATURE = "pixel_patches"
KIND = "pixel_knn"
SIDE = 64             # descriptors are read at this side (easy-VQA's; the card records it)
STRIDE = 2
BINS = 8              # orientation bins over [0, π)
COLOUR_WINDOWS = (3, 11)
GRADIENT_WINDOWS = (5, 11)
GRADIENT_WEIGHT = 2.0  # gradient votes (a step edge ≈ 0.5 a pixel) against colours in [0, 1]
PIXEL_BANK = 8_000     # descriptors kept in the bank (coreset)
CHUNK = 128           # images described at once
CORESET_POOL = 80_000  # descriptors the coreset is chosen from (a deterministic subsample)
DIM = 3 * len(COLOUR_WINDOWS) + BINS * len(GRADIENT_WINDOWS)

# the composite detector reads this part's input from a feature dict like the others
FEATURES.setdefault(PIXEL_FEATURE, lambda f: f[PIXEL_FEATURE])


def _as_tensor(image: Image.Image, side: int) -> torch.Tensor:
    im = image.convert("RGB")
    if im.size != (side, side):
        im = im.resize((side, side), Image.BILINEAR)
    return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)


def _box(x: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over a k×k window at every pixel (edges replicated)."""
    p = k // 2
    return F.avg_pool2d(F.pad(x, (p, p, p, p), mode="replicate"), k, stride=1)


_SOBEL_X = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8.0


def descriptor_maps(x: torch.Tensor) -> torch.Tensor:
    """Per-pixel descriptors [N, DIM, H, W] of images [N, 3, H, W] in [0, 1]."""
    n, c, h, w = x.shape
    maps = [_box(x, k) for k in COLOUR_WINDOWS]
    flat = x.reshape(n * c, 1, h, w)
    padded = F.pad(flat, (1, 1, 1, 1), mode="replicate")
    gx = F.conv2d(padded, _SOBEL_X[None, None])
    gy = F.conv2d(padded, _SOBEL_X.T.contiguous()[None, None])
    mag = (gx * gx + gy * gy).sqrt()
    ang = torch.atan2(gy, gx) % np.pi                       # an edge's direction, sign-free
    pos = ang / np.pi * BINS - 0.5                          # soft binning between neighbours
    lo = pos.floor()
    frac = pos - lo
    votes = torch.zeros(n * c, BINS, h, w)
    votes.scatter_add_(1, (lo.long() % BINS), mag * (1 - frac))
    votes.scatter_add_(1, ((lo.long() + 1) % BINS), mag * frac)
    votes = votes.reshape(n, c, BINS, h, w).sum(1) * GRADIENT_WEIGHT
    maps += [_box(votes, k) for k in GRADIENT_WINDOWS]
    return torch.cat(maps, 1)


def pixel_descriptors(images: Sequence[Image.Image], side: int = SIDE,
                      stride: int = STRIDE) -> torch.Tensor:
    """Patch descriptors [N, P, DIM] of decoded images, P = (side / stride)²."""
    if not images:
        return torch.zeros(0, (side // stride) ** 2, DIM)
    out = []
    # in chunks: the full-resolution maps are stride² times the kept descriptors, so a
    # fit or evaluation over thousands of images would hold gigabytes of them at once
    for i in range(0, len(images), CHUNK):
        x = torch.stack([_as_tensor(im, side) for im in images[i:i + CHUNK]])
        d = descriptor_maps(x)[:, :, ::stride, ::stride]
        out.append(d.flatten(2).transpose(1, 2).contiguous())
    return torch.cat(out)


def with_pixels(feats: dict[str, torch.Tensor], images: Sequence[Image.Image],
                side: int = SIDE) -> dict[str, torch.Tensor]:
    """`feats` with the pixel descriptors of `images` (row k: image k) added."""
    return {**feats, PIXEL_FEATURE: pixel_descriptors(images, side)}


def distinct_rows(x: torch.Tensor) -> torch.Tensor:
    """The distinct descriptors of each image [N, P, D], stacked: flat regions repeat one
    descriptor hundreds of times, and a pool drawn from the repeats would miss the rare
    patches (edges, corners) the bank must cover."""
    return torch.cat([torch.unique(img, dim=0) for img in x]) if len(x) else \
        x.reshape(-1, x.shape[-1])


def coreset(z: torch.Tensor, size: int, pool: int = CORESET_POOL, seed: int = 0
            ) -> torch.Tensor:
    """At most `size` rows of `z` chosen by greedy k-centre (each new row the one farthest
    from those already chosen), from a deterministic subsample of `pool` rows: the bank
    then covers every kind of patch seen, not mostly the background."""
    if len(z) <= size:
        return z
    if len(z) > pool:
        keep = np.random.default_rng(seed).choice(len(z), pool, replace=False)
        z = z[torch.from_numpy(np.sort(keep))]
    zf = z.float().contiguous()
    norms = (zf * zf).sum(1)
    chosen = [0]
    # squared distance to the nearest chosen row, |z|² + |c|² − 2 z·c: one matrix-vector
    # product an iteration, in place (the cost of the fit, not of serving)
    dist = norms + norms[0] - 2.0 * (zf @ zf[0])
    step = torch.empty_like(dist)
    for _ in range(size - 1):
        i = int(dist.argmax())
        chosen.append(i)
        torch.mv(zf, zf[i], out=step)
        step.mul_(-2.0).add_(norms).add_(norms[i])
        torch.minimum(dist, step, out=dist)
    return z[torch.tensor(sorted(chosen))]


class PixelNovelty(Novelty):
    """The largest distance of any pixel-patch descriptor of an image to its nearest bank
    descriptor; the bank a coreset of the fitting images' descriptors (and of benign
    re-encodings'). Descriptors are not standardised: their units are fixed by design
    (colours in [0, 1], gradient votes scaled to match). Reads feature dicts with
    `PIXEL_FEATURE` ([N, P, DIM], `pixel_descriptors`)."""

    def __init__(self, kind: str = KIND, feature: str = PIXEL_FEATURE, k: int = 1,
                 max_bank: int = PIXEL_BANK) -> None:
        if kind != KIND:
            raise ValueError(f"a pixel novelty part is of kind {KIND!r}")
        self.kind, self.feature, self.k, self.max_bank = KIND, feature, k, max_bank
        self.t: dict[str, torch.Tensor] = {}
        self.n_fit = 0

    def fit(self, x: torch.Tensor, x_shifted: torch.Tensor | None = None,
            min_scale: torch.Tensor | None = None) -> PixelNovelty:
        x = torch.as_tensor(x).double()
        if x.dim() != 3 or x_shifted is not None:
            raise ValueError("a pixel novelty part takes clean [N, P, D] descriptors only")
        self.n_fit = len(x)
        dim = x.shape[-1]
        self.t["mean"] = torch.zeros(dim, dtype=torch.float64)
        self.t["scale"] = torch.ones(dim, dtype=torch.float64)
        self.t["bank"] = self._capped(distinct_rows(x))
        return self

    def _capped(self, z: torch.Tensor) -> torch.Tensor:
        return coreset(z, self.max_bank)

    def extend_bank(self, x: torch.Tensor) -> PixelNovelty:
        """Add in-distribution descriptors to the bank (the coreset re-chosen over the
        union, so it stays within `max_bank`); the conformal reference stays."""
        x = torch.as_tensor(x).double()
        x = x if x.dim() == 3 else x[None]
        self.t["bank"] = self._capped(torch.cat([self.t["bank"], distinct_rows(x)]))
        return self

    def score(self, x: torch.Tensor) -> np.ndarray:
        """The largest nearest-bank distance of any descriptor of each image. Flat regions
        repeat one descriptor many times: each distinct one is looked up once (the same
        maximum, a fraction of the cost on easy-VQA-like scenes)."""
        x = torch.as_tensor(x)
        out = np.empty(len(x))
        for i, img in enumerate(x):
            out[i] = float(self._nearest(torch.unique(img.float(), dim=0), 1).max())
        return out

    def recalibrated(self, x_cal: torch.Tensor) -> PixelNovelty:
        other = PixelNovelty(KIND, self.feature, self.k, self.max_bank)
        other.n_fit, other.t = self.n_fit, dict(self.t)
        return other.calibrate(x_cal)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "side": SIDE, "stride": STRIDE,
                "descriptor": f"mean colour over {COLOUR_WINDOWS} px windows, orientation "
                              f"histograms ({BINS} bins) over {GRADIENT_WINDOWS} px windows",
                "bank": int(self.t["bank"].shape[0]) if "bank" in self.t else 0}


PART_CLASSES[KIND] = PixelNovelty
