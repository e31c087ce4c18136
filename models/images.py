"""Decoding untrusted image bytes: PNG, JPEG and DICOM, bounded, converted to RGB."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 50_000_000


class ImageError(ValueError):
    """The bytes are not an image we can use; the message says why."""


def _dicom(data: bytes) -> Image.Image:
    """DICOM to 8-bit: the file's own window (centre/width) when present, else min-max."""
    try:
        import pydicom
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImageError("DICOM support needs pydicom") from e
    try:
        ds = pydicom.dcmread(io.BytesIO(data))
        a = ds.pixel_array.astype(np.float64)
    except Exception as e:
        raise ImageError(f"unreadable DICOM: {e}") from e
    slope = float(getattr(ds, "RescaleSlope", 1) or 1)
    a = a * slope + float(getattr(ds, "RescaleIntercept", 0) or 0)
    centre, width = getattr(ds, "WindowCenter", None), getattr(ds, "WindowWidth", None)
    if centre is not None and width is not None:
        c = float(centre[0] if isinstance(centre, pydicom.multival.MultiValue) else centre)
        w = float(width[0] if isinstance(width, pydicom.multival.MultiValue) else width)
        lo, hi = c - w / 2, c + w / 2
    else:
        lo, hi = float(a.min()), float(a.max())
    a = np.clip((a - lo) / max(hi - lo, 1e-6), 0, 1) * 255
    if getattr(ds, "PhotometricInterpretation", "") == "MONOCHROME1":
        a = 255 - a
    if a.ndim == 3 and a.shape[-1] != 3:   # multi-frame: first frame
        a = a[0]
    return Image.fromarray(a.astype(np.uint8)).convert("RGB")


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode bytes into an RGB image or raise ImageError with the reason.

    The pixel limit is checked from the header, before the pixels are decoded, so a
    decompression bomb costs nothing.
    """
    if not data:
        raise ImageError("empty image")
    if len(data) > 132 and data[128:132] == b"DICM":
        img = _dicom(data)
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data))
                w, h = img.size
                if w * h > max_pixels:
                    raise ImageError(f"image has {w}x{h} pixels, over the limit of {max_pixels}")
                img.load()
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"image rejected as a decompression bomb: {e}") from e
        except UnidentifiedImageError:
            raise ImageError("cannot decode image: not a PNG, JPEG or DICOM file") from None
        except Exception as e:
            raise ImageError(f"cannot decode image: {e}") from e
    if img.mode == "I;16" or img.mode in ("I", "F"):
        a = np.asarray(img, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        img = Image.fromarray(((a - lo) / max(hi - lo, 1e-6) * 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, rgba)
    return img.convert("RGB")
