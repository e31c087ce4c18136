"""The two counterfactual images, defined once.

They answer different questions, so they differ on purpose:

- `blank_image()`: docs/method.md §5's *blank* condition for visual reliance and the `blank`
  counterfactual of `/probe/counterfactual`: a fixed 224×224 RGB image of (128, 128, 128).
  Mid-gray and a fixed size, so every item sees the same content-free input. Defined in
  `clients.counterfactual` (torch- and model-free, so the probe suites send the very same
  pixels) and re-exported here.
- `black_image(size)`: docs/method.md §7's *blind image* for the blind-image-contrast baseline
  (BICR): an all-black image of the real image's size, so the replay differs from the real pass in
  pixel content only (same image-token count, same positions).
"""

from __future__ import annotations

from PIL import Image

from clients.counterfactual import BLANK_RGB, BLANK_SIZE, blank_image

__all__ = ["BLACK_RGB", "BLANK_RGB", "BLANK_SIZE", "black_image", "blank_image"]

BLACK_RGB = (0, 0, 0)


def black_image(size: tuple[int, int]) -> Image.Image:
    """docs/method.md §7 BICR replay input: black, the same size as the real image."""
    return Image.new("RGB", size, BLACK_RGB)
