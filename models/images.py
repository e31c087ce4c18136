"""Decoding untrusted image bytes: PNG, JPEG and DICOM, bounded, converted to RGB.

Policy (the service documents the same):
- Formats: PNG, JPEG and DICOM only. GIF, WEBP, TIFF, BMP and the rest are refused rather
  than half-supported (animated frames, odd colour models); convert them to PNG first. An
  animated PNG is refused too. 16-bit grey PNGs are scaled by their bit depth (÷ 257).
- Size: the pixel count (DICOM: rows × columns × frames) is read from the header and
  checked before any pixel is decoded, so a decompression bomb costs nothing.
- Geometry: an aspect ratio above 200:1 is refused (VLM processors cannot resize it).
- DICOM: the transfer syntax is read from the file meta group before pydicom parses the
  dataset. Accepted: the native encodings (implicit/explicit VR little endian, explicit
  big endian) and JPEG baseline/extended (1.2.840.10008.1.2.4.50/.51). Deflated
  (1.2.840.10008.1.2.1.99) is refused before parsing: pydicom inflates the whole dataset
  in one call, about 1000:1, before anything can be checked. RLE (decoded byte by byte
  in Python, output unbounded until the end), JPEG 2000, JPEG-LS, lossless JPEG and the
  video syntaxes are refused after the header checks: their decoding cost is not bounded
  here. A JPEG frame goes through the same checks as a JPEG upload (`check_jpeg`) and its
  own header must declare exactly the dataset's rows × columns, both before decoding.
  No DICOM text (tag values) is quoted in an error.
- DICOM: single-frame only (a multi-frame object is a series; send the frame you mean);
  at most MAX_DICOM_ITEMS sequence items, and no more pixel data than its rows × columns
  need, both checked before pydicom parses or unpacks; MONOCHROME1/2 are windowed with the
  file's own centre/width (else min–max; a flat image keeps its level) to 8 bits,
  MONOCHROME1 inverted; RGB and YBR_FULL(_422) are converted to RGB, scaled by the stored
  bit depth; other photometric
  interpretations are refused. Malformed tags (also finite ones that overflow once
  applied) are refused with the tag's name.
- PNG: at most MAX_PNG_CHUNKS chunks, counted before PIL sees it, each with its CRC
  checked (a damaged file is refused as one). EXIF: at most MAX_EXIF_BYTES.
- JPEG, read marker by marker before PIL sees it: Huffman-coded baseline, extended or
  progressive only; at most one scan per component (sequential) or MAX_JPEG_SCANS
  (progressive), since each scan decodes the whole image again; at most
  MAX_JPEG_SEGMENTS segments and MAX_JPEG_GAP bytes in all passed over between them. A
  multi-picture JPEG (MPO) is its first picture.
- JPEG/PNG EXIF orientation is applied, so the pixels are the upright image.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import threading
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 50_000_000
MAX_EXIF_BYTES = 65536        # one APP1 segment's worth; PIL joins several into one block
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SOI = b"\xff\xd8"
MAX_PNG_CHUNKS = 16384        # PIL reads and checks each chunk in Python (873k empty: 2.5 s)
# EXIF orientation → the transpose that makes the picture upright
ORIENTATION = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
               4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
               6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
               8: Image.Transpose.ROTATE_90}
MAX_ASPECT_RATIO = 200
MAX_DICOM_ITEMS = 10000       # sequence items in a DICOM file (an image has tens)
# A progressive JPEG decodes its pixels once per scan, and nothing in the pixel count
# bounds the scans: 3,500 repeated scans in 336 KB held a decode for 35 s at 4096². An
# encoder's progressive script has about ten (libjpeg's default: 10 for colour), and
# libjpeg-turbo's own tools cap them (`-maxscans`) for the same reason.
MAX_JPEG_SCANS = 64
JPEG_CODINGS = (0xC0, 0xC1, 0xC2)       # Huffman: baseline, extended sequential, progressive
MAX_JPEG_SEGMENTS = 4096      # an encoder writes tens; libjpeg parses each (a DoS of its own)
MAX_JPEG_GAP = 65536          # bytes passed over between segments (junk, fill, stray markers)
FORMATS = ("PNG", "JPEG")
DICOM_MONO = ("MONOCHROME1", "MONOCHROME2")
DICOM_COLOUR = ("RGB", "YBR_FULL", "YBR_FULL_422")
FORMAT_HINT = "send a PNG, JPEG or DICOM file"
# DICOM transfer syntaxes whose pixel data is decoded here with its work bounded: the
# native encodings (length checked against rows × columns before unpacking) and JPEG
# baseline/extended (each frame through `check_jpeg`, its header against rows × columns).
DICOM_NATIVE = ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.2")
DICOM_JPEG = ("1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51")
DICOM_DEFLATED = "1.2.840.10008.1.2.1.99"
DICOM_HINT = ("send it uncompressed (Explicit VR Little Endian) or as baseline JPEG "
              "(1.2.840.10008.1.2.4.50), or send a PNG")


class ImageError(ValueError):
    """The bytes are not an image we can use; the message says why."""


class ImageTooLarge(ImageError):
    """Over the pixel limit (or a decompression bomb)."""


class ImageInvalid(ImageError):
    """Not decodable, not an accepted format, or unusable geometry."""


def check_geometry(width: int, height: int, max_pixels: int, frames: int = 1) -> None:
    """Refuse sizes the model cannot use, before the pixels are decoded."""
    if width < 1 or height < 1 or frames < 1:
        raise ImageInvalid(f"image has no pixels ({width}x{height}, {frames} frame(s))")
    if width * height * frames > max_pixels:
        what = f"{width}x{height}" + (f"x{frames} frames" if frames > 1 else "")
        raise ImageTooLarge(f"image has {what} pixels, over the limit of {max_pixels}")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ImageInvalid(f"image is {width}x{height}: aspect ratio over "
                           f"{MAX_ASPECT_RATIO}:1; crop or pad it")


# a marker: a run of 0xFF, then a code that is not a stuffed zero (in entropy-coded data,
# restart markers do not end the scan either)
_MARKER = re.compile(rb"\xff+([^\x00\xff])")
_SCAN_END = re.compile(rb"\xff+[^\x00\xd0-\xd7\xff]")


def _jpeg_segments(data: bytes) -> Iterator[tuple[int, int]]:
    """(marker, offset of its payload) of each marker segment of a JPEG stream, walked as
    libjpeg reads them: bytes between segments that are not a marker (junk, fill bytes,
    stuffed zeros, restart markers) are passed over, as libjpeg does, a segment by its
    length (an EXIF thumbnail inside an APP segment goes with it) and, after each scan
    header, the entropy-coded data up to the next marker. Stops at EOI or where the
    stream ends. The searches run in C; more than MAX_JPEG_GAP bytes in all passed over between
    segments is refused (PIL's own header parser reads them one by one in Python)."""
    i, n, gap = 2, len(data), 0
    while i + 4 <= n:
        m = _MARKER.search(data, i)
        if m is None:
            return
        marker = m.group(1)[0]
        gap += m.start(1) - 1 - i
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:      # no length field: junk here
            gap += 2
            i = m.end()
        if gap > MAX_JPEG_GAP:
            raise ImageInvalid(f"JPEG with over {MAX_JPEG_GAP} bytes in all between its "
                               f"segments; re-encode it (baseline JPEG or PNG)")
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            continue
        if marker == 0xD9:                                 # EOI
            return
        at = m.end()
        if at + 2 > n:
            return
        yield marker, at + 2
        i = at + int.from_bytes(data[at:at + 2], "big")
        if marker == 0xDA:
            end = _SCAN_END.search(data, i)
            if end is None:
                return
            i = end.start()


def jpeg_layout(data: bytes) -> tuple[tuple[int, int] | None, int, int, int]:
    """The first frame header's (marker, number of components) or None (0xC0 baseline,
    0xC1 extended sequential, 0xC2 progressive, 0xC9.. arithmetic, ...), the number of
    scans (SOS segments) and of marker segments, and the bytes of EXIF (APP1 segments
    starting "Exif", which PIL joins into one block), in one walk (`_jpeg_segments`).
    Stops counting past MAX_JPEG_SEGMENTS + 1 segments."""
    frame, scans, segments, exif = None, 0, 0, 0
    for marker, at in _jpeg_segments(data):
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            break
        if frame is None and 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            frame = (marker, data[at + 5] if at + 5 < len(data) else 0)   # not DHT/JPG/DAC
        scans += marker == 0xDA
        if marker == 0xE1 and data[at:at + 6] == b"Exif\x00\x00":
            exif += int.from_bytes(data[at - 2:at], "big") - 8
    return frame, scans, segments, exif


def jpeg_scans(data: bytes) -> int:
    """How many scans (SOS segments) a JPEG stream has."""
    return jpeg_layout(data)[1]


def _exif_too_large() -> ImageInvalid:
    return ImageInvalid(f"EXIF block over {MAX_EXIF_BYTES} bytes; strip the metadata (a "
                        f"camera writes one segment of at most that)")


def _damaged(kind: str, why: str) -> ImageInvalid:
    return ImageInvalid(f"cannot decode image: damaged {kind} file ({why}): it was altered "
                        f"or cut short on its way; send the file again or re-encode it")


def check_png(data: bytes) -> None:
    """Refuse a PNG of more than MAX_PNG_CHUNKS chunks before PIL reads them (an encoder
    writes tens, or a few thousand image-data chunks for a large picture), and one whose
    critical chunk (IHDR, PLTE, IDAT, IEND: an uppercase first letter) fails its CRC: PIL
    checks the chunks before the image data only, and calls such a file "not a PNG" (the
    image data's own it does not check: altered pixels decode). An ancillary chunk (a
    lowercase first letter) with a bad CRC is libpng's to warn about and drop, not to
    refuse: after the image data PIL reads it unchecked and the image is served; before
    it PIL refuses the file, which is called damaged here, with the chunk."""
    i, n, chunks, pixels = 8, len(data), 0, False
    view = memoryview(data)
    while i + 8 <= n:
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise ImageInvalid(f"PNG with over {MAX_PNG_CHUNKS} chunks; re-encode it")
        end = i + 12 + int.from_bytes(data[i:i + 4], "big")
        kind = data[i + 4:i + 8]
        pixels = pixels or kind == b"IDAT"
        critical = not kind[0] & 0x20
        # a chunk cut short is PIL's to report ("truncated")
        if (critical or not pixels) and end <= n and \
                zlib.crc32(view[i + 4:end - 4]) != int.from_bytes(data[end - 4:end], "big"):
            raise _damaged("PNG", f"chunk {chunks}, at byte {i}, fails its CRC checksum")
        if kind == b"IEND":
            return
        i = end


def check_jpeg(data: bytes) -> None:
    """Refuse JPEGs whose decoding costs far more than their pixels: every scan decodes
    the whole image again, arithmetic decoding does each block's work even for a scan
    with no data (64 empty scans in a 1 KB file held a decode for 4.5 s at 4096²), and
    every segment is parsed (a file of millions of empty ones). Huffman-coded baseline,
    extended and progressive JPEGs are what encoders write; a sequential one has at most
    one scan per component, a progressive one MAX_JPEG_SCANS (an encoder's script has
    about ten; libjpeg-turbo's tools cap them, `-maxscans`)."""
    frame, scans, segments, exif = jpeg_layout(data)
    if exif > MAX_EXIF_BYTES:
        # PIL joins the segments by copying the block so far for each (4,080 of them: 14 s)
        raise _exif_too_large()
    if segments > MAX_JPEG_SEGMENTS:
        raise ImageInvalid(f"JPEG with over {MAX_JPEG_SEGMENTS} marker segments; "
                           f"re-encode it (baseline JPEG or PNG)")
    if frame is None:
        raise ImageInvalid("cannot decode image: JPEG without a frame header")
    if frame[0] not in JPEG_CODINGS:
        raise ImageInvalid("JPEG coding not accepted (arithmetic, lossless or hierarchical): "
                           "re-encode it as a baseline or progressive JPEG, or a PNG")
    if frame[1] == 0:          # a frame of no components, or cut short inside its header
        raise _damaged("JPEG", "its frame header names no colour components")
    limit = MAX_JPEG_SCANS if frame[0] == 0xC2 else frame[1]
    if scans > limit:
        kind = "progressive JPEG" if frame[0] == 0xC2 else \
            f"sequential JPEG of {frame[1]} component(s)"
        raise ImageInvalid(f"{kind} with {scans} scans, over its limit of {limit}; "
                           f"re-encode it (baseline JPEG or PNG)")


def _tag(ds, name: str, default, cast=float):
    """A DICOM attribute as a number (first value if multi-valued), or ImageInvalid."""
    try:
        # pydicom converts the value as it reads it: an IS of 5,000 digits overflows here
        value = ds.get(name, None)
    except Exception:
        raise ImageInvalid(f"malformed DICOM tag {name}") from None
    if value is None or value == "":
        return default
    try:
        import pydicom

        if isinstance(value, pydicom.multival.MultiValue):
            value = value[0]
        return cast(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        raise ImageInvalid(f"malformed DICOM tag {name}") from None


def _compressed(ds) -> bool:
    """Whether a dataset's transfer syntax is an encapsulated (compressed) one; an
    unknown one counts as not (decoding it fails later, with its own message)."""
    try:
        return bool(getattr(ds, "file_meta", {}).get("TransferSyntaxUID").is_compressed)
    except Exception:
        return False


def _syntax_name(uid: str) -> str:
    """A transfer syntax's registered name, or a phrase: never the client's own text."""
    import pydicom.uid

    known = pydicom.uid.UID_dictionary.get(uid)
    return f"{known[0]} ({uid})" if known else "(unregistered)"


def dicom_transfer_syntax(data: bytes) -> str | None:
    """The transfer syntax a DICOM file's meta group declares (None: none declared),
    read with pydicom's own file-meta reader (what `dcmread` reads first, so both see the
    same value) without parsing the dataset. Refuses, before parsing, a syntax whose
    parsing itself decompresses: deflated (pydicom inflates the whole dataset in one
    `zlib.decompress`, ~1000:1; 995 KB held 2 GB) and any syntax not registered as native
    or encapsulated (encapsulated pixel data stays bytes while parsing)."""
    import pydicom.uid
    from pydicom.filereader import _read_file_meta_info, read_preamble

    fp = io.BytesIO(data)
    try:
        read_preamble(fp, False)
        meta = _read_file_meta_info(fp)
        uid = meta.get("TransferSyntaxUID")
    except Exception as e:   # pydicom raises many types on hostile input
        raise ImageInvalid(f"unreadable DICOM file meta: {type(e).__name__}") from None
    if uid is None:
        return None          # pydicom guesses a native encoding; nothing is inflated
    uid = str(uid)
    known = pydicom.uid.UID_dictionary.get(uid)
    parse_safe = uid in DICOM_NATIVE or (
        known is not None and "Deflate" not in known[0] and pydicom.uid.UID(uid).is_encapsulated)
    if uid == DICOM_DEFLATED or not parse_safe:
        raise ImageInvalid(f"DICOM transfer syntax {_syntax_name(uid)} is not accepted: its "
                           f"decompression cannot be bounded; {DICOM_HINT}")
    return uid


def check_dicom_frame(ds, rows: int, cols: int, max_pixels: int) -> bytes:
    """Before an encapsulated JPEG frame is decoded: exactly one frame (as pydicom will
    cut it: no extended offset table, one frame of the basic one), a JPEG that passes
    `check_jpeg` (scans, segments, coding), and a header that declares the dataset's own
    rows × columns (a 64×64 dataset held a 9400² JPEG: 3.7 GB for four at once). Returns
    the frame, checked."""
    from pydicom.encaps import generate_frames

    if "ExtendedOffsetTable" in ds or "ExtendedOffsetTableLengths" in ds:
        raise ImageInvalid("DICOM with an extended offset table (multi-frame) is not "
                           "supported; send the one frame you mean")
    try:
        frames = list(itertools.islice(generate_frames(ds.PixelData, number_of_frames=1), 2))
    except Exception as e:
        raise ImageInvalid(f"unreadable DICOM encapsulated pixel data: {type(e).__name__}"
                           ) from None
    if len(frames) != 1:
        raise ImageInvalid("DICOM encapsulated pixel data holds more than one frame; send "
                           "the one frame you mean")
    frame = frames[0]
    if frame[:2] != JPEG_SOI:
        raise ImageInvalid("DICOM JPEG frame does not start with a JPEG header")
    check_jpeg(frame)
    try:
        with Image.open(io.BytesIO(frame), formats=["JPEG"]) as img:
            width, height = img.size
    except Exception as e:
        raise ImageInvalid(f"unreadable DICOM JPEG frame: {type(e).__name__}") from None
    if (width, height) != (cols, rows):
        raise ImageInvalid(f"DICOM JPEG frame of {width}x{height} pixels, not the "
                           f"{cols}x{rows} its Rows and Columns declare")
    check_geometry(width, height, max_pixels)
    return frame


def _dicom(data: bytes, max_pixels: int) -> Image.Image:
    try:
        import pydicom
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImageInvalid("DICOM support needs pydicom") from e
    # pydicom parses every item in Python: 655k empty sequence items in 10 MiB took 11 s
    # and 491 MB. The item tag's bytes (either byte order) bound how many there are.
    items = data.count(b"\xfe\xff\x00\xe0") + data.count(b"\xff\xfe\xe0\x00")
    if items > MAX_DICOM_ITEMS:
        raise ImageInvalid(f"DICOM with over {MAX_DICOM_ITEMS} sequence items")
    syntax = dicom_transfer_syntax(data)
    try:
        ds = pydicom.dcmread(io.BytesIO(data))
    except Exception as e:   # pydicom raises many types on hostile input
        raise ImageInvalid(f"unreadable DICOM: {type(e).__name__}") from None
    if "PixelData" not in ds:
        raise ImageInvalid("DICOM has no pixel data")
    rows = _tag(ds, "Rows", 0, int)
    cols = _tag(ds, "Columns", 0, int)
    frames = _tag(ds, "NumberOfFrames", 1, int)
    check_geometry(cols, rows, max_pixels, frames)
    if frames != 1:
        raise ImageInvalid(f"multi-frame DICOM ({frames} frames) is not supported; "
                           "send the one frame you mean")
    try:
        photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).strip().upper()
    except Exception:          # a value written with a numeric VR, converted as it is read
        raise ImageInvalid("malformed DICOM tag PhotometricInterpretation") from None
    if photometric not in DICOM_MONO + DICOM_COLOUR:
        # not quoted: a tag's text is the client's (it could be anything, a name too)
        raise ImageInvalid(f"DICOM photometric interpretation not supported (accepted: "
                           f"{', '.join(DICOM_MONO + DICOM_COLOUR)})")
    # after the pixel limit (a 16000² RLE header is 413, as any other): decoders whose
    # work is not bounded here are refused before they run
    if syntax is not None and syntax not in DICOM_NATIVE + DICOM_JPEG:
        raise ImageInvalid(f"DICOM transfer syntax {_syntax_name(syntax)} is not accepted: "
                           f"its decoding cannot be bounded; {DICOM_HINT}")
    frame = check_dicom_frame(ds, rows, cols, max_pixels) if syntax in DICOM_JPEG else None
    samples = _tag(ds, "SamplesPerPixel", 3 if photometric in DICOM_COLOUR else 1, int)
    bits = _tag(ds, "BitsAllocated", 8, int)
    stored = _tag(ds, "BitsStored", bits, int)
    # before the pixels are unpacked (10 MiB of 1-bit data for a 64×64 image became an
    # array of 84 M floats, 789 MB, and only then failed the shape check); a native
    # encoding pads to an even length
    expected = (rows * cols * samples * max(bits, 1) + 7) // 8
    raw = ds.get("PixelData")
    if isinstance(raw, bytes | bytearray) and len(raw) > expected + 1 and \
            not _compressed(ds):
        raise ImageInvalid(f"DICOM pixel data of {len(raw)} bytes, more than "
                           f"{rows}x{cols}x{samples} pixels of {bits} bits need")
    slope = _tag(ds, "RescaleSlope", 1.0) or 1.0
    intercept = _tag(ds, "RescaleIntercept", 0.0)
    centre = _tag(ds, "WindowCenter", None)
    width = _tag(ds, "WindowWidth", None)
    for name, v in (("RescaleSlope", slope), ("RescaleIntercept", intercept),
                    ("WindowCenter", centre), ("WindowWidth", width)):
        if v is not None and not np.isfinite(v):   # nan/inf would make a blank image
            raise ImageInvalid(f"malformed DICOM tag {name}")
    colour = photometric in DICOM_COLOUR
    try:
        if frame is not None:
            # Pillow decodes the frame that was checked, to bytes (YBR arrives as RGB);
            # pydicom's path converts colour in float64 copies: +1.1 GB for one 4096² frame
            with Image.open(io.BytesIO(frame), formats=["JPEG"]) as img:
                img.load()
                if colour and stored == 8 and img.mode == "RGB":
                    return img.copy()       # what the float path gives 8-bit colour
                a = np.asarray(img, dtype=np.float32)
        else:
            a = np.asarray(ds.pixel_array, dtype=np.float64)   # YBR arrives as RGB
    except Exception as e:
        raise ImageInvalid(f"unreadable DICOM pixel data: {type(e).__name__}") from None
    if a.shape[:2] != (rows, cols) or (colour and a.shape[2:] != (3,)) or \
            (not colour and a.ndim != 2):
        raise ImageInvalid(f"DICOM pixel data of shape {a.shape} does not match "
                           f"{rows}x{cols} {photometric}")
    if not np.isfinite(a).all():
        raise ImageInvalid("DICOM pixel data is not finite")
    # the stored bit depth's full range: a white 16-bit image stays white (scaled by its
    # own range it turned black, and a near-black one grey)
    top = float(2 ** min(max(stored, 1), 64) - 1)
    if colour:
        lo, hi = (0.0, top) if a.max() <= top and a.min() >= 0 else (a.min(), a.max())
        a = np.clip((a - lo) / max(hi - lo, 1e-6), 0, 1) * 255
        return Image.fromarray(a.astype(np.uint8), "RGB")
    flat = float(a.max() - a.min()) == 0.0
    level = float(np.clip(a.flat[0] / top, 0, 1)) if a.size else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        # finite tags can still overflow once applied (slope 1e308 × a pixel of 64)
        a = a * slope
        if not np.isfinite(a).all():
            raise ImageInvalid("malformed DICOM tag RescaleSlope: rescaled pixels overflow")
        a = a + intercept
        if not np.isfinite(a).all():
            raise ImageInvalid("malformed DICOM tag RescaleIntercept: rescaled pixels "
                               "overflow")
        if centre is not None and width is not None and width > 0:
            lo, hi = centre - width / 2, centre + width / 2
            if not np.isfinite([lo, hi]).all():
                raise ImageInvalid("malformed DICOM tags WindowCenter/WindowWidth: the "
                                   "window overflows")
        else:
            lo, hi = float(a.min()), float(a.max())
            if not np.isfinite(hi - lo):
                raise ImageInvalid("malformed DICOM tag RescaleSlope: the pixel range "
                                   "overflows")
    if flat and not (centre is not None and width is not None and width > 0):
        # no window and one value: min–max has no range to map; keep the stored level
        a = np.full_like(a, level * 255)
    else:
        a = np.clip((a - lo) / max(hi - lo, 1e-6), 0, 1) * 255
    if photometric == "MONOCHROME1":
        a = 255 - a
    return Image.fromarray(a.astype(np.uint8)).convert("RGB")


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode bytes into an RGB image or raise ImageTooLarge / ImageInvalid with the reason.

    The pixel limit and the aspect ratio are checked from the header, before the pixels
    are decoded.
    """
    if not data:
        raise ImageInvalid("empty image")
    # a PNG or JPEG whose bytes 128-131 happen to read "DICM" is still that
    png, jpeg = data[:8] == PNG_SIGNATURE, data[:2] == JPEG_SOI
    if len(data) > 132 and data[128:132] == b"DICM" and not (png or jpeg):
        img = _dicom(data, max_pixels)
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                if jpeg:
                    check_jpeg(data)     # before PIL, whose header parser is Python too
                elif png:
                    check_png(data)      # likewise its chunk loop
                img = Image.open(io.BytesIO(data), formats=list(FORMATS))
                check_geometry(*img.size, max_pixels)
                # a phone's multi-picture JPEG (MPO: a depth map, an HDR gain map) is one
                # photograph and its companions: the first frame is the photograph
                if getattr(img, "n_frames", 1) > 1 and img.format != "MPO":
                    raise ImageInvalid(f"animated image ({img.n_frames} frames): send one "
                                       f"frame as a still PNG or JPEG; {FORMAT_HINT}")
                img.load()
                # after loading: a PNG's eXIf chunk may follow its image data
                if len(img.info.get("exif") or b"") > MAX_EXIF_BYTES:
                    raise _exif_too_large()
                # A camera's EXIF orientation: the model must see the scene upright (a
                # rotated shape read as another one, confidently, in the attack report).
                # Turned here rather than by `ImageOps.exif_transpose`, which rebuilds the
                # whole EXIF block in Python when it turns (60,000 tags: 20 s).
                turn = ORIENTATION.get(img.getexif().get(0x0112))
                if turn is not None:
                    img = img.transpose(turn)
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageTooLarge("image rejected as a decompression bomb") from None
        except UnidentifiedImageError:
            if png:       # PIL could not read past a PNG's signature
                raise _damaged("PNG", "its header cannot be read") from None
            if jpeg:      # a frame PIL refuses: damaged (a zero height) or a variant
                raise ImageInvalid(     # it does not decode (12-bit samples): no way to tell
                    "cannot decode image: a JPEG whose frame the decoder cannot read (damaged, "
                    "or a variant it does not decode, such as 12-bit samples); re-encode it "
                    "as an 8-bit baseline JPEG or a PNG") from None
            raise ImageInvalid(f"cannot decode image: not a PNG, JPEG or DICOM file; "
                               f"{FORMAT_HINT}") from None
        except Exception as e:
            raise _decoder_error(e) from None
    try:      # PIL checks some things only here (a palette PNG's transparency past its end)
        return _to_rgb(img)
    except Exception as e:
        raise _decoder_error(e) from None


def _decoder_error(e: Exception) -> ImageInvalid:
    # the decoder's own words when they say what is wrong; not when they quote the file
    # (PIL's "header b'...' not valid" repeats the client's bytes)
    why = str(e)[:120]
    quoted = any(c in why for c in "'\"\\") or not why.isprintable()
    return ImageInvalid(f"cannot decode image: {type(e).__name__}"
                        + ("" if quoted else f": {why}"))


def _to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB of a decoded image: 16-bit and float greys scaled, transparency over
    white."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greys (PNG stores them as I;16 or I): scale by the bit depth, not by the
        # image's own range, which turned a white image black and changed the picture
        a = np.asarray(img, dtype=np.float64)
        img = Image.fromarray(np.clip(np.round(a / 257.0), 0, 255).astype(np.uint8))
    elif img.mode == "F":
        # float pixels carry no scale of their own: the image's range is all there is
        a = np.asarray(img, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        img = Image.fromarray(((a - lo) / max(hi - lo, 1e-6) * 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, rgba)
    return img.convert("RGB")


# ---------------------------------------------------------------------------- warnings
# pydicom and PIL warn with the file's own text (a tag's value, a patient name), and
# Python prints a warning to stderr, outside the JSON log lines. `log_warnings` sends
# every warning to the log instead: its category and the code that raised it, the message
# only when an image decoder did not raise it.
DECODER_PACKAGES = ("pydicom", "PIL")
_seen: dict[tuple[str, str, int], int] = {}
_seen_lock = threading.Lock()


def _source(filename: str) -> tuple[str, bool]:
    """Where a warning was raised, as `package/module.py`, and whether an image decoder
    raised it."""
    parts = Path(filename).parts
    # a decoder's warning may name this module as its caller (stacklevel)
    decoder = any(p in DECODER_PACKAGES for p in parts) or parts[-2:] == ("models", "images.py")
    return "/".join(parts[-2:]), decoder


def log_warning(message, category, filename, lineno, file=None, line=None,
                logger: logging.Logger | None = None) -> None:
    """`warnings.showwarning` as a JSON log line. Each place in the code is logged at its
    1st, 2nd, 4th, 8th... warning, with the count so far: a hostile file raises thousands
    (one per malformed element), and the log must not grow with them."""
    source, decoder = _source(str(filename))
    key = (category.__name__, source, int(lineno))
    with _seen_lock:
        n = _seen[key] = _seen.get(key, 0) + 1
    if n & (n - 1):
        return
    entry = {"event": "warning", "category": category.__name__, "source": source,
             "line": lineno, "count": n}
    if not decoder:
        entry["message"] = str(message)[:300]
    (logger or logging.getLogger("dualread.service")).warning(json.dumps(entry))


def log_warnings(logger: logging.Logger) -> None:
    """Route warnings into `logger` (process-wide; `log_warning`), and keep pydicom's log
    records (the same text) from propagating. The decoders' warnings
    are always shown to the hook, never recorded in their module's registry: the default
    action keeps every distinct message text there, so a file's text would stay in memory."""
    for package in (*DECODER_PACKAGES, __name__):
        warnings.filterwarnings("always", module=rf"{re.escape(package)}(\.|$)")

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        log_warning(message, category, filename, lineno, logger=logger)

    warnings.showwarning = show
    # pydicom also logs each warning, text and all, to its own logger: kept out of any
    # handler an embedding process puts on the root logger
    logging.getLogger("pydicom").propagate = False
