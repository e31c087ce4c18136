"""The image-disjoint splits every fit uses (`fit-heads`, `fit-detectors`, the studies):
each image goes to one split by a hash of its id, so no image is in two."""

from __future__ import annotations

import hashlib

import torch

SPLITS = {"reader": 0.6, "temperature": 0.8, "defer": 1.0}   # cumulative shares of images


def image_split(image_id: str, salt: str = "dualread") -> str:
    """Deterministic image-disjoint split: hash of the image id."""
    u = int(hashlib.sha256((salt + image_id).encode()).hexdigest()[:8], 16) / 16 ** 8
    return next(name for name, edge in SPLITS.items() if u < edge)


def _idx(meta: dict, split: str, sub: str | None = None) -> torch.Tensor:
    out = []
    for k, img in enumerate(meta["image_ids"]):
        if image_split(img) != split:
            continue
        if sub is not None and (image_split(img, "es") == "defer") != (sub == "val"):
            continue
        out.append(k)
    return torch.tensor(out, dtype=torch.long)


def splits_of(meta: dict) -> dict[str, torch.Tensor]:
    """Item indices of every split (image-disjoint), by name."""
    out = {s: _idx(meta, s) for s in SPLITS}
    out["reader_train"], out["reader_val"] = _idx(meta, "reader", "train"), \
        _idx(meta, "reader", "val")
    return out
