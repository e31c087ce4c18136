"""Scene-layout novelty: the decoded image's objects, a part of the defer rule's detector.

The pixel part (`heads.pixel_novelty`) compares small patches, so a scene whose every patch
looks like a training patch passes it: two or three familiar objects side by side, or an
unseen outline drawn with familiar edges. This part reads the scene as objects instead.
Each image is brought to `SIDE` px and
- the background is estimated as the median colour of the image's border;
- a pixel is foreground where some channel differs from it by more than `FOREGROUND`;
- foreground pixels are grouped into 8-connected components (those under `MIN_AREA`
  pixels are dropped as specks);
and the scene is described by one fixed-length vector: the number of components, then, for
the `SLOTS` largest components (by area; empty slots are zeros), the square root of its
area share, the log of its bounding box's aspect ratio (weighted `ASPECT_WEIGHT`), the
mean colour of its interior, and a `GRID`×`GRID` thumbnail of its soft mask resampled to
its bounding box (the share of each cell the object covers: a scale-free outline, so an
outline no fitting scene showed is far whatever its size); an object touching the image's
edge gets a mark instead of the thumbnail (its outline may be cut by the frame).
The score is the distance to the nearest scene of a bank of the fitting images (and benign
re-encodings of them); a conformal p-value on clean calibration images makes it a part like
the others (`heads.novelty.CompositeNovelty`). Nothing here names a colour, a shape or an
object count: what is far is whatever layout the fitting images never showed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image
from scipy import ndimage

from heads.novelty import FEATURES, IMAGE_FEATURES, PART_CLASSES, ImagePart

LAYOUT_FEATURE = "scene_layout"
KIND = "layout_knn"
SIDE = 64             # the image is read at this side (easy-VQA's; the card records it)
FOREGROUND = 0.2      # a channel this far (in [0, 1]) from the background: foreground
MIN_AREA = 6          # components of fewer pixels (at SIDE) are specks, not objects
SLOTS = 3             # objects described, largest first
GRID = 5              # thumbnail cells a side
INTERIOR = 0.9        # soft-mask level of the pixels whose colour is an object's colour
# weights of the descriptor's groups (their units: a count, shares and colours in [0, 1])
COUNT_WEIGHT = 1.0
AREA_WEIGHT = 1.0
# a rectangle's aspect ratio is spread thinly over the fitting scenes: at full weight the
# clean calibration tail was a few elongated rectangles (development study, layout-dev.md)
ASPECT_WEIGHT = 0.25
THUMB_WEIGHT = 1.0 / GRID     # the thumbnail's GRID² cells together weigh like one colour
OBJECT_DIM = 3 + 3 + GRID * GRID
DIM = 1 + SLOTS * OBJECT_DIM
LAYOUT_BANK = 50_000  # scenes kept in the bank (a deterministic subsample beyond it)

_EIGHT = np.ones((3, 3), dtype=bool)

# what a saved part records of its vectors; `LayoutNovelty.load` refuses any other (the
# weights are not recorded: the shipped card predates this check)
DESCRIBED = {"side": SIDE,
             "descriptor": f"object count (components of >= {MIN_AREA} px differing by > "
                           f"{FOREGROUND} from the border median), and for the {SLOTS} "
                           f"largest: sqrt area share, log aspect, interior colour, "
                           f"{GRID}x{GRID} soft-mask thumbnail"}


def _as_array(image: Image.Image, side: int) -> np.ndarray:
    im = image.convert("RGB")
    if im.size != (side, side):
        im = im.resize((side, side), Image.BILINEAR)
    return np.asarray(im, dtype=np.float32) / 255.0


def background(x: np.ndarray) -> np.ndarray:
    """The median colour [3] of the border pixels of an image [H, W, 3]."""
    border = np.sort(np.concatenate([x[0], x[-1], x[1:-1, 0], x[1:-1, -1]]), axis=0)
    n = len(border)           # the median, as np.median takes it (a sort is cheaper here)
    return (border[(n - 1) // 2] + border[n // 2]) / 2


@lru_cache(maxsize=512)
def _cells(axis_len: int, grid: int = GRID) -> np.ndarray:
    """[grid, axis_len]: the part of each pixel inside each of `grid` equal cells, divided
    by the cell's length (a row sums to 1)."""
    edges = np.linspace(0.0, axis_len, grid + 1)
    pix = np.arange(axis_len)
    w = np.clip(np.minimum(pix + 1, edges[1:, None]) - np.maximum(pix, edges[:-1, None]),
                0.0, None)
    return w / w.sum(1, keepdims=True)


def _thumbnail(soft: np.ndarray, grid: int = GRID) -> np.ndarray:
    """The mean of `soft` [h, w] over each cell of a grid×grid partition of it (cells cut
    through pixels share them by area), so the outline's thumbnail does not depend on its
    size in pixels."""
    return _cells(soft.shape[0], grid) @ soft @ _cells(soft.shape[1], grid).T


# ------------------------------------------------------------------ outline (version 2)
# Optional numbers a slot can add about its object's outline, for shapes close to the
# fitting ones (an octagon beside circles, a parallelogram beside rectangles), which the
# 5×5 thumbnail blurs together. The shipped part (`NearLayoutNovelty`) adds none of them,
# only the outline score; docs/defer/near-shapes-dev.md compares them.
MOMENTS = ("corr", "skew_x", "skew_y", "kurt_x", "kurt_y", "cokurt", "co_x2y", "co_xy2")
DISC_MOMENTS = np.array([0.0, 0.0, 0.0, 2.0, 2.0, 2.0 / 3.0, 0.0, 0.0])


@dataclass(frozen=True)
class Outline:
    """Which outline numbers each object slot adds, and their weights.

    - `grid`: a finer grid×grid thumbnail of the soft mask (cells weighed `grid_weight`/grid,
      so the thumbnail weighs like the 5×5 one at weight 1);
    - `moments`: standardised moments of the soft mask's pixel coordinates (x right, y
      down, each divided by its standard deviation, so free of size and of stretch along an
      axis): correlation, the two skewnesses, the two kurtoses, E[x²y²], E[x²y], E[xy²],
      each less a disc's (kurtoses 2, E[x²y²] 2/3, the others 0; a box has 1.8 and 1, a
      slanted box a correlation), times `moment_weight`;
    - `rays`: the distance from the mask's centroid to where it falls below ½ along `rays`
      directions, over its mean, minus 1 (0 for a disc), times `ray_weight`/√rays;
    - `sized`: the moments and the profile (0 for a disc) also times 2·√(area share),
      capped at 1 (1 from a quarter of the image on): a small object's outline is a few
      pixels, its fine numbers noise;
    - `aspect_weight`, `area_weight`, `colour_weight`: the slot's aspect, area and colour
      weighed so instead of version 1's (None: unchanged);
    - `shape_factor` (a way of scoring, not a number of the vector): when above 0, the
      part's score is the larger of the distance to the nearest fitting scene and this
      times the distance to the nearest fitting *outline* (`shape_columns`: the vector
      without areas and colours). A clean scene far from the fitting ones is mostly an
      object of a rare size and colour, whose outline has close neighbours; an unseen
      outline has none, whatever its size and colour.
    """

    grid: int = 0
    grid_weight: float = 1.0
    shape_factor: float = 0.0
    moments: bool = False
    moment_weight: float = 1.0
    rays: int = 0
    ray_weight: float = 1.0
    sized: bool = False
    aspect_weight: float | None = None
    area_weight: float | None = None
    colour_weight: float | None = None

    @property
    def dim(self) -> int:
        return self.grid ** 2 + (len(MOMENTS) if self.moments else 0) + self.rays

    def text(self) -> str:
        out = []
        if self.grid:
            out.append(f"{self.grid}x{self.grid} thumbnail (weight {self.grid_weight:g})")
        if self.moments:
            out.append(f"standardised moments (weight {self.moment_weight:g})")
        if self.rays:
            out.append(f"{self.rays}-ray radial profile (weight {self.ray_weight:g})")
        if self.sized:
            out.append("times 2·sqrt(area share) capped at 1")
        for name in ("aspect", "area", "colour"):
            w = getattr(self, f"{name}_weight")
            if w is not None:
                out.append(f"{name} weight {w:g}")
        if self.shape_factor:
            out.append(f"score also {self.shape_factor:g} x nearest outline")
        return ", ".join(out) or "none"


def shape_columns(outline: Outline | None) -> np.ndarray:
    """Which numbers of a vector with `outline` describe outlines: all but each slot's
    area and colour."""
    keep = np.ones(DIM + SLOTS * (outline.dim if outline is not None else 0), dtype=bool)
    for slot in range(SLOTS):
        o = 1 + slot * OBJECT_DIM
        keep[[o, o + 2, o + 3, o + 4]] = False
    return keep


def _moments(soft: np.ndarray) -> np.ndarray:
    """The standardised moments (`MOMENTS`) of the pixel coordinates weighted by `soft`."""
    h, w = soft.shape
    m = soft.sum()
    py, px = soft.sum(1) / m, soft.sum(0) / m
    ys, xs = np.arange(h) + 0.5, np.arange(w) + 0.5
    sx = np.sqrt(max(float(px @ (xs - px @ xs) ** 2), 1e-12))
    sy = np.sqrt(max(float(py @ (ys - py @ ys) ** 2), 1e-12))
    x, y = (xs - px @ xs) / sx, (ys - py @ ys) / sy
    p = soft / m

    def e(a: int, b: int) -> float:
        return float((y ** b) @ p @ (x ** a))

    return np.array([e(1, 1), float(px @ x ** 3), float(py @ y ** 3), float(px @ x ** 4),
                     float(py @ y ** 4), e(2, 2), e(2, 1), e(1, 2)])


def _rays(soft: np.ndarray, k: int) -> np.ndarray:
    """The distance from the centroid of `soft` to where it first falls below ½ along `k`
    directions (from the right, anticlockwise), over their mean, minus 1."""
    h, w = soft.shape
    pad = np.pad(soft, 1)
    m = soft.sum()
    cy = float(soft.sum(1) @ np.arange(h)) / m + 1
    cx = float(soft.sum(0) @ np.arange(w)) / m + 1
    step = 0.25
    t = np.arange(0.0, np.hypot(h, w) / 2 + 2, step)
    a = 2 * np.pi * np.arange(k) / k
    yy = cy - np.sin(a)[:, None] * t
    xx = cx + np.cos(a)[:, None] * t
    v = ndimage.map_coordinates(pad, [yy.ravel(), xx.ravel()], order=1,
                                cval=0.0).reshape(k, len(t))
    below = v < 0.5
    below[:, -1] = True
    j = below.argmax(1)                            # first sample below ½ (j ≥ 1 inside)
    j = np.maximum(j, 1)
    v0, v1 = v[np.arange(k), j - 1], v[np.arange(k), j]
    frac = np.clip((v0 - 0.5) / np.maximum(v0 - v1, 1e-9), 0.0, 1.0)
    r = (j - 1 + frac) * step
    return r / max(float(r.mean()), 1e-9) - 1.0


def _outline(soft: np.ndarray, o: Outline, gain: float = 1.0) -> np.ndarray:
    """The slot's outline numbers (`Outline`); `gain` scales the moments and profile."""
    parts = []
    if o.grid:
        parts.append(o.grid_weight / o.grid * _thumbnail(soft, o.grid).ravel())
    if o.moments:
        parts.append(gain * o.moment_weight * (_moments(soft) - DISC_MOMENTS))
    if o.rays:
        parts.append(gain * o.ray_weight / np.sqrt(o.rays) * _rays(soft, o.rays))
    return np.concatenate(parts) if parts else np.zeros(0)


def _quantile90(v: np.ndarray) -> float:
    """np.quantile(v, 0.9) (linear interpolation), without its overhead."""
    v = np.sort(v)
    pos = 0.9 * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def scene_descriptor(image: Image.Image, side: int = SIDE,
                     outline: Outline | None = None) -> np.ndarray:
    """The layout vector [DIM] of one decoded image (see the module's docstring); with
    `outline`, [DIM + SLOTS·outline.dim]: the same DIM numbers, then each slot's outline
    numbers (zeros for an empty slot or an object cut by the frame)."""
    x = _as_array(image, side)
    a = np.abs(x - background(x))
    diff = np.maximum(np.maximum(a[..., 0], a[..., 1]), a[..., 2])   # max over channels
    labels, n = ndimage.label(diff > FOREGROUND, structure=_EIGHT)
    extra = outline.dim if outline is not None else 0
    out = np.zeros(DIM + SLOTS * extra, dtype=np.float32)
    if n == 0:
        return out
    areas = np.bincount(labels.ravel(), minlength=n + 1)[1:]
    keep = np.flatnonzero(areas >= MIN_AREA)
    out[0] = COUNT_WEIGHT * len(keep)
    boxes = ndimage.find_objects(labels)
    for slot, j in enumerate(keep[np.argsort(-areas[keep], kind="stable")][:SLOTS]):
        sl = boxes[j]
        own = labels[sl] == j + 1
        d = diff[sl]
        level = max(_quantile90(d[own]), FOREGROUND)
        # soft mask: this object's pixels (and background) as a share of its full contrast
        soft = np.where((labels[sl] == 0) | own, np.clip(d / level, 0.0, 1.0), 0.0)
        h, w = own.shape
        inner = own & (soft >= INTERIOR)
        colour = x[sl][inner if inner.any() else own].mean(0)
        o = 1 + slot * OBJECT_DIM
        out[o + 2: o + 5] = colour
        if outline is not None and outline.colour_weight is not None:
            out[o + 2: o + 5] *= outline.colour_weight
        if sl[0].start == 0 or sl[1].start == 0 or sl[0].stop == x.shape[0] \
                or sl[1].stop == x.shape[1]:
            # cut by the frame: its outline, size and aspect are not all there (a small
            # crop of a clean image does this), so only its colour and a mark
            out[o + 5] = 1.0
        else:
            out[o] = AREA_WEIGHT * np.sqrt(areas[j] / diff.size)
            out[o + 1] = ASPECT_WEIGHT * np.log(w / h)
            out[o + 6: o + OBJECT_DIM] = THUMB_WEIGHT * _thumbnail(soft).ravel()
            if outline is not None:
                share = np.sqrt(areas[j] / diff.size)
                gain = min(1.0, 2 * share) if outline.sized else 1.0
                if extra:
                    out[DIM + slot * extra: DIM + (slot + 1) * extra] = \
                        _outline(soft, outline, gain)
                if outline.area_weight is not None:
                    out[o] = outline.area_weight * share
                if outline.aspect_weight is not None:
                    out[o + 1] = outline.aspect_weight * np.log(w / h)
    return out


def layout_descriptors(images: Sequence[Image.Image], side: int = SIDE,
                       outline: Outline | None = None) -> torch.Tensor:
    """Layout vectors [N, DIM (+ SLOTS·outline.dim)] of decoded images."""
    width = DIM + (SLOTS * outline.dim if outline is not None else 0)
    return torch.from_numpy(np.stack([scene_descriptor(im, side, outline) for im in images])
                            if images else np.zeros((0, width), np.float32))


def with_layout(feats: dict[str, torch.Tensor], images: Sequence[Image.Image],
                side: int = SIDE) -> dict[str, torch.Tensor]:
    """`feats` with the layout vectors of `images` (row k: image k) added."""
    return {**feats, LAYOUT_FEATURE: layout_descriptors(images, side)}


# the composite detector reads this part's input from a feature dict like the others, and
# its callers compute it from the decoded images (`CompositeNovelty.image_features`)
FEATURES.setdefault(LAYOUT_FEATURE, lambda f: f[LAYOUT_FEATURE])
IMAGE_FEATURES.setdefault(LAYOUT_FEATURE, layout_descriptors)


class LayoutNovelty(ImagePart):
    """The distance of an image's layout vector to the nearest one of the bank (the
    fitting images' and benign re-encodings'). Vectors are not standardised: their units
    are fixed by design (a count, shares and colours in [0, 1]); a feature constant over
    the fitting images (one object in every easy-VQA scene) would otherwise get an
    arbitrary scale. Reads feature dicts with `LAYOUT_FEATURE` ([N, DIM])."""

    KIND, FEATURE, WHAT, INPUT, NDIM = KIND, LAYOUT_FEATURE, "layout", "[N, D] layout vectors", 2
    DIM, MAX_BANK, DESCRIBED = DIM, LAYOUT_BANK, DESCRIBED

    def _capped(self, z: torch.Tensor) -> torch.Tensor:
        if len(z) <= self.max_bank:
            return z
        keep = np.random.default_rng(0).choice(len(z), self.max_bank, replace=False)
        return z[np.sort(keep)]

    def extend_bank(self, x: torch.Tensor) -> LayoutNovelty:
        """Add in-distribution layout vectors to the bank; the conformal reference stays."""
        x = torch.as_tensor(x).double().reshape(-1, self.t["bank"].shape[1])
        self.t["bank"] = self._capped(torch.cat([self.t["bank"], x]))
        return self.prepare()

    def prepare(self) -> LayoutNovelty:
        """The float32 bank its score reads, built now (`Novelty.prepare`)."""
        if "bank" in self.t:
            self._bank32()
        return self

    def score(self, x: torch.Tensor) -> np.ndarray:
        x = torch.as_tensor(x)
        if len(x) == 0:
            return np.zeros(0)
        return self._nearest(x.double(), 1).numpy()


PART_CLASSES[KIND] = LayoutNovelty


class OutlineLayoutNovelty(LayoutNovelty):
    """The layout part with an outline version (`Outline`): optional outline numbers and
    the outline score (the shipped part is `NearLayoutNovelty`). A subclass sets `OUTLINE`,
    `DIM` and `DESCRIBED` (`outline_part`)."""

    OUTLINE = Outline()

    def score(self, x: torch.Tensor) -> np.ndarray:
        d = super().score(x)
        f = self.OUTLINE.shape_factor
        if not f or len(d) == 0:
            return d
        cols, bank = self._outline_bank()
        a = torch.as_tensor(x)[:, cols].float()
        out = []
        for s in range(0, len(a), 1024):
            out.append(torch.cdist(a[s: s + 1024], bank).min(1).values.double())
        return np.maximum(d, f * torch.cat(out).numpy())

    def prepare(self) -> OutlineLayoutNovelty:
        """The float32 bank and its outline rows, built now (`Novelty.prepare`)."""
        super().prepare()
        if "bank" in self.t and self.OUTLINE.shape_factor:
            self._outline_bank()
        return self

    def _outline_bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The outline columns and the bank's outline rows in float32, kept until the bank
        changes (taking them cost more than an item's score)."""
        bank = self.t["bank"]
        cached = getattr(self, "_outlines", None)
        if cached is None or cached[0] is not bank:
            cols = torch.from_numpy(shape_columns(self.OUTLINE))
            cached = self._outlines = (bank, cols, bank[:, cols].float())
        return cached[1], cached[2]


def outline_part(outline: Outline, kind: str, feature: str = LAYOUT_FEATURE
                 ) -> type[OutlineLayoutNovelty]:
    """A layout part class whose vectors carry `outline`, saved under kind `kind` (its card
    records the outline; a part saved with other vectors is refused at load). `feature`:
    the name its vectors go by in a feature dict."""
    return type(f"OutlineLayoutNovelty_{kind}", (OutlineLayoutNovelty,), {
        "KIND": kind, "FEATURE": feature, "OUTLINE": outline,
        "DIM": DIM + SLOTS * outline.dim,
        "DESCRIBED": {"side": SIDE, "descriptor": DESCRIBED["descriptor"]
                      + "; outline: " + outline.text()}})


# The version chosen on development suites (docs/defer/near-shapes-dev.md) and fitted by
# `heads.detectors`; `LayoutNovelty` (no outline numbers) still loads older heads.
NEAR_OUTLINE = Outline(shape_factor=2.0)
NEAR_FEATURE = "scene_layout_outline"
NearLayoutNovelty = outline_part(NEAR_OUTLINE, "layout_knn_outline", NEAR_FEATURE)
FEATURES.setdefault(NEAR_FEATURE, lambda f: f[NEAR_FEATURE])
IMAGE_FEATURES.setdefault(
    NEAR_FEATURE, lambda images: layout_descriptors(images, outline=NEAR_OUTLINE))
PART_CLASSES[NearLayoutNovelty.KIND] = NearLayoutNovelty
