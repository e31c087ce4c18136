"""One VQA item, the easy-VQA label sets and the seeded sample: what every loader shares.

models.data dispatches a data spec to its loader, some of which (models.shift,
models.render) build on other loaders' items; they import these from here, never from
models.data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from models.canon import canon
from models.images import open_image

COLOURS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SHAPES = ("circle", "rectangle", "triangle")


@dataclass(frozen=True)
class Item:
    id: str
    image_path: str
    question: str
    answer: str
    image_id: str
    box: tuple[int, int, int, int] | None = None
    domain: str = ""
    answer_type: str = ""
    options: dict[str, str] = field(default_factory=dict)

    def image(self) -> Image.Image:
        """Decoded as `/answer` decodes an upload (16-bit greys scaled, alpha on white, EXIF
        orientation): fitting and evaluation read the pixels the service will score."""
        return open_image(Path(self.image_path).read_bytes())

    @property
    def canonical(self) -> str:
        return canon(self.answer, self.options or None)


def sample(items: list[Item], limit: int | None, seed: int = 0) -> list[Item]:
    """A deterministic subset of `limit` items (order kept), or all."""
    if limit is None or limit >= len(items):
        return items
    idx = np.random.default_rng(seed).choice(len(items), size=limit, replace=False)
    return [items[i] for i in sorted(idx)]
