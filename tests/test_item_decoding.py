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


def _jpeg_with_frame(patch) -> bytes:
    """A small baseline JPEG whose frame header (FF C0, length, precision, height, width,
    components) `patch(data, at)` edits in place."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    patch(data, data.find(b"\xff\xc0"))
    return bytes(data)


@pytest.mark.parametrize("patch", [
    lambda d, at: d.__setitem__(slice(at + 5, at + 7), b"\x00\x00"),   # height 0
    lambda d, at: d.__setitem__(at + 4, 12),                             # 12-bit samples
], ids=["height-0", "12-bit"])
def test_a_jpeg_whose_frame_the_decoder_refuses_says_so_and_what_to_send(patch):
    """Not 'not a PNG, JPEG or DICOM file' (it is a JPEG), and not 'damaged' either: a
    12-bit JPEG is valid, the decoder cannot tell the two apart, and resending will not
    help; re-encoding will."""
    from models.images import ImageInvalid

    with pytest.raises(ImageInvalid, match=r"a JPEG whose frame the decoder cannot read "
                                           r"\(damaged, or a variant .*12-bit.*\); "
                                           r"re-encode it as an 8-bit baseline JPEG or a PNG"):
        open_image(_jpeg_with_frame(patch))


def test_a_jpeg_frame_of_no_components_is_damaged_not_over_a_scan_limit():
    from models.images import ImageInvalid

    data = _jpeg_with_frame(lambda d, at: d.__setitem__(at + 9, 0))
    with pytest.raises(ImageInvalid, match=r"damaged JPEG file \(its frame header names no "
                                           r"colour components\)"):
        open_image(data)


def test_a_palette_png_whose_transparency_runs_past_its_palette_is_a_422_not_a_500():
    """PIL reads a tRNS chunk longer than the palette only when converting: the error
    there is the file's, refused like any decoding error."""
    import struct
    import zlib

    from models.images import ImageInvalid

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 3, 0, 0, 0))
           + chunk(b"PLTE", b"\0\0\0") + chunk(b"tRNS", b"\0" * 257)
           + chunk(b"IDAT", zlib.compress(b"\0" * 9 * 8)) + chunk(b"IEND", b""))
    with pytest.raises(ImageInvalid, match=r"^cannot decode image: ValueError: palette index "
                                           r"out of range$"):
        open_image(png)
