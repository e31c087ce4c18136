"""Generic image corruptions for a shift suite (docs/method.md §8), ImageNet-C style.

A data spec takes a suffix `~FAMILY:SEVERITY` (severity 1–5), e.g. `easyvqa:test~blur:3`;
`~all:S` gives every family of the suite (`FAMILIES`) at severity S; `rotate` is addressable
but outside the suite (`EXTRA_FAMILIES`). Labels stay those of the clean item; a corrupted
item gets the id `ID~FAMILY:SEVERITY` (so readout caches never collide) and keeps the image
id (same image cluster).

Each corruption is a pure function of (image, family, severity, seed). The random draw (noise
field, texture, patches) depends on the clean item id and the family only, not on the
severity: severities of one item are nested (the same noise, scaled), so any image is
changed more at a higher severity and severity curves compare the same draws. Spatial
parameters are given for a 64-px image (what the embedded processor sees) and scale with the
shorter side.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, fields

import numpy as np
from PIL import Image, ImageFilter

from models.benign import (
    BENIGN_FAMILIES,
    BENIGN_PARAMS,
    QUESTION_FAMILIES,
    apply_benign,
    benign_question,
)
from models.items import Item, sample

SEVERITIES = (1, 2, 3, 4, 5)
REFERENCE_SIDE = 64
# One row per family, severities 1..5.
PARAMS: dict[str, tuple[float, ...]] = {
    "noise": (0.08, 0.12, 0.18, 0.26, 0.38),        # Gaussian σ on [0, 1] (ImageNet-C)
    "blur": (0.8, 1.2, 1.8, 2.5, 3.5),              # Gaussian σ, px at 64 px
    "jpeg": (25, 18, 15, 10, 7),                    # JPEG quality (ImageNet-C)
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),         # kept share of contrast (ImageNet-C)
    "brightness": (0.75, 0.6, 0.45, 0.33, 0.22),    # kept share of HSV value (darker)
    "resolution": (0.5, 0.35, 0.25, 0.18, 0.12),    # down-sampling factor, nearest back up
    "background": (0.2, 0.4, 0.6, 0.8, 1.0),        # blend weight of a colour texture
    "occlusion": (0.05, 0.1, 0.18, 0.27, 0.4),      # share of the area under patches
    "rotate": (15, 30, 45, 90, 180),                # degrees, counter-clockwise
}
# The suite the novelty detector is fitted on and the grids and the study run over.
# `rotate` (a geometry shift, not an image-quality one) is addressable as a suffix
# (`easyvqa:test~rotate:3`) but kept out of it, so it stays held out from every fit.
FAMILIES = ("noise", "blur", "jpeg", "contrast", "brightness", "resolution", "background",
            "occlusion")
EXTRA_FAMILIES = ("rotate",)
# benign changes (models.benign): addressable the same way, never part of the suite above
PARAMS.update(BENIGN_PARAMS)
SUFFIX = re.compile(r"~([\w-]*)(?::([^~/\\]*))?$")


# ------------------------------------------------------------------ the corruptions
def _rng(seed: int | str, family: str) -> np.random.Generator:
    h = hashlib.sha256(f"{seed}|{family}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def _noise(x, p, rng, side):
    return x + rng.normal(size=x.shape) * p


def _blur(x, p, rng, side):
    im = Image.fromarray(_to_u8(x)).filter(ImageFilter.GaussianBlur(p * side / REFERENCE_SIDE))
    return np.asarray(im, np.float64) / 255


def _jpeg(x, p, rng, side):
    buf = io.BytesIO()
    Image.fromarray(_to_u8(x)).save(buf, format="JPEG", quality=int(p))
    buf.seek(0)
    with Image.open(buf) as im:
        return np.asarray(im.convert("RGB"), np.float64) / 255


def _contrast(x, p, rng, side):
    m = x.mean()
    return (x - m) * p + m


def _brightness(x, p, rng, side):
    # HSV value is the max channel and RGB = V·f(H, S), so scaling V scales the channels.
    # Darkening rather than ImageNet-C's brightening: easy-VQA's saturated shapes on pale
    # backgrounds already sit at V ≈ 1, where adding to V changes nothing.
    return x * p


def _resolution(x, p, rng, side):
    h, w = x.shape[:2]
    small = (max(1, round(w * p)), max(1, round(h * p)))
    im = Image.fromarray(_to_u8(x)).resize(small, Image.BOX).resize((w, h), Image.NEAREST)
    return np.asarray(im, np.float64) / 255


def _background(x, p, rng, side, tol: float = 40 / 255):
    # The background is what stays close to the median corner colour (flat in easy-VQA).
    h, w = x.shape[:2]
    corners = np.stack([x[0, 0], x[0, -1], x[-1, 0], x[-1, -1]])
    bg = np.abs(x - np.median(corners, 0)).sum(-1, keepdims=True) <= tol
    cells = int(rng.integers(3, 9))
    grid = (rng.uniform(size=(cells, cells, 3)) * 255).astype(np.uint8)
    tex = np.asarray(Image.fromarray(grid).resize((w, h), Image.BILINEAR), np.float64) / 255
    return np.where(bg, (1 - p) * x + p * tex, x)


def _occlusion(x, p, rng, side):
    # Patches are drawn in one fixed sequence; a severity keeps drawing until its share of
    # the area is covered, so higher severities cover a superset.
    h, w = x.shape[:2]
    out = x.copy()
    covered = np.zeros((h, w), bool)
    for _ in range(200):
        if covered.mean() >= p:
            break
        ph = max(1, int(h * rng.uniform(0.15, 0.35)))
        pw = max(1, int(w * rng.uniform(0.15, 0.35)))
        y0, x0 = int(rng.integers(0, h - ph + 1)), int(rng.integers(0, w - pw + 1))
        colour = rng.uniform(size=3)
        out[y0: y0 + ph, x0: x0 + pw] = colour
        covered[y0: y0 + ph, x0: x0 + pw] = True
    return out


def _rotate(x, p, rng, side):
    # about the centre, same size, corners filled with the image's median border colour
    # (easy-VQA's flat background)
    border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
    fill = tuple(int(v) for v in _to_u8(np.median(border, 0)))
    im = Image.fromarray(_to_u8(x)).rotate(p, resample=Image.BILINEAR, fillcolor=fill)
    return np.asarray(im, np.float64) / 255


CORRUPT = {"noise": _noise, "blur": _blur, "jpeg": _jpeg, "contrast": _contrast,
           "brightness": _brightness, "resolution": _resolution, "background": _background,
           "occlusion": _occlusion, "rotate": _rotate}


def _to_u8(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, 0, 1) * 255 + 0.5).astype(np.uint8)


def corrupt(image: Image.Image, family: str, severity: int, seed: int | str = 0
            ) -> Image.Image:
    """`image` under one corruption at severity 1–5; deterministic in (family, seed)."""
    check(family, severity)
    if family in QUESTION_FAMILIES:        # the question changes (shift_items), not the image
        return image
    if family in BENIGN_FAMILIES:
        return apply_benign(image.convert("RGB"), family, severity, _rng(seed, family))
    x = np.asarray(image.convert("RGB"), np.float64) / 255
    side = min(x.shape[:2])
    y = CORRUPT[family](x, PARAMS[family][severity - 1], _rng(seed, family), side)
    return Image.fromarray(_to_u8(y))


def check(family: str, severity: int) -> None:
    if family not in PARAMS:
        raise ValueError(f"unknown corruption family {family!r}; known: "
                         f"{', '.join(PARAMS)} (or all: {', '.join(FAMILIES)})")
    if severity not in SEVERITIES:
        raise ValueError(f"corruption severity must be 1-5, not {severity!r}")


# ------------------------------------------------------------------ items and specs
@dataclass(frozen=True)
class ShiftedItem(Item):
    """A clean item whose image is corrupted when read; the answer stays the clean one."""

    family: str = ""
    severity: int = 0
    source_id: str = ""
    source: Item | None = None     # the clean item when its image is not a file (rendered)

    def image(self) -> Image.Image:
        clean = self.source.image() if self.source is not None else super().image()
        return corrupt(clean, self.family, self.severity, self.source_id)


def shift_items(items: list[Item], family: str, severity: int) -> list[Item]:
    """Corrupted copies of `items` (`family` may be `all`: every family in turn)."""
    if family == "all":
        return [s for f in FAMILIES for s in shift_items(items, f, severity)]
    check(family, severity)
    out: list[Item] = []
    for it in items:
        if isinstance(it, ShiftedItem):
            raise ValueError("one corruption per item: a shifted item cannot be shifted again")
        base = {f.name: getattr(it, f.name) for f in fields(Item)}
        base["id"] = f"{it.id}~{family}:{severity}"
        if family in QUESTION_FAMILIES:
            base["question"] = benign_question(it.question, family, severity)
        own = type(it).image is not Item.image      # drawn, not read from image_path
        out.append(ShiftedItem(**base, family=family, severity=severity, source_id=it.id,
                               source=it if own else None))
    return out


def per_family(items: list[Item], families: tuple[str, ...], per_family: int,
               seed: int) -> list[Item]:
    """For each of `families` in turn, shifted copies of a deterministic sample of
    `per_family` of `items` (all when fewer), severities 1..5 in turn; family k's sample
    is drawn with seed `seed + k`."""
    out: list[Item] = []
    for k, fam in enumerate(families):
        base = sample(items, per_family, seed=seed + k)
        out += [shift_items([it], fam, SEVERITIES[j % len(SEVERITIES)])[0]
                for j, it in enumerate(base)]
    return out


def split_spec(spec: str) -> tuple[str, tuple[str, int] | None]:
    """`easyvqa:test~blur:3` -> (`easyvqa:test`, (`blur`, 3)); no suffix -> (spec, None).

    A `~` followed by a path separator (a home folder, `jsonl:~/d.jsonl`) is not a suffix.
    """
    m = SUFFIX.search(spec)
    if m is None:
        return spec, None
    family, sev = m.group(1), m.group(2)
    base = spec[: m.start()]
    if family != "all" and family not in PARAMS:
        raise ValueError(f"bad shift suffix in {spec!r}: unknown family {family!r}; use "
                         f"~FAMILY:SEVERITY with FAMILY in {', '.join(PARAMS)} or all")
    if sev is None or not sev.isdigit() or int(sev) not in SEVERITIES:
        raise ValueError(f"bad shift suffix in {spec!r}: severity must be 1-5 "
                         f"(~{family}:SEVERITY)")
    if SUFFIX.search(base):
        raise ValueError(f"bad data spec {spec!r}: one shift suffix per spec")
    if not base:
        raise ValueError(f"bad data spec {spec!r}: nothing before the shift suffix")
    return base, (family, int(sev))


def grid(base: str, families: tuple[str, ...] = FAMILIES,
         severities: tuple[int, ...] = SEVERITIES, clean: bool = True) -> list[str]:
    """Data specs for a family × severity grid over `base` (clean first), for `evaluate`."""
    for f in families:
        for s in severities:
            check(f, s)
    return ([base] if clean else []) + [f"{base}~{f}:{s}" for f in families for s in severities]
