"""Hostile-client round 3 (issue 26): DICOM decoders, oversized numbers, and the gaps that
mutations survived (streamed-body limit, base64 bound, feedback metric label, prior check).

The three DICOM attacks are reproduced small: a deflated dataset that inflates 1000:1, a
JPEG frame of hundreds of progressive scans, and a frame far larger than its dataset's
rows × columns. Fixtures are written here with pydicom and Pillow.
"""

from __future__ import annotations

import io
import json
import logging
import tracemalloc
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from models.images import ImageInvalid, log_warning, log_warnings, open_image
from tests.conftest import random_image
from tests.helpers import assert_error, b64, png_bytes, small_limits_client

pydicom = pytest.importorskip("pydicom")

from pydicom.dataset import FileDataset, FileMetaDataset  # noqa: E402
from pydicom.encaps import encapsulate  # noqa: E402
from pydicom.uid import (  # noqa: E402
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    RLELossless,
    generate_uid,
)

Q = "what color is the shape?"


# ------------------------------------------------------------------ fixtures
def _file(syntax: str) -> FileDataset:
    meta = FileMetaDataset()
    meta.TransferSyntaxUID = syntax
    meta.MediaStorageSOPClassUID = generate_uid()
    meta.MediaStorageSOPInstanceUID = generate_uid()
    return FileDataset("x.dcm", {}, file_meta=meta, preamble=b"\0" * 128)


def _write(ds: FileDataset) -> bytes:
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


def dicom(rows: int, cols: int, pixel_data: bytes, syntax: str = ExplicitVRLittleEndian,
          photometric: str = "MONOCHROME2") -> bytes:
    """A single-frame 8-bit DICOM file."""
    ds = _file(syntax)
    spp = 1 if photometric.startswith("MONOCHROME") else 3
    ds.Rows, ds.Columns, ds.BitsAllocated, ds.BitsStored, ds.HighBit = rows, cols, 8, 8, 7
    ds.SamplesPerPixel, ds.PhotometricInterpretation = spp, photometric
    ds.PixelRepresentation = 0
    if spp == 3:
        ds.PlanarConfiguration = 0
    ds.PixelData = pixel_data
    if pydicom.uid.UID(syntax).is_encapsulated:
        ds["PixelData"].VR = "OB"
    return _write(ds)


def jpeg(img: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **options)
    return buf.getvalue()


def jpeg_in_dicom(data: bytes, rows: int, cols: int, photometric: str = "MONOCHROME2"
                  ) -> bytes:
    return dicom(rows, cols, encapsulate([data]), JPEGBaseline8Bit, photometric)


def many_scans(data: bytes, n: int) -> bytes:
    """A progressive JPEG whose last scan is repeated n times: every decoder reads it, and
    each scan decodes the whole image again."""
    sos = data.rfind(b"\xff\xda")
    return data[:sos] + data[sos:-2] * n + b"\xff\xd9"


def deflated(size: int) -> bytes:
    """A deflated DICOM file whose dataset inflates to `size` bytes (one long OB element of
    zeros): about 1000:1."""
    head = _write(_file(DeflatedExplicitVRLittleEndian))
    # the file meta only (preamble, prefix, group length element, the group): pydicom
    # wrote an empty deflated dataset after it
    head = head[:144 + int.from_bytes(head[140:144], "little")]
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    out = [z.compress(b"\xe0\x7f\x10\x00OB\x00\x00" + size.to_bytes(4, "little"))]
    zeros = bytes(1 << 20)
    for left in range(size, 0, -len(zeros)):
        out.append(z.compress(zeros[:min(left, len(zeros))]))
    return head + b"".join(out) + z.flush()


GREY = Image.fromarray((np.arange(64 * 64).reshape(64, 64) % 251).astype(np.uint8))


make = small_limits_client


# ------------------------------------------------------------------ 1. deflated DICOM
def test_deflated_dicom_is_refused_before_anything_is_inflated(monkeypatch):
    # a real bomb: pydicom inflates it while parsing
    assert len(pydicom.dcmread(io.BytesIO(deflated(1_000_000))).PixelData) == 1_000_000
    raw = deflated(100_000_000)           # 100 MB once inflated
    assert len(raw) < 200_000
    inflated = []

    def record(*a, **k):
        inflated.append(1)
        raise MemoryError
    monkeypatch.setattr(pydicom.filereader.zlib, "decompress", record)
    tracemalloc.start()
    try:
        with pytest.raises(ImageInvalid, match="Deflated Explicit VR Little Endian"):
            open_image(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not inflated
    assert peak < 5 * len(raw)            # the file, read once or twice; nothing inflated


def test_deflated_dicom_over_http_is_422(api):
    raw = deflated(50_000_000)
    assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422,
                 "transfer syntax", "cannot be bounded")


@pytest.mark.parametrize("syntax", [RLELossless, JPEG2000Lossless])
def test_dicom_decoders_without_a_bound_are_refused_before_decoding(monkeypatch, syntax):
    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array",
                        property(lambda self: pytest.fail("decoded")))
    raw = dicom(8, 8, encapsulate([b"\0" * 64]), syntax)
    with pytest.raises(ImageInvalid, match="cannot be bounded"):
        open_image(raw)


def test_an_unregistered_transfer_syntax_is_refused_without_quoting_it(api):
    secret = b"1.2.840.99999.123456"       # the length of Explicit VR Little Endian's UID
    raw = dicom(8, 8, bytes(64)).replace(b"1.2.840.10008.1.2.1\x00", secret)
    body = assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422,
                        "(unregistered)")
    assert "99999" not in body["detail"]


# ------------------------------------------------------------------ 2. JPEG in DICOM
def test_jpeg_in_dicom_with_hundreds_of_scans_is_refused_before_decoding(monkeypatch):
    bomb = many_scans(jpeg(GREY, progressive=True), 300)
    # alone, the same JPEG is refused by the JPEG checks
    with pytest.raises(ImageInvalid, match="scans"):
        open_image(bomb)
    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array",
                        property(lambda self: pytest.fail("decoded")))
    with pytest.raises(ImageInvalid, match="progressive JPEG with [0-9]+ scans"):
        open_image(jpeg_in_dicom(bomb, 64, 64))


def test_jpeg_frame_larger_than_its_rows_and_columns_is_refused_before_decoding(
        monkeypatch):
    big = jpeg(Image.new("L", (3000, 2000), 90))          # small file, 6 M pixels
    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array",
                        property(lambda self: pytest.fail("decoded")))
    with pytest.raises(ImageInvalid, match="3000x2000 pixels, not the 64x64"):
        open_image(jpeg_in_dicom(big, 64, 64))


def test_jpeg_frame_over_the_pixel_limit_is_413_even_when_declared(api):
    big = jpeg(Image.new("L", (1200, 1000), 90))          # over 1,000,000 pixels
    assert_error(api.post("/answer", json={"image": b64(jpeg_in_dicom(big, 1000, 1200)),
                                           "question": Q}), 413, "pixels")


def test_two_frames_in_a_single_frame_dicom_are_refused():
    one = jpeg(GREY)
    raw = dicom(64, 64, encapsulate([one, one], has_bot=True), JPEGBaseline8Bit)
    with pytest.raises(ImageInvalid, match="more than one frame"):
        open_image(raw)


def test_a_small_jpeg_in_dicom_is_still_answered(api):
    img = open_image(jpeg_in_dicom(jpeg(GREY, quality=95), 64, 64))
    assert img.size == (64, 64)
    a = np.asarray(img.convert("L"), float)
    assert np.abs(a - np.asarray(GREY, float)).mean() < 8        # the picture, not noise
    red = jpeg(Image.new("RGB", (40, 32), (200, 0, 0)))
    colour = open_image(jpeg_in_dicom(red, 32, 40, "YBR_FULL_422"))
    assert all(abs(x - y) < 8 for x, y in zip(colour.getpixel((5, 5)), (200, 0, 0)))
    r = api.post("/answer", json={"image": b64(jpeg_in_dicom(jpeg(GREY), 64, 64)),
                                  "question": Q})
    assert r.status_code == 200, r.text


def test_a_jpeg_frame_decodes_to_bytes_not_through_float_copies(monkeypatch):
    """The frame that passed the checks is what Pillow decodes, to uint8: pydicom's path
    converted a 4096² YBR frame in float64 copies (+1.1 GB) for a 263 KB request."""
    photo = Image.merge("RGB", [GREY, GREY.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                                GREY.transpose(Image.Transpose.ROTATE_90)])
    data = jpeg(photo, quality=95)
    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array",
                        property(lambda self: pytest.fail("decoded through pydicom")))
    colour = open_image(jpeg_in_dicom(data, 64, 64, "YBR_FULL_422"))
    assert np.array_equal(np.asarray(colour), np.asarray(Image.open(io.BytesIO(data))))
    mono = open_image(jpeg_in_dicom(jpeg(GREY, quality=95), 64, 64))
    assert mono.size == (64, 64) and mono.mode == "RGB"


def test_native_dicom_is_still_answered(api):
    raw = dicom(64, 64, np.asarray(GREY).tobytes())
    assert np.asarray(open_image(raw).convert("L")).std() > 10
    assert api.post("/answer", json={"image": b64(raw), "question": Q}).status_code == 200


# ------------------------------------------------------------------ DICOM text
def test_photometric_interpretation_is_never_quoted(api):
    raw = dicom(8, 8, bytes(64)).replace(b"CS\x0c\x00MONOCHROME2 ", b"CS\x0c\x00DOE^JOHNXYZ ")
    body = assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422,
                        "photometric interpretation not supported")
    assert "DOE" not in body["detail"] and "JOHN" not in body["detail"]


def test_decoder_warnings_go_to_the_log_without_the_file_text(caplog, capfd):
    # an invalid UID in the file meta: pydicom warns and quotes it
    raw = dicom(8, 8, bytes(64)).replace(b"1.2.840.10008.1.2.1\x00",
                                         b"1.2.840.DOE^JOHN.1\x00\x00")
    logger = logging.getLogger("dualread.test_warnings")
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger=logger.name):
        log_warnings(logger)
        with pytest.raises(ImageInvalid):
            open_image(raw)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == logger.name]
    assert lines and lines[0]["event"] == "warning" and "pydicom" in lines[0]["source"]
    assert "message" not in lines[0]
    assert not any("JOHN" in r.getMessage() for r in caplog.records if r.name == logger.name)
    assert "JOHN" not in capfd.readouterr().err
    # pydicom logs the same text to its own logger: it reaches no handler of the process
    # (pytest's capture attaches itself to every non-propagating logger, so not checked
    # through caplog)
    assert logging.getLogger("pydicom").propagate is False


def test_warnings_from_one_place_are_logged_at_powers_of_two(caplog):
    logger = logging.getLogger("dualread.test_warnings_count")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(100):
            log_warning("text of the file", UserWarning, "/x/pydicom/valuerep.py", 7,
                        logger=logger)
        log_warning("a library's own words", DeprecationWarning, "/x/torch/nn.py", 3,
                    logger=logger)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == logger.name]
    assert [x["count"] for x in lines[:-1]] == [1, 2, 4, 8, 16, 32, 64]
    assert all("message" not in x for x in lines[:-1])
    assert lines[-1]["message"] == "a library's own words"


# ------------------------------------------------------------------ 3. oversized numbers
BIG = "9" * 4301


@pytest.mark.parametrize("path,body", [
    ("/answer", '{"image": "%s", "question": "q", "max_new_tokens": %s}'),
    ("/probe/counterfactual", '{"image": "%s", "question": "q", "max_new_tokens": %s}'),
    ("/probe/score", '{"image": "%s", "question": "q", "response": "r", '
                     '"mask": {"target": [0, %s]}}'),
    ("/feedback", '{"request_id": "%s", "correct": %s}'),
])
def test_a_number_over_the_int_digit_limit_is_422_on_every_route(api, path, body):
    r = api.post(path, content=body % (b64(png_bytes(random_image(0))), BIG),
                 headers={"content-type": "application/json"})
    assert_error(r, 422, "more than 4300 digits")


def test_the_digit_limit_is_exact_and_strings_are_not_numbers(api):
    # 4,300 digits parse: the route's own validation answers
    r = api.post("/feedback", content='{"request_id": "a", "correct": ' + BIG[:-1] + "}",
                 headers={"content-type": "application/json"})
    assert_error(r, 422, "correct")
    r = api.post("/feedback", content='{"request_id": "' + BIG + '", "correct": true}',
                 headers={"content-type": "application/json"})
    assert_error(r, 422, "request_id")


# ------------------------------------------------------------------ mutation gaps
def _chunks(n: int, size: int = 100):
    body = b'{"question": "' + b"x" * (n - 16) + b'"}'
    assert len(body) == n
    for i in range(0, n, size):
        yield body[i:i + size]


@pytest.mark.parametrize("kind", ["application/json", "multipart/form-data; boundary=b"])
def test_a_streamed_body_one_byte_over_the_limit_is_413(service, kind):
    """No Content-Length (chunked): the limit is counted as the body arrives."""
    with make(service, max_body_bytes=1024) as c:
        over = c.post("/answer", content=_chunks(1025), headers={"content-type": kind})
        assert "content-length" not in over.request.headers
        assert_error(over, 413, "over the limit of 1024 bytes")
        at = c.post("/answer", content=_chunks(1024), headers={"content-type": kind})
        assert at.status_code in (400, 422), at.text      # read whole, refused for its content


def test_base64_over_the_bound_is_refused_before_decoding(service, monkeypatch):
    import app.serving

    limit = 200_000
    bound = 266_668                           # 4 * ceil(limit / 3): `limit` bytes, padded
    decoded = []
    monkeypatch.setattr(app.serving.base64, "b64decode",
                        lambda *a, **k: decoded.append(1) or b"")
    with make(service, max_image_bytes=limit) as c:
        r = c.post("/answer", json={"image": "A" * (bound + 4), "question": Q})
        assert_error(r, 413, f"over the limit of {limit} bytes")
        assert not decoded
        r = c.post("/answer", json={"image": "A" * bound, "question": Q})
        assert decoded                        # at the bound: decoded (then judged)


def _feedback(api, known: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(api.get("/metrics").text):
        for s in fam.samples:
            if s.name == "dualread_feedback_total" and s.labels == {"known": known}:
                return s.value
    return 0.0


def test_feedback_total_counts_known_and_unknown_ids_apart(api):
    rid = api.post("/answer", json={"image": b64(png_bytes(random_image(3))),
                                    "question": Q}).json()["request_id"]
    before = _feedback(api, "true"), _feedback(api, "false")
    assert api.post("/feedback", json={"request_id": rid, "correct": True}).json()["accepted"]
    assert (_feedback(api, "true"), _feedback(api, "false")) == (before[0] + 1, before[1])
    api.post("/feedback", json={"request_id": "f" * 32, "correct": True})
    assert (_feedback(api, "true"), _feedback(api, "false")) == (before[0] + 1, before[1] + 1)


def test_prior_check_refuses_a_reader_whose_bce_is_nan():
    from heads.fit import WorseThanPrior, prior_check, refuse_worse_than_prior

    z = np.array([1, 0] * 20)
    splits = {"reader": np.arange(0, 20), "defer": np.arange(20, 40)}
    scores = {"psr": np.full(20, np.nan), "p_state": np.where(z[20:] == 1, 0.9, 0.1)}
    pc = prior_check(scores, z, splits)
    assert pc["worse"] == ["psr"]
    with pytest.raises(WorseThanPrior, match="psr"):
        refuse_worse_than_prior({"prior_check": pc})


def test_prior_rate_is_the_reader_splits_not_the_defer_splits():
    """The prior a reader must beat is what it could learn without features: the base rate
    of the data it was fitted on (the reader split), judged on the defer split."""
    from heads.fit import prior_check

    z = np.array([1] * 18 + [0] * 2 + [1] * 10 + [0] * 10)    # reader 0.9, defer 0.5
    splits = {"reader": np.arange(0, 20), "defer": np.arange(20, 40)}
    pc = prior_check({"psr": np.full(20, 0.5)}, z, splits)
    assert pc["prior_rate"] == pytest.approx(0.9)
    by_hand = -(0.5 * np.log(0.9) + 0.5 * np.log(0.1))       # rate 0.9 on a 0.5 split
    assert pc["prior_bce"] == pytest.approx(by_hand, abs=1e-5)
    assert pc["worse"] == []               # log 2 < by_hand: predicting 0.5 beats it


# ------------------------------------------------------------------ header limit
def test_serve_bounds_headers_with_h11_and_the_setting(monkeypatch):
    """`dualread serve` runs uvicorn's h11 parser with `max_header_bytes` as its bound
    (the live behaviour: tests/test_server.py)."""
    import uvicorn
    from typer.testing import CliRunner

    from app.cli import app as cli

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    monkeypatch.setenv("DUALREAD_MAX_HEADER_BYTES", "4096")
    res = CliRunner().invoke(cli, ["serve", "--port", "1"])
    assert res.exit_code == 0, res.output
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from app.http11 import JsonH11Protocol
    assert seen["http"] is JsonH11Protocol and issubclass(JsonH11Protocol, H11Protocol)
    assert seen["h11_max_incomplete_event_size"] == 4096 and seen["ws"] == "none"


def test_headers_over_the_bound_in_one_piece_are_431(service):
    """h11 bounds a header block that arrives in pieces; one that arrives whole passes its
    check, so the app measures the parsed headers again."""
    with make(service, max_header_bytes=2048) as c:
        assert c.get("/health/live", headers={"x-pad": "a" * 1500}).status_code == 200
        assert_error(c.get("/health/live", headers={"x-pad": "a" * 2100}), 431,
                     "headers over 2048 bytes")


def test_the_audit_log_is_written_as_json_lines():
    """Re-certification's audit events (heads.recert) must reach the log, not be dropped
    at the root logger's WARNING level."""
    import logging

    from app.logs import JsonLines
    from app.main import _json_logging

    _json_logging()
    audit = logging.getLogger("dualread.audit")
    assert audit.isEnabledFor(logging.INFO) and not audit.propagate
    assert any(isinstance(h.formatter, JsonLines) for h in audit.handlers)


@pytest.mark.parametrize("tag", ["NumberOfFrames", "PhotometricInterpretation"])
def test_a_dicom_number_over_the_int_digit_limit_is_422(api, tag):
    """pydicom converts an IS value as it reads it: 5,000 digits raised OverflowError (500)
    from the attribute lookup itself, before any check could catch it."""
    ds = pydicom.dcmread(io.BytesIO(dicom(64, 64, bytes(64 * 64))))
    ds.add_new(pydicom.datadict.tag_for_keyword(tag), "IS", "7777")
    raw = _write(ds)
    raw = raw.replace(b"IS\x04\x007777", b"IS" + (5000).to_bytes(2, "little") + b"9" * 5000)
    with pytest.raises(ImageInvalid, match=f"malformed DICOM tag {tag}"):
        open_image(raw)
    assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422,
                 f"malformed DICOM tag {tag}")
