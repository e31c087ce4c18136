"""The blank counterfactual image, defined once for both sides of the API.

docs/method.md §5's *blank* condition (visual reliance) and the `"blank"` counterfactual of
`/probe/counterfactual`: a fixed 224×224 RGB image of (128, 128, 128). Mid-gray and one
fixed size, so every item sees the same content-free input.

The server (`models.counterfactuals`) and the probe suites (`clients.probes.images`) both
import it from here. The constants need nothing; `blank_image()` needs Pillow, imported
when called, because Pillow is not in the client install (`dualread[client]`): a client
that only sends `"blank"` never builds the image, the server does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

BLANK_SIZE = (224, 224)
BLANK_RGB = (128, 128, 128)


def blank_image() -> Image.Image:
    """docs/method.md §5 blank condition: 224×224 RGB (128, 128, 128). Needs Pillow."""
    from PIL import Image

    return Image.new("RGB", BLANK_SIZE, BLANK_RGB)
