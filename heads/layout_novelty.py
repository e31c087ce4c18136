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


@lru_cache(maxsize=256)
def _cells(axis_len: int) -> np.ndarray:
    """[GRID, axis_len]: the part of each pixel inside each of GRID equal cells, divided by
    the cell's length (a row sums to 1)."""
    edges = np.linspace(0.0, axis_len, GRID + 1)
    pix = np.arange(axis_len)
    w = np.clip(np.minimum(pix + 1, edges[1:, None]) - np.maximum(pix, edges[:-1, None]),
                0.0, None)
    return w / w.sum(1, keepdims=True)


def _thumbnail(soft: np.ndarray) -> np.ndarray:
    """The mean of `soft` [h, w] over each cell of a GRID×GRID partition of it (cells cut
    through pixels share them by area), so the outline's thumbnail does not depend on its
    size in pixels."""
    return _cells(soft.shape[0]) @ soft @ _cells(soft.shape[1]).T


def _quantile90(v: np.ndarray) -> float:
    """np.quantile(v, 0.9) (linear interpolation), without its overhead."""
    v = np.sort(v)
    pos = 0.9 * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def scene_descriptor(image: Image.Image, side: int = SIDE) -> np.ndarray:
    """The layout vector [DIM] of one decoded image (see the module's docstring)."""
    x = _as_array(image, side)
    a = np.abs(x - background(x))
    diff = np.maximum(np.maximum(a[..., 0], a[..., 1]), a[..., 2])   # max over channels
    labels, n = ndimage.label(diff > FOREGROUND, structure=_EIGHT)
    out = np.zeros(DIM, dtype=np.float32)
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
        if sl[0].start == 0 or sl[1].start == 0 or sl[0].stop == x.shape[0] \
                or sl[1].stop == x.shape[1]:
            # cut by the frame: its outline, size and aspect are not all there (a small
            # crop of a clean image does this), so only its colour and a mark
            out[o + 5] = 1.0
        else:
            out[o] = AREA_WEIGHT * np.sqrt(areas[j] / diff.size)
            out[o + 1] = ASPECT_WEIGHT * np.log(w / h)
            out[o + 6: o + OBJECT_DIM] = THUMB_WEIGHT * _thumbnail(soft).ravel()
    return out


def layout_descriptors(images: Sequence[Image.Image], side: int = SIDE) -> torch.Tensor:
    """Layout vectors [N, DIM] of decoded images."""
    return torch.from_numpy(np.stack([scene_descriptor(im, side) for im in images])
                            if images else np.zeros((0, DIM), np.float32))


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
        return self

    def score(self, x: torch.Tensor) -> np.ndarray:
        x = torch.as_tensor(x)
        if len(x) == 0:
            return np.zeros(0)
        return self._nearest(x.double(), 1).numpy()


PART_CLASSES[KIND] = LayoutNovelty
