"""Benign image changes for the stress suites (SPEC §8): the answer stays the same.

Re-encodings, resampling, mild noise, small crops and pads, exposure: what a picture goes
through between a scanner and a service without anyone changing what it shows. Addressed
like the corruptions (`SPEC~FAMILY:SEVERITY`, models.shift); a severity is how much, 1..5,
all of them mild. Families are split into development and held-out ones
(docs/defer/suites.md): the defer rule's design only looked at the development ones.
`margin`, `tint`, `vignette`, `bed-edge` and the question family `preamble` were added
after the split, for the re-certification study (docs/recert/pilots.md).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageFilter

# one row per family, severities 1..5
BENIGN_PARAMS: dict[str, tuple[float, ...]] = {
    # development
    "jpeg-q": (95, 90, 85, 80, 75),            # JPEG quality
    "upscale": (1.25, 1.5, 2.0, 3.0, 4.0),     # bicubic enlargement factor
    "noise-mild": (1, 2, 3, 4, 5),             # Gaussian σ in grey levels (of 255)
    "crop": (1, 2, 3, 4, 5),                   # pixels cut from every side
    "margin": (0.03, 0.045, 0.06, 0.09, 0.12),  # grey scanner-bed margin, share of the side
    "tint": (0.02, 0.03, 0.04, 0.06, 0.08),     # warm white balance: red ×(1+g), blue ×(1−g)
    "vignette": (0.04, 0.06, 0.08, 0.12, 0.16),  # light fall-off: corners darkened by this share
    "bed-edge": (0.03, 0.045, 0.06, 0.09, 0.12),  # grey scanner-bed strip on one side, share
    # held out
    "webp": (95, 90, 85, 80, 70),              # WebP quality
    "gamma": (1.05, 1.1, 1.15, 1.2, 1.3),      # exponent on [0, 1] intensities
    "pad": (1, 2, 3, 4, 6),                    # pixels of edge colour added on every side
    "downup": (0.9, 0.8, 0.75, 0.7, 0.6),      # bicubic down by this factor, then back up
    "sharpen": (50, 80, 110, 140, 180),        # unsharp-mask percent (radius 1)
}
BENIGN_SPLIT = {"dev": ("jpeg-q", "upscale", "noise-mild", "crop", "margin", "tint",
                        "vignette", "bed-edge"),
                "heldout": ("webp", "gamma", "pad", "downup", "sharpen")}
BENIGN_FAMILIES = BENIGN_SPLIT["dev"] + BENIGN_SPLIT["heldout"]
# question changes (development): another front end's wording before the same question;
# the image and the gold answer stay. Severity picks the preamble.
PREAMBLES = ("Question: ", "Please answer: ", "Look at the image. ", "Answer briefly: ",
             "From the scan: ")
QUESTION_FAMILIES = ("preamble",)
BENIGN_PARAMS["preamble"] = (1, 2, 3, 4, 5)
MARGIN_GREY = 190.0


def _u8(im: Image.Image) -> np.ndarray:
    return np.asarray(im.convert("RGB"), np.float64)


def _reencode(im: Image.Image, fmt: str, quality: int) -> Image.Image:
    buf = io.BytesIO()
    im.save(buf, format=fmt, quality=int(quality))
    buf.seek(0)
    with Image.open(buf) as out:
        return out.convert("RGB")


def apply_benign(im: Image.Image, family: str, severity: int, rng: np.random.Generator
                 ) -> Image.Image:
    p = BENIGN_PARAMS[family][severity - 1]
    w, h = im.size
    if family == "jpeg-q":
        return _reencode(im, "JPEG", int(p))
    if family == "webp":
        return _reencode(im, "WEBP", int(p))
    if family == "upscale":
        return im.resize((round(w * p), round(h * p)), Image.BICUBIC)
    if family == "downup":
        small = im.resize((max(1, round(w * p)), max(1, round(h * p))), Image.BICUBIC)
        return small.resize((w, h), Image.BICUBIC)
    if family == "noise-mild":
        x = _u8(im) + rng.normal(size=(h, w, 3)) * p
        return Image.fromarray(np.clip(x + 0.5, 0, 255).astype(np.uint8))
    if family == "gamma":
        x = (_u8(im) / 255) ** p
        return Image.fromarray(np.clip(x * 255 + 0.5, 0, 255).astype(np.uint8))
    if family == "margin":
        # a scanner bed seen around the picture: a flat light-grey frame (190 of 255)
        k = max(1, round(p * min(w, h)))
        x = np.pad(_u8(im), ((k, k), (k, k), (0, 0)), constant_values=MARGIN_GREY)
        return Image.fromarray(x.astype(np.uint8))
    if family == "tint":
        # another white balance (a warm cast of a few percent): colours stay nameable
        x = _u8(im) * np.array([1 + p, 1.0, 1 - p])
        return Image.fromarray(np.clip(x + 0.5, 0, 255).astype(np.uint8))
    if family == "vignette":
        # a scanner's or camera's light fall-off: darker by up to `p` toward the corners
        yy, xx = np.mgrid[0:h, 0:w]
        r2 = ((xx - (w - 1) / 2) / (w / 2)) ** 2 + ((yy - (h - 1) / 2) / (h / 2)) ** 2
        x = _u8(im) * (1 - p * r2 / 2)[..., None]
        return Image.fromarray(np.clip(x + 0.5, 0, 255).astype(np.uint8))
    if family == "bed-edge":
        # the picture laid against one edge of the scanner bed: the grey bed (as `margin`)
        # along one side only, the side drawn per image; no closed frame around the shape
        k = max(1, round(p * min(w, h)))
        pad = [(0, 0), (0, 0), (0, 0)]
        side = int(rng.integers(4))
        pad[side // 2] = (k, 0) if side % 2 == 0 else (0, k)
        x = np.pad(_u8(im), pad, constant_values=MARGIN_GREY)
        return Image.fromarray(x.astype(np.uint8))
    if family == "crop":
        k = int(p)
        return im.crop((k, k, w - k, h - k))
    if family == "pad":
        k = int(p)
        x = np.pad(_u8(im), ((k, k), (k, k), (0, 0)), mode="edge")
        return Image.fromarray(x.astype(np.uint8))
    if family == "sharpen":
        return im.filter(ImageFilter.UnsharpMask(radius=1, percent=int(p), threshold=0))
    raise ValueError(f"unknown benign family {family!r}")


def benign_question(question: str, family: str, severity: int) -> str:
    """`question` as another front end sends it (a `QUESTION_FAMILIES` family)."""
    if family == "preamble":
        return PREAMBLES[severity - 1] + question
    raise ValueError(f"unknown question family {family!r}")
