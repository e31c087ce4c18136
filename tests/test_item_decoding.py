"""Fitting and evaluation read an item's image as `/answer` decodes an upload, so the
detector's pixel part and the actor see the same pixels offline as when served."""

import io

import numpy as np
import pytest
from PIL import Image

from models.images import open_image
from models.items import Item


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("make", [
    lambda: Image.fromarray(np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)),
    lambda: Image.fromarray(np.dstack([np.full((32, 32, 3), 40, np.uint8),
                                       np.tile(np.arange(32, dtype=np.uint8) * 8, (32, 1))]),
                            "RGBA"),
], ids=["16-bit grey", "RGBA"])
def test_an_item_reads_its_image_as_the_service_does(tmp_path, make):
    data = _png(make())
    path = tmp_path / "x.png"
    path.write_bytes(data)
    item = Item(id="i", image_path=str(path), question="q?", answer="a", image_id="x")
    served = np.asarray(open_image(data))
    assert np.array_equal(np.asarray(item.image()), served)
    # a plain RGB conversion reads other pixels here: the case this guards
    with Image.open(path) as im:
        assert not np.array_equal(np.asarray(im.convert("RGB")), served)


def test_a_jpeg_whose_frame_pil_refuses_is_called_a_damaged_jpeg():
    """A JPEG start marker then a frame of height 0: a damaged JPEG, not 'not a PNG, JPEG
    or DICOM file', which would send the client looking for the wrong problem."""
    from models.images import ImageInvalid

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.find(b"\xff\xc0")               # baseline frame: FF C0, length, precision,
    data[sof + 5:sof + 7] = b"\x00\x00"        # then the height
    with pytest.raises(ImageInvalid, match=r"damaged JPEG file \(its frame header cannot "
                                           r"be read\)"):
        open_image(bytes(data))
