"""Image conditions the probes send: blank, region mask, region blur, matched control box
(docs/method.md §4, §5). Boxes are [x0, y0, x1, y1) in pixels.

Pillow is imported at the top: the probe suites read their datasets through `models.data`
and so run with the `server` extra, unlike the bare HTTP client. The blank image itself is
`clients.counterfactual.blank_image`, the one the server uses for `"blank"`.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageFilter

from clients.counterfactual import BLANK_RGB, blank_image
from clients.counterfactual import BLANK_SIZE as BLANK_SIZE  # re-exported: the old home

Box = tuple[int, int, int, int]
GRAY = BLANK_RGB      # the region-mask fill (docs/method.md §4) is the blank image's gray


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def blank() -> Image.Image:
    """docs/method.md §5 blank condition (`clients.counterfactual.blank_image`)."""
    return blank_image()


def mask_rect(box: Box, severity: float) -> Box:
    """The centred rectangle inside `box` whose sides are scaled by √λ (area ∝ λ)."""
    x0, y0, x1, y1 = box
    s = math.sqrt(max(0.0, min(1.0, severity)))
    w, h = round((x1 - x0) * s), round((y1 - y0) * s)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    mx0, my0 = math.floor(cx - w / 2 + 0.5), math.floor(cy - h / 2 + 0.5)
    return mx0, my0, mx0 + w, my0 + h


def mask_region(img: Image.Image, box: Box, severity: float) -> Image.Image:
    out = img.convert("RGB").copy()
    x0, y0, x1, y1 = mask_rect(box, severity)
    if x1 > x0 and y1 > y0:
        out.paste(GRAY, (x0, y0, x1, y1))
    return out


def blur_radius(box: Box, severity: float) -> float:
    """r(λ) = min(24, 0.15·λ·min(w, h))."""
    x0, y0, x1, y1 = box
    return min(24.0, 0.15 * severity * min(x1 - x0, y1 - y0))


def blur_region(img: Image.Image, box: Box, severity: float) -> Image.Image:
    """Gaussian blur inside the box only. The whole image is blurred and the box pasted
    back, so pixels near the box edge mix with their real surroundings."""
    out = img.convert("RGB").copy()
    r = blur_radius(box, severity)
    if r <= 0:
        return out
    blurred = out.filter(ImageFilter.GaussianBlur(r))
    out.paste(blurred.crop(box), box[:2])
    return out


def area(b: Box) -> int:
    return max(0, b[2] - b[0]) * max(0, b[3] - b[1])


def intersection(a: Box, b: Box) -> int:
    return area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))


def iou(a: Box, b: Box) -> float:
    inter = intersection(a, b)
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def control_box(box: Box, size: tuple[int, int], others: Sequence[Box] = (),
                grid: int = 41, max_iou: float = 0.05) -> Box | None:
    """Matched non-critical box: same width and height, inside the image, IoU ≤ max_iou
    with the critical box; over a grid×grid lattice of top-left corners, least overlap
    with other annotated objects, then farthest centre from the critical box, then the
    smallest (y, x). None when no placement qualifies."""
    width, height = size
    w, h = box[2] - box[0], box[3] - box[1]
    if w <= 0 or h <= 0 or w > width or h > height:
        return None
    xs = sorted({int(round(v)) for v in np.linspace(0, width - w, grid)})
    ys = sorted({int(round(v)) for v in np.linspace(0, height - h, grid)})
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    best, best_key = None, None
    for y in ys:
        for x in xs:
            cand = (x, y, x + w, y + h)
            if iou(cand, box) > max_iou:
                continue
            overlap = sum(intersection(cand, o) for o in others) / (w * h)
            dist = math.hypot(x + w / 2 - cx, y + h / 2 - cy)
            key = (round(overlap, 9), -round(dist, 9), y, x)
            if best_key is None or key < best_key:
                best, best_key = cand, key
    return best
