"""Regression tests of the hardening issue: each hostile request from the attack report,
answered as documented (no 500s, no echo of request content, bounded work)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import io
import json
import logging
import re
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.errors import DeadlineExceeded
from app.main import create_app
from app.serving import AnswerItem
from app.settings import Settings
from app.text import plain_question
from models.actor import Answers, StageTimings
from models.images import (
    MAX_ASPECT_RATIO,
    MAX_DICOM_ITEMS,
    MAX_EXIF_BYTES,
    MAX_JPEG_GAP,
    MAX_JPEG_SCANS,
    MAX_JPEG_SEGMENTS,
    MAX_PNG_CHUNKS,
    ImageInvalid,
    ImageTooLarge,
    jpeg_layout,
    jpeg_scans,
    open_image,
)
from models.parse import parse_response
from models.quality import TRUNCATED, repeated_run, response_problem, uses_answer_tag
from tests.conftest import random_image
from tests.helpers import (
    assert_error,
    b64,
    png_bytes,
    small_limits_client,
    stub_answers,
)

Q = "what color is the shape?"
ROOT = Path(__file__).resolve().parent.parent
HEX32 = re.compile(r"^[0-9a-f]{32}$")


make = small_limits_client


IMG = b64(png_bytes(random_image(0)))
WIDE = b64(png_bytes(Image.new("RGB", (300, 1), (200, 10, 10))))


def metric(api, name: str, labels: dict | None = None) -> float:
    for fam in text_string_to_metric_families(api.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    return 0.0


# ------------------------------------------------------------------ 1. aspect ratio
def test_extreme_aspect_ratio_is_422_everywhere(api):
    assert_error(api.post("/answer", json={"image": WIDE, "question": Q}), 422, "aspect ratio")
    raw = png_bytes(Image.new("RGB", (1, 300)))
    assert_error(api.post("/answer", files={"file": ("x.png", raw, "image/png")},
                          data={"question": Q}), 422, "aspect ratio")
    r = api.post("/probe/counterfactual", json={"question": Q, "image": IMG,
                                                "counterfactual": WIDE})
    assert_error(r, 422, "counterfactual", "aspect ratio")


def test_aspect_ratio_bound_is_the_processors():
    ok = Image.new("RGB", (MAX_ASPECT_RATIO, 1))
    assert open_image(png_bytes(ok)).size == (MAX_ASPECT_RATIO, 1)
    with pytest.raises(ImageInvalid):
        open_image(png_bytes(Image.new("RGB", (MAX_ASPECT_RATIO + 1, 1))))


# ------------------------------------------------------------------ 2. reserved tokens
@pytest.mark.parametrize("marker", ["<|image_pad|>", "<|im_start|>", "<|vision_start|>"])
def test_reserved_token_in_question_is_422(api, marker):
    q = f"what color is {marker}?"
    assert_error(api.post("/answer", json={"image": IMG, "question": q}), 422, "reserved")
    assert_error(api.post("/answer", files={"file": ("x.png", png_bytes(random_image(0)))},
                          data={"question": q}), 422, "reserved")
    assert_error(api.post("/probe/counterfactual", json={
        "question": q, "image": IMG, "counterfactual": "blank"}), 422, "reserved")
    assert_error(api.post("/probe/score", json={"image": IMG, "question": q,
                                                "response": "<answer>red</answer>"}), 422)


def test_reserved_token_in_trajectory_is_422(api):
    bad = "<think>x<|image_pad|></think><answer>red</answer>"
    assert_error(api.post("/probe/score", json={"image": IMG, "question": Q, "response": bad}),
                 422, "response", "reserved")
    r = api.post("/probe/score_batch", json={"image": IMG, "question": Q, "trajectories": [
        {"response": "<answer>red</answer>"}, {"response": bad}]})
    assert_error(r, 422, "trajectories.1", "reserved")


# ------------------------------------------------------------------ 3. one bad item
def test_a_failing_item_fails_alone(service, monkeypatch):
    """The model raising on one item of a batch fails that request only (500 JSON)."""
    real = service.actor.answer

    def answer(images, questions, *a, **kw):
        if "poison" in " ".join(questions):
            raise RuntimeError("model fault")
        return real(images, questions, *a, **kw)

    monkeypatch.setattr(service.actor, "answer", answer)
    with make(service, max_batch_size=8, batch_wait_ms=300) as c:
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(c.post, "/answer", json={
                "image": IMG, "question": "poison?" if i == 3 else Q}) for i in range(8)]
            rs = [f.result() for f in futs]
        sizes = metric(c, "dualread_batch_size_sum"), metric(c, "dualread_batch_size_count")
    codes = [r.status_code for r in rs]
    assert codes == [200, 200, 200, 500, 200, 200, 200, 200], codes
    assert_error(rs[3], 500, "internal error")
    assert "model fault" not in rs[3].text
    assert sizes[0] > sizes[1]          # at least one real batch held several requests


# ------------------------------------------------------------------ 4. max_new_tokens
@pytest.mark.parametrize("value", ["-1", "0", "abc", "1025", "1.5"])
def test_multipart_max_new_tokens_bounds(api, value):
    r = api.post("/answer", files={"file": ("x.png", png_bytes(random_image(0)))},
                 data={"question": Q, "max_new_tokens": value})
    assert_error(r, 422, "max_new_tokens")


def _multipart_body(question: bytes) -> bytes:
    return (b'--xyz\r\nContent-Disposition: form-data; name="question"\r\n\r\n' + question
            + b'\r\n--xyz\r\nContent-Disposition: form-data; name="file"; filename="x.png"\r\n'
            b"Content-Type: image/png\r\n\r\n" + png_bytes(random_image(0))
            + b"\r\n--xyz--\r\n")


def test_a_multipart_question_that_is_not_utf8_is_refused(api):
    """Starlette reads a text part that is not valid UTF-8 as Latin-1, silently (and any
    text under a charset it does not know): the question would be answered as mojibake.
    422; the same text in UTF-8, or in Latin-1 when the body says so, is read."""
    latin1 = "what colour is the shape, café?".encode("latin-1")
    multipart = "multipart/form-data; boundary=xyz"
    r = api.post("/answer", content=_multipart_body(latin1), headers={"content-type": multipart})
    assert_error(r, 422, "'question'", "not valid utf-8")
    # a charset Starlette does not know it reads as Latin-1; others are slow or raise
    for charset in ("bogus", "utf8mb4", "", "punycode", "undefined", "idna", "utf-16",
                    "utf-8; charset=foo"):
        r = api.post("/answer", content=_multipart_body(Q.encode()),
                     headers={"content-type": f"{multipart}; charset={charset}"})
        assert_error(r, 422, "charset other than UTF-8")
    for body, extra in ((latin1.decode("latin-1").encode(), ""), (latin1, "; charset=latin-1")):
        r = api.post("/answer", content=_multipart_body(body),
                     headers={"content-type": multipart + extra})
        assert r.status_code == 200, r.text


def test_a_multipart_body_cut_before_its_closing_boundary_is_400(api):
    """Starlette keeps the parts read before the body stopped: a cut-off max_new_tokens
    part was dropped and the answer ran to the default limit."""
    whole = _multipart_body(Q.encode())
    r = api.post("/answer", content=whole[: -len(b"--\r\n")],
                 headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert_error(r, 400, "ends before its closing boundary")


def test_a_multipart_body_cut_inside_its_file_closes_that_file(api, monkeypatch):
    """The file part being written when the body stopped is not among the parts read, so
    closing the form does not close it."""
    made = _tracked_files(monkeypatch)
    whole = _multipart_body(Q.encode())
    cut = whole[: whole.index(b"IEND")]                  # inside the PNG
    r = api.post("/answer", content=cut,
                 headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert_error(r, 400, "ends before its closing boundary")
    assert len(made) == 1 and made[0].closed


def _tracked_files(monkeypatch) -> list:
    """Every upload file the form parser makes from now on."""
    import starlette.formparsers as fp

    made = []

    class Tracked(fp.SpooledTemporaryFile):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(fp, "SpooledTemporaryFile", Tracked)
    return made


def test_the_upload_is_closed_after_an_answer_and_after_a_refusal(api, monkeypatch):
    made = _tracked_files(monkeypatch)
    png = {"file": ("x.png", png_bytes(random_image(0)))}
    assert api.post("/answer", files=png, data={"question": Q}).status_code == 200
    assert_error(api.post("/answer", files=png, data={"question": Q, "max_new_tokens": "x"}),
                 422, "max_new_tokens")
    assert len(made) == 2 and all(f.closed for f in made)


@pytest.mark.parametrize("files, data, detail", [
    ({"file": ("x.png", b"a"), "file2": ("y.png", b"b")}, {"question": Q}, "Too many files"),
    ({"file": ("x.png", b"a")}, {"question": Q, "max_new_tokens": "4", "x": "1"},
     "Too many fields"),
    ({"file": ("x.png", b"a")}, {"question": "a" * (1024 * 1024 + 1)},
     "Part exceeded maximum size of 1024KB"),
])
def test_the_form_parser_s_limits_hold(api, files, data, detail):
    """One file, two fields, 1 MiB a text part: what `request.form(max_files=1,
    max_fields=2)` enforced, now that /answer builds its own parser."""
    assert detail in assert_error(api.post("/answer", files=files, data=data), 400)["detail"]


def test_a_long_or_odd_multipart_charset_is_refused_unread(api):
    """A Content-Type over 1,024 characters is not parsed (the parser walks it on the
    event loop, ~1 µs a byte); a charset that is not one of a few spellings is refused
    before `codecs.lookup`, which would keep every name it is asked for in its caches."""
    import encodings

    multipart = "multipart/form-data; boundary=xyz"
    r = api.post("/answer", content=_multipart_body(Q.encode()),
                 headers={"content-type": multipart + '; x="' + ";" * 2000 + '"'})
    assert_error(r, 400, "Content-Type header over 1024 characters")
    cached = len(encodings._cache)
    for name in ["q" * 41, "utf-8\u00e9", "a b", "utf!!8", "UTF_8_", "latin-1 "] + [
            f"x{i:039d}" for i in range(20)]:
        r = api.post("/answer", content=_multipart_body(Q.encode()),
                     headers={"content-type": f'{multipart}; charset="{name}"'.encode()})
        assert_error(r, 422, "charset other than UTF-8")
    assert len(encodings._cache) == cached
    for name in ("UTF-8", "utf8", "Latin1", "ISO-8859-1", "US-ASCII"):
        r = api.post("/answer", content=_multipart_body(Q.encode()),
                     headers={"content-type": f"{multipart}; charset={name}"})
        assert r.status_code == 200, (name, r.text)


@pytest.mark.parametrize("value", [" 8\u3000", "\u20028", "8\n", "8\r\n"])
def test_multipart_max_new_tokens_takes_ascii_blanks_only(api, value):
    r = api.post("/answer", files={"file": ("x.png", png_bytes(random_image(0)))},
                 data={"question": Q, "max_new_tokens": value})
    assert_error(r, 422, "max_new_tokens")
    r = api.post("/answer", files={"file": ("x.png", png_bytes(random_image(0)))},
                 data={"question": Q, "max_new_tokens": " 4\t"})
    assert r.status_code == 200, r.text


def test_other_multipart_text_parts_keep_their_own_errors(api):
    """Only the question is read as text: a part under a name of the client's that is not
    UTF-8 is an unexpected part (its name not repeated back), a file sent without a file
    name is a missing file."""
    odd = _multipart_body(b"what?").replace(b'name="question"', b'name="\xff<b>"')
    r = api.post("/answer", content=odd,
                 headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert "<b>" not in assert_error(r, 422, "unexpected parts")["detail"]
    plain_file = _multipart_body(Q.encode()).replace(b'; filename="x.png"', b"")
    r = api.post("/answer", content=plain_file,
                 headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert_error(r, 422, "needs a 'file' part")


def test_multipart_max_new_tokens_ok(api):
    r = api.post("/answer", files={"file": ("x.png", png_bytes(random_image(0)))},
                 data={"question": Q, "max_new_tokens": "4"})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ 5, 7. DICOM
def _dicom(rows, cols, photometric="MONOCHROME2", bits=16, frames=None, pixels=None,
           rle=False, extra=()) -> bytes:
    import pydicom
    from pydicom.dataelem import DataElement
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.encaps import encapsulate
    from pydicom.uid import ExplicitVRLittleEndian, RLELossless, generate_uid

    meta = FileMetaDataset()
    meta.TransferSyntaxUID = RLELossless if rle else ExplicitVRLittleEndian
    meta.MediaStorageSOPClassUID = generate_uid()
    meta.MediaStorageSOPInstanceUID = generate_uid()
    ds = FileDataset("x.dcm", {}, file_meta=meta, preamble=b"\0" * 128)
    spp = 3 if photometric == "RGB" else 1
    ds.Rows, ds.Columns, ds.BitsAllocated, ds.BitsStored = rows, cols, bits, bits
    ds.HighBit, ds.SamplesPerPixel, ds.PhotometricInterpretation = bits - 1, spp, photometric
    ds.PixelRepresentation = 0
    if spp == 3:
        ds.PlanarConfiguration = 0
    if frames:
        ds.NumberOfFrames = frames
    if rle:
        ds.PixelData = encapsulate([b"\0" * 64])
        ds["PixelData"].VR = "OB"
    else:
        ds.PixelData = pixels.tobytes()
    for tag, vr, value in extra:
        ds.add(DataElement(tag, vr, value))
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


MONO = (np.arange(32 * 32).reshape(32, 32) * 3).astype(np.uint16)


@pytest.mark.parametrize("value", ["abc", "nan", "inf"])
def test_dicom_malformed_tag_is_422(api, value):
    # nan/inf parse as floats but would turn the image into a constant one.
    raw = _dicom(32, 32, pixels=MONO, extra=[(0x00281053, "LO", value)])   # RescaleSlope
    assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422,
                 "RescaleSlope")


def test_dicom_multiframe_is_refused_and_colour_accepted(api):
    two = _dicom(32, 32, "RGB", 8, frames=2, pixels=np.zeros((2, 32, 32, 3), np.uint8))
    assert_error(api.post("/answer", json={"image": b64(two), "question": Q}), 422,
                 "multi-frame")
    rgb = np.zeros((32, 40, 3), np.uint8)
    rgb[..., 0] = 200
    one = _dicom(32, 40, "RGB", 8, pixels=rgb)
    assert open_image(one).getpixel((5, 5)) == (200, 0, 0)   # colour kept, not windowed
    assert api.post("/answer", json={"image": b64(one), "question": Q}).status_code == 200


def test_dicom_pixel_limit_before_decoding(api):
    # The header claims 16000x16000; the RLE payload is garbage. Decoding would fail with
    # 422, so a 413 shows the limit was checked first.
    raw = _dicom(16000, 16000, rle=True)
    with pytest.raises(ImageTooLarge):
        open_image(raw, 40_000_000)
    assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 413, "pixels")
    frames = _dicom(600, 600, frames=4, rle=True)
    assert_error(api.post("/answer", json={"image": b64(frames), "question": Q}), 413,
                 "frames")   # 4 x 600 x 600 > 1M: frames count towards the limit


def test_at_most_max_decodes_images_are_decoded_at_once(monkeypatch):
    """Decoding happens before a job is queued (the queue limit does not bound it): a
    semaphore does. Six uploads, two slots: never more than two decodes in flight."""
    import app.serving as serving_module
    from app.serving import Serving

    live, peak, lock = [0], [0], threading.Lock()

    def slow_open(raw, max_pixels):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return Image.new("RGB", (4, 4))

    monkeypatch.setattr(serving_module, "open_image", slow_open)
    srv = Serving(Settings(max_decodes=2))

    async def main():
        return await asyncio.gather(*(srv.image(b"x") for _ in range(6)))

    assert len(asyncio.run(main())) == 6
    assert peak[0] == 2


def test_waiting_for_a_decode_slot_counts_against_the_deadline(monkeypatch):
    import app.serving as serving_module
    from app.serving import Serving

    def slow_open(raw, max_pixels):
        time.sleep(0.3)
        return Image.new("RGB", (4, 4))

    monkeypatch.setattr(serving_module, "open_image", slow_open)
    srv = Serving(Settings(max_decodes=1, request_timeout_s=0.05))

    async def main():
        return await asyncio.gather(srv.image(b"a"), srv.image(b"b"), return_exceptions=True)

    first, second = asyncio.run(main())
    assert isinstance(first, Image.Image)                  # a started decode finishes
    assert isinstance(second, DeadlineExceeded) and "waiting to be decoded" in str(second)
    assert srv.decode_slots._value == 1                    # the slot came back


def test_a_request_past_its_deadline_is_not_decoded_even_with_a_free_slot(monkeypatch):
    """A slow upload can use up the deadline before the image is reached: then no decode
    starts (it can take seconds for a large PNG), whether or not a slot is free."""
    import app.serving as serving_module
    from app.serving import Serving

    decoded = []
    monkeypatch.setattr(serving_module, "open_image",
                        lambda raw, px: decoded.append(raw) or Image.new("RGB", (4, 4)))
    srv = Serving(Settings(max_decodes=2, request_timeout_s=0.05))

    async def late():
        serving_module._REQUEST.set((time.monotonic() - 0.01, None))   # deadline passed
        return await srv.image(b"x")

    with pytest.raises(DeadlineExceeded, match="waiting to be decoded"):
        asyncio.run(late())
    assert decoded == [] and srv.decode_slots._value == 2


class _Request:
    """What `Serving.admit` reads of a request."""

    def __init__(self, gone: bool = False) -> None:
        self.scope = {"state": {}}
        self.gone = gone

    async def is_disconnected(self) -> bool:
        return self.gone


def test_one_deadline_per_request_from_admission(monkeypatch):
    """Decoding and waiting for a slot count against the request's deadline, and a client
    that has gone is not decoded for."""
    import app.serving as serving_module
    from app.errors import ClientGone
    from app.serving import Serving

    decoded = []
    monkeypatch.setattr(serving_module, "open_image",
                        lambda raw, px: decoded.append(raw) or Image.new("RGB", (4, 4)))
    srv = Serving(Settings(request_timeout_s=30))
    srv.backend, srv.batcher = object(), object()          # "ready"

    async def request(gone: bool):
        srv.admit(_Request(gone))
        admitted = srv._deadline()
        await asyncio.sleep(0.05)
        assert srv._deadline() == admitted                 # not reset by later steps
        return await srv.image(b"x")

    assert isinstance(asyncio.run(request(False)), Image.Image)
    with pytest.raises(ClientGone):
        asyncio.run(request(True))
    assert decoded == [b"x"]                               # the gone client's was skipped
    # each request's context is its own: nothing outside them sees one
    assert serving_module._REQUEST.get() == (None, None)

    async def two():
        async def one(delay):
            await asyncio.sleep(delay)
            srv.admit(_Request())
            await asyncio.sleep(0.15)
            return srv._deadline()
        return await asyncio.gather(one(0.0), one(0.1))

    first, second = asyncio.run(two())
    assert 0.05 < second - first < 0.2                     # not one shared deadline


def test_a_cancelled_decode_keeps_its_slot_until_the_thread_ends(monkeypatch):
    """Ray Serve cancels a request's task when its client disconnects; the decode thread
    runs on, so its slot must too, or --max-decodes could be exceeded."""
    import app.serving as serving_module
    from app.serving import Serving

    done = threading.Event()

    def slow_open(raw, max_pixels):
        time.sleep(0.3)
        done.set()
        return Image.new("RGB", (4, 4))

    monkeypatch.setattr(serving_module, "open_image", slow_open)
    srv = Serving(Settings(max_decodes=1))

    async def main():
        task = asyncio.create_task(srv.image(b"x"))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.05)
        held = srv.decode_slots._value                     # the thread still decodes
        while not done.is_set():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        return held, srv.decode_slots._value

    assert asyncio.run(main()) == (0, 1)


def test_the_default_pixel_limit_is_what_a_processor_keeps():
    assert Settings().max_image_pixels == 4096 * 4096


# ------------------------------------------------------------------ 6. token budgets
def test_huge_trajectory_is_refused_before_queueing(api):
    before = metric(api, "dualread_batch_size_count")
    emoji = "\U0001F600" * 20000
    r = api.post("/probe/score", json={"image": IMG, "question": Q, "response": emoji})
    assert_error(r, 422, "tokens, over the limit")
    r = api.post("/probe/score_batch", json={"image": IMG, "question": Q, "trajectories": [
        {"response": "<answer>red</answer>"}, {"response": emoji}]})
    assert_error(r, 422, "trajectories.1")
    assert metric(api, "dualread_batch_size_count") == before     # nothing reached the model


def test_trajectory_budget_counts_its_own_tokens_only(service):
    """A trajectory of exactly the limit passes (the cue appended for scoring is not
    counted against it); one token more does not."""
    from app.errors import TrajectoryInvalid

    text = "<think>I see a red circle.</think><answer>" + "red " * 10 + "</answer>"
    n = service.actor.count_tokens(text)
    assert service.check_response(text, n) == service.actor.score_text(text)
    with pytest.raises(TrajectoryInvalid):
        service.check_response(text, n - 1)


def test_question_token_budget(service):
    with make(service, max_question_tokens=5) as c:
        r = c.post("/answer", json={"image": IMG, "question": "red " * 40})
        assert_error(r, 422, "tokens")


def test_token_check_messages_are_exact(service):
    """Questions and trajectories share one token check; each keeps its own wording."""
    from app.errors import QuestionInvalid, TrajectoryInvalid

    cases = [
        (lambda: service.check_question("is <|image_pad|> red?", 500, 100), QuestionInvalid,
         r"question contains reserved token\(s\) <\|image_pad\|>"),
        (lambda: service.check_question("red " * 40, 500, 5), QuestionInvalid,
         r"question is (\d+) tokens, over the limit of 5"),
        (lambda: service.check_response("<answer><|im_start|></answer>", 100),
         TrajectoryInvalid, r"contains reserved token\(s\) <\|im_start\|>"),
        (lambda: service.check_response("<answer>" + "red " * 40 + "</answer>", 5),
         TrajectoryInvalid, r"(\d+) tokens, over the limit of 5"),
    ]
    for call, error, pattern in cases:
        with pytest.raises(error) as e:
            call()
        m = re.fullmatch(pattern, e.value.detail)
        assert m, (pattern, e.value.detail)
        if m.groups():
            assert int(m.group(1)) >= 40       # 40 words cannot fit in fewer tokens


# ------------------------------------------------------------------ 8. deadlines
def test_deadline_stops_decoding(qwen3):
    img = random_image(4)
    free = qwen3.answer([img], [Q], max_new_tokens=24, readout="none")
    assert len(free[0].token_ids) > 1        # precondition: it would decode on
    cut = qwen3.answer([img, img], [Q, Q], max_new_tokens=24, readout="none",
                       deadlines=[time.monotonic() - 1, time.monotonic() + 3600])
    assert len(cut[0].token_ids) == 1        # stopped after the first step
    assert cut[1].token_ids == free[0].token_ids   # the other row went on untouched
    assert isinstance(cut, Answers) and isinstance(cut.timings, StageTimings)


def test_expired_item_is_a_deadline_error(service):
    img = random_image(5)
    out = service.answer_batch([AnswerItem(img, Q, 8), AnswerItem(img, Q, 8)],
                               [time.monotonic() - 1, time.monotonic() + 3600])
    assert isinstance(out[0], DeadlineExceeded)
    assert out[1].answer is not None and 0 <= out[1].confidence.dualread <= 1


# ------------------------------------------------------------------ 9. feedback off the loop
def test_feedback_does_not_recompute_statistics(service, monkeypatch):
    with make(service) as c:
        monitor = c.app.state.hooks.monitor
        calls = []
        real = monitor.stats
        monkeypatch.setattr(monitor, "stats", lambda: calls.append(1) or real())
        names = {f.name for f in text_string_to_metric_families(c.get("/metrics").text)}
        assert "dualread_feedback_ece" not in names       # absent, not 0, before feedback
        ids = [c.post("/answer", json={"image": b64(png_bytes(random_image(30 + i))),
                                       "question": Q}).json()["request_id"] for i in range(4)]
        n0 = len(calls)
        for i, rid in enumerate(ids):
            assert c.post("/feedback", json={"request_id": rid, "correct": i < 2}).json()[
                "accepted"]
        assert len(calls) == n0                           # feedback did no window maths
        text = c.get("/metrics").text
        c.get("/metrics")
        assert len(calls) == n0 + 1                       # once per change, at scrape
    fams = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
            if f.samples}     # declared families may have no sample yet (dualread_drift)
    assert fams["dualread_feedback_window"] == 4


# ------------------------------------------------------------------ 10. body size
def test_oversized_body_is_413(service):
    with make(service, max_body_bytes=4096) as c:
        r = c.post("/answer", content=b"x" * 10_000, headers={"content-type": "application/json"})
        assert_error(r, 413, "body over the limit")


def test_routes_of_a_few_fields_take_a_small_body_only(api):
    """/feedback and the operator routes hold a request id and a verdict, or a rule
    version: their bodies are bounded at 16 KiB, sent whole or in chunks without a length."""
    from app.middleware import SMALL_BODY_BYTES

    headers = {"content-type": "application/json"}
    pad = b" " * SMALL_BODY_BYTES
    body = b'{"request_id": "x", "correct": true}' + pad
    assert_error(api.post("/feedback", content=body, headers=headers), 413,
                 f"body over the limit of {SMALL_BODY_BYTES} bytes")

    def chunks():
        yield body[:100]
        yield body[100:]
    assert_error(api.post("/feedback", content=chunks(), headers=headers), 413,
                 f"body over the limit of {SMALL_BODY_BYTES} bytes")
    # the same body within the bound is read (an unknown id: accepted is false)
    r = api.post("/feedback", content=body[:SMALL_BODY_BYTES], headers=headers)
    assert r.status_code == 200 and r.json()["accepted"] is False
    # other routes keep the service's body limit
    r = api.post("/probe/score", content=b'{"question": "q"}' + pad, headers=headers)
    assert r.status_code == 422, r.text


# ------------------------------------------------------------------ 11. no echo in 422s
QUESTION_MARK = "patient 4711 left breast"


@pytest.mark.parametrize("path, body", [
    ("/probe/counterfactual", {"question": QUESTION_MARK, "image": IMG}),
    ("/probe/score", {"question": QUESTION_MARK, "image": IMG}),
    ("/probe/score", {"question": QUESTION_MARK, "image": IMG, "response": 5}),
    ("/probe/score_batch", {"question": QUESTION_MARK, "image": IMG, "trajectories": []}),
    ("/feedback", {"request_id": QUESTION_MARK}),
    ("/feedback", {"request_id": QUESTION_MARK, "correct": "perhaps"}),
    ("/answer", {"question": QUESTION_MARK, "image": 5}),
])
def test_validation_errors_never_echo_the_request(api, path, body):
    r = api.post(path, json=body)
    b = assert_error(r, 422)
    assert IMG[:40] not in r.text and QUESTION_MARK not in r.text and "perhaps" not in r.text
    assert "input" not in b


def test_an_unknown_content_part_type_is_never_echoed(api):
    """pydantic's message for a discriminated union quotes the tag sent ("Input tag
    'patient ...' found using 'type' ..."): the OpenAI route's content parts are one."""
    r = api.post("/v1/chat/completions", json={"model": "dualread", "messages": [
        {"role": "user", "content": [{"type": QUESTION_MARK, "text": Q}]}]})
    assert r.status_code == 422 and r.headers["x-request-id"]
    message = r.json()["error"]["message"]
    assert QUESTION_MARK not in r.text
    assert message == "messages[0].content[0].type: must be 'text' or 'image_url'", message


@pytest.mark.parametrize("key", ["MRN 1234567", "Jane_Doe_MRN1234567"])
def test_unknown_field_name_is_never_echoed(api, key):
    r = api.post("/answer", json={"image": IMG, "question": Q, key: "x"})
    b = assert_error(r, 422, "unexpected field")
    assert "1234567" not in b["detail"]


def test_reference_answers_are_bounded(api):
    # Grading runs on the event loop: a 15 MB reference used to stall it for seconds.
    r = api.post("/probe/counterfactual", json={
        "image": IMG, "question": Q, "counterfactual": "blank",
        "reference_answer": "a " * 1000})
    assert_error(r, 422, "reference_answer")


# ------------------------------------------------------------------ 12. request ids
def test_request_ids_are_server_generated(api, caplog):
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    log = logging.getLogger("dualread.access")
    log.addHandler(handler)
    try:
        huge = "a" * 10_000          # under the header bound, far over an id's 64
        r = api.post("/answer", json={"image": IMG, "question": Q}, headers={"x-request-id": huge})
        assert r.status_code == 200
        assert HEX32.match(r.headers["x-request-id"]) and r.json()["request_id"] == \
            r.headers["x-request-id"]
        assert "x-correlation-id" not in r.headers          # too long: dropped, not echoed
        mrn = "MRN-0012345"
        a = api.post("/answer", json={"image": IMG, "question": Q}, headers={"x-request-id": mrn})
        b = api.post("/answer", json={"image": IMG, "question": Q}, headers={"x-request-id": mrn})
    finally:
        log.removeHandler(handler)
    assert a.headers["x-correlation-id"] == mrn == b.headers["x-correlation-id"]
    ra, rb = a.json()["request_id"], b.json()["request_id"]
    assert ra != rb and mrn not in (ra, rb)
    # feedback keys are the server's ids: a reused client id cannot overwrite anything
    assert not api.post("/feedback", json={"request_id": mrn, "correct": True}).json()["accepted"]
    assert api.post("/feedback", json={"request_id": ra, "correct": True}).json()["accepted"]
    assert api.post("/feedback", json={"request_id": rb, "correct": False}).json()["accepted"]
    assert seen and not any(mrn in line or huge[:100] in line for line in seen)


# ------------------------------------------------------------------ 13. garbled responses
def test_response_problems_by_hand():
    tagged = parse_response("<think>a red circle</think><answer>red</answer><confidence>9"
                            "</confidence>")
    plain = parse_response("red")
    empty = parse_response("<think>x</think><answer> </answer>")
    assert response_problem(tagged, [1, 2, 3, 4], True, True) is None
    assert response_problem(plain, [1], True, True) == "no answer tag"
    assert response_problem(plain, [1], True, False) is None        # card says plain
    assert response_problem(empty, [1, 2], True, True) == "empty answer"
    assert response_problem(tagged, [7, 8, 7, 8, 7, 8, 7, 8], True, True) == \
        "degenerate repetition"
    assert response_problem(tagged, [1, 2, 3], False, True).startswith("truncated")
    # cut off before the answer: the budget is the reason, not the missing tag; a loop that
    # ate the budget is still a loop
    assert response_problem(parse_response("<think>a red"), [1, 2, 3], False, True) == \
        response_problem(plain, [1], False, True) == TRUNCATED
    assert response_problem(parse_response("<think>x</think><answer>"), [1], False, True) \
        == TRUNCATED
    assert response_problem(empty, [1, 2], False, True) == "empty answer"   # it closed empty
    assert response_problem(plain, [5, 5, 5, 5], False, True) == "degenerate repetition"
    assert response_problem(plain, [1], False, False) == TRUNCATED
    assert repeated_run([5, 5, 5, 5]) and not repeated_run([5, 5, 5, 6])
    assert repeated_run([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3])
    assert not repeated_run([1, 2, 3, 1, 2, 3, 1, 2, 3, 4])
    assert uses_answer_tag("<think>{o}</think><answer>{a}</answer>")
    assert not uses_answer_tag(None) and not uses_answer_tag("{answer}")


def test_unparseable_response_is_deferred_with_reason(service, monkeypatch):
    monkeypatch.setattr(service, "needs_tag", True)
    monkeypatch.setattr(service.heads, "policy",
                        dataclasses.replace(service.heads.policy, tau=0.0))   # trust anything
    stub_answers(monkeypatch, service, ["red red blue", "<think>a</think><answer>red</answer>"])
    with make(service) as c:
        r = c.post("/answer", json={"image": IMG, "question": Q})
    body = r.json()
    assert body["defer"] is True and body["defer_reason"] == "no answer tag"
    assert body["confidence"]["dualread"] >= body["defer_threshold"]   # confidence alone: keep


def test_a_response_cut_off_before_its_answer_says_truncated(service, monkeypatch):
    """With a small max_new_tokens the response stops inside its reasoning: the reason
    names the budget (which the caller can raise), not a missing tag."""
    monkeypatch.setattr(service, "needs_tag", True)
    stub_answers(monkeypatch, service, ["<think>a red circle on a"], finished=False)
    with make(service) as c:
        body = c.post("/answer", json={"image": IMG, "question": Q, "max_new_tokens": 5}).json()
    assert body["defer"] is True and body["defer_reason"] == TRUNCATED


# ------------------------------------------------------------------ 14. docs, auth, metrics
def test_docs_need_the_key_and_use_local_assets(service):
    with make(service, api_key="s3cret", metrics_require_key=True) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
            assert_error(c.get(path), 401)
        auth = {"Authorization": "Bearer s3cret"}
        spec = c.get("/openapi.json", headers=auth).json()
        assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
        assert {"HTTPBearer": []} in spec["paths"]["/answer"]["post"]["security"]
        assert "/probe/score_batch" in spec["paths"]
        for page in ("/docs", "/redoc"):
            html = c.get(page, headers=auth).text
            assert "http://" not in html and "https://" not in html.replace(
                "https://fastapi", "")      # no CDN: every asset URL is local
        assert c.get("/docs/assets/swagger-ui-bundle.js").status_code == 200
        assert c.get("/docs/assets/redoc.standalone.js").status_code == 200
        assert c.get("/docs/assets/../settings.py").status_code == 404
        assert c.get("/metrics", headers=auth).status_code == 200
        assert c.get("/health/live").status_code == 200
        text = c.get("/metrics", headers=auth).text
    assert 'dualread_requests_total{route="/docs",status="401"}' in text   # not "unmatched"


def test_docs_open_without_a_key(api):
    assert api.get("/docs").status_code == 200 and api.get("/openapi.json").status_code == 200


# ------------------------------------------------------------------ 15. formats and bodies
@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "TIFF", "BMP"])
def test_other_formats_are_refused_with_the_policy(api, fmt):
    raw = png_bytes(random_image(1), fmt)
    assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422,
                 "PNG, JPEG or DICOM")


def test_extra_fields_and_content_types(api):
    b = assert_error(api.post("/answer", json={"image": IMG, "question": Q, "foo": 1}), 422,
                     "body: unexpected field")
    assert "foo" not in b["detail"]
    assert_error(api.post("/probe/score", json={"image": IMG, "question": Q,
                                                "response": "x", "mask": {"bogus": 1}}),
                 422, "unexpected field")
    for path in ("/answer", "/probe/score", "/probe/counterfactual", "/feedback",
                 "/probe/score_batch"):
        r = api.post(path, content=b'{"request_id": "x", "correct": true}')
        assert_error(r, 415)
        r = api.post(path, content=b"{}", headers={"content-type": "text/plain"})
        assert_error(r, 415)
    files = {"file": ("x.png", png_bytes(random_image(0)))}
    assert_error(api.post("/answer", files=files, data={"question": Q, "extra": "1"}), 422,
                 "unexpected")


@pytest.mark.parametrize("content_type, body, detail", [
    ("multipart/form-data", b"question=x", "Missing boundary in multipart."),
    ("multipart/form-data; boundary=abc",
     b'--zzz\r\nContent-Disposition: form-data; name="question"\r\n\r\nx\r\n--zzz--\r\n',
     "Invalid multipart data."),
    ("multipart/form-data; boundary=abc", b"--abc\r\nnot a header\r\n\r\nx\r\n--abc--\r\n",
     "Invalid multipart data."),
])
def test_malformed_multipart_is_400(api, content_type, body, detail):
    """A multipart body the parser cannot read: 400 in the one error shape, before any
    field is looked at (so not the 422 of a readable body that lacks its `file` part)."""
    r = api.post("/answer", content=body, headers={"content-type": content_type})
    assert assert_error(r, 400)["detail"] == detail


def test_unknown_route_and_method_are_json(api):
    assert_error(api.get("/nope"), 404)
    assert_error(api.get("/answer"), 405)


# ------------------------------------------------------------------ score_batch contract
def test_score_batch_matches_single_scores(api):
    t1 = "<think>I see a red circle.</think><answer>red</answer>"
    t2 = "<think>I see a blue square.</think><answer>blue</answer>"
    mask = {"target": "think", "ratio": 1.0, "seed": 0}
    singles = [api.post("/probe/score", json={"image": IMG, "question": Q, "response": t,
                                              "mask": m}).json()
               for t, m in [(t1, None), (t2, None), (t1, mask)]]
    r = api.post("/probe/score_batch", json={"image": IMG, "question": Q, "trajectories": [
        {"response": t1}, {"response": t2}, {"response": t1, "mask": mask}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"results", "request_id"} and len(body["results"]) == 3
    for got, want in zip(body["results"], singles):
        assert got["answer"] == want["answer"] and got["masked_tokens"] == want["masked_tokens"]
        for k in ("dualread", "psr", "per", "verbalized"):
            assert got["confidence"][k] == pytest.approx(want["confidence"][k], abs=1e-4)
    assert [x["answer"] for x in body["results"]] == ["red", "blue", "red"]
    assert body["results"][0]["masked_tokens"] == 0 < body["results"][2]["masked_tokens"]


def test_score_batch_bounds(api):
    t = {"response": "<answer>red</answer>"}
    assert_error(api.post("/probe/score_batch", json={"image": IMG, "question": Q,
                                                      "trajectories": [t] * 65}), 422)
    # a span past the response is cut at its end, as a slice is (docs/api.md)
    long_span = {"response": "<answer>red</answer>", "mask": {"target": [3, 999]}}
    cut = {"response": "<answer>red</answer>", "mask": {"target": [3, 20]}}
    r = api.post("/probe/score_batch", json={"image": IMG, "question": Q,
                                             "trajectories": [t, long_span, cut]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert results[1] == results[2] and results[1]["masked_tokens"] > 0


# ------------------------------------------------------------------ newcomer friction
def test_sample_image_is_in_the_repo():
    img = open_image((ROOT / "docs" / "sample.png").read_bytes())
    assert img.size == (64, 64)


def test_serve_help_shows_defaults():
    from typer.testing import CliRunner

    from app.cli import app

    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    flat = " ".join(out.split())
    for needle in ("8000", "127.0.0.1", "64", "30", "max-response-tokens"):
        assert needle in flat, needle


# ------------------------------------------------------------------ second hostile round
def test_json_bounds_by_hand():
    from app.middleware import json_problem

    def obj(n: int) -> bytes:
        return json.dumps({f"k{i}": 1 for i in range(n)}).encode()

    def nest(n: int) -> bytes:
        return b"[" * n + b"]" * n

    assert json_problem(obj(32)) is None
    assert "more than 32 fields" in json_problem(obj(33))
    assert json_problem(json.dumps({"a": [0] * 256}).encode()) is None
    assert "more than 256 items" in json_problem(json.dumps({"a": [0] * 257}).encode())
    assert json_problem(nest(16)) is None
    assert "deeper than 16" in json_problem(nest(17))
    assert "deeper than 16" in json_problem(nest(100_000))
    assert json_problem(b'{"x": ') is None                    # left to the route's parser
    # keys, colons, commas and escaped quotes inside strings are text, not structure
    text = 'k":1,"k2":[1,2],' * 1000
    assert json_problem(json.dumps({"a": text, "b": [text] * 3}).encode()) is None
    assert "more than 32 fields" in json_problem(
        json.dumps({"a": text, **{f"k{i}": text for i in range(32)}}).encode())
    # an unclosed string full of escaped quotes is invalid JSON, left to the parser; the
    # old backtracking pattern rescanned it from every quote (minutes for this body)
    assert json_problem(b'{"a":"' + b'\\"' * 200_000) is None
    assert json_problem(b'{"a":"x\\') is None
    # UTF-16/32 carry NULs; json.loads would decode them behind this byte-level scan
    utf16 = json.dumps({"\u2022": 1, **{f"k{i}": 1 for i in range(100)}},
                       ensure_ascii=False).encode("utf-16-le")
    assert "UTF-8" in json_problem(utf16)
    # the largest legal body: 64 masked trajectories
    t = {"response": "r", "mask": {"target": [0, 1], "ratio": 1.0, "seed": 0}}
    assert json_problem(json.dumps({"image": "x", "question": "q",
                                    "trajectories": [t] * 64}).encode()) is None


def test_many_json_keys_are_422_and_do_not_block_the_loop(service, monkeypatch):
    """The pre-check runs off the event loop: /health/live is answered while it is held."""
    import app.middleware as mw

    real, started, live_done, waited = mw.json_problem, threading.Event(), threading.Event(), []

    def held(body: bytes) -> str | None:
        started.set()
        waited.append(live_done.wait(60))   # False only if /health/live never came back
        return real(body)

    monkeypatch.setattr(mw, "json_problem", held)
    body = b"{" + b",".join(b'"k%d":1' % i for i in range(200_000)) + b"}"
    with make(service) as c, cf.ThreadPoolExecutor(1) as pool:
        # a route with the service's body limit (/feedback takes 16 KiB at most)
        fut = pool.submit(c.post, "/probe/score", content=body,
                          headers={"content-type": "application/json"})
        assert started.wait(60)
        assert c.get("/health/live").status_code == 200
        live_done.set()
        r = fut.result()
    b = assert_error(r, 422, "more than 32 fields")
    assert waited == [True] and "k1" not in b["detail"]


def test_refusals_before_routing_are_labelled_precheck(api):
    """A flood of pre-check refusals shows in the metrics apart from unknown paths."""
    body = b"{" + b",".join(b'"k%d":1' % i for i in range(40)) + b"}"
    assert api.post("/feedback", content=body,
                    headers={"content-type": "application/json"}).status_code == 422
    assert api.get("/no/such/path").status_code == 404
    text = api.get("/metrics").text
    assert 'dualread_requests_total{route="precheck",status="422"}' in text
    assert 'dualread_requests_total{route="unmatched",status="404"}' in text


def _exif_orientation(img: Image.Image, fmt: str, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, format=fmt, exif=exif.tobytes())
    return buf.getvalue()


def test_exif_orientation_is_applied():
    upright = random_image(3, 24, 40)                 # 40 wide, 24 high
    # Orientation 6: the stored pixels must turn 90° clockwise to be upright, so store the
    # upright image turned 90° counter-clockwise.
    stored = upright.transpose(Image.Transpose.ROTATE_90)
    png = open_image(_exif_orientation(stored, "PNG"))
    assert png.size == (40, 24)
    assert np.array_equal(np.asarray(png), np.asarray(upright))
    jpeg_bytes = _exif_orientation(stored, "JPEG")
    raw = Image.open(io.BytesIO(jpeg_bytes)).convert("RGB")     # decoded, not turned
    assert raw.size == (24, 40)
    want = raw.transpose(Image.Transpose.ROTATE_270)            # 90° clockwise
    assert np.array_equal(np.asarray(open_image(jpeg_bytes)), np.asarray(want))


def test_every_exif_orientation_turns_as_pillow_turns_it():
    from PIL import ImageOps
    stored = random_image(4, 24, 40)
    for orientation in range(1, 9):
        png = _exif_orientation(stored, "PNG", orientation)
        want = ImageOps.exif_transpose(Image.open(io.BytesIO(png))).convert("RGB")
        assert np.array_equal(np.asarray(open_image(png)), np.asarray(want)), orientation


def test_a_large_exif_block_is_refused():
    """Pillow's own turn rebuilds the EXIF block in Python: 60,000 tags took 20 s."""
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010E] = "x" * MAX_EXIF_BYTES                         # ImageDescription
    buf = io.BytesIO()
    random_image(5, 16, 16).save(buf, "PNG", exif=exif.tobytes())
    with pytest.raises(ImageInvalid, match=f"EXIF block over {MAX_EXIF_BYTES} bytes"):
        open_image(buf.getvalue())


def test_a_png_of_many_chunks_is_refused_before_pil(monkeypatch):
    png = png_bytes(random_image(6, 16, 16))
    chunk = (0).to_bytes(4, "big") + b"prVt" + zlib.crc32(b"prVt").to_bytes(4, "big")
    ihdr_end = 8 + 25                                           # signature, IHDR chunk
    many = png[:ihdr_end] + chunk * MAX_PNG_CHUNKS + png[ihdr_end:]
    assert open_image(png[:ihdr_end] + chunk * 100 + png[ihdr_end:]).size == (16, 16)
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("PIL was asked"))
    with pytest.raises(ImageInvalid, match=f"over {MAX_PNG_CHUNKS} chunks"):
        open_image(many)


@pytest.mark.parametrize("extra, tag", [
    ([(0x00281053, "LO", "1e308")], "RescaleSlope"),                   # × 3069 overflows
    ([(0x00281052, "LO", "-1.7e308"), (0x00281053, "LO", "-1e304")], "RescaleIntercept"),
    ([(0x00281050, "LO", "1.5e308"), (0x00281051, "LO", "1e308")], "WindowCenter"),
])
def test_dicom_tags_that_overflow_once_applied_are_422(api, extra, tag):
    raw = _dicom(32, 32, pixels=MONO, extra=extra)
    with pytest.raises(ImageInvalid, match=tag):
        open_image(raw)
    assert_error(api.post("/answer", json={"image": b64(raw), "question": Q}), 422, tag)


def test_a_mask_span_is_a_slice_of_the_response_as_scored(api):
    """A span is `text[start:end]` of the response before its confidence cue, cut at its
    end as Python cuts: what lies past the end (the cue included) is never masked, and an
    empty slice masks nothing (docs/api.md: a rule the document can state)."""
    response = "<think>x</think><answer>triangle</answer>"
    assert len(response) == 41

    def masked(span: list, text: str = response) -> int:
        r = api.post("/probe/score", json={"image": IMG, "question": Q, "response": text,
                                           "mask": {"target": span}})
        assert r.status_code == 200, r.text
        return r.json()["masked_tokens"]

    whole = masked([0, 41])
    assert whole > 0
    assert masked([0, 500]) == whole                    # cut at the end
    assert 0 < masked([24, 32]) < whole                 # "triangle"
    for span in ([41, 53], [53, 54], [5, 3], [3, 3], [0, 0], [41, 41]):
        assert masked(span) == 0, span
    # with a confidence tag, only the text before the cue is the response as scored: a
    # span reaching the cue (appended again after it, read by μ(C)) stops before it
    tagged = response + "<confidence>9</confidence>"
    assert masked([41, 53], tagged) == 0
    assert masked([0, 60], tagged) == whole
    # a negative end is refused by the request schema (`minimum: 0` in the document)
    r = api.post("/probe/score", json={"image": IMG, "question": Q, "response": response,
                                       "mask": {"target": [-1, 3]}})
    assert_error(r, 422, "mask.target.0: must be an integer from 0 to 20000")


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x7f", "\x85", "\u202e", "\u2066"])
def test_control_characters_in_questions_are_422(api, char):
    r = api.post("/answer", json={"image": IMG, "question": f"what{char} color?"})
    assert_error(r, 422, "control character", f"U+{ord(char):04X}")


def test_tab_and_newline_in_questions_are_accepted(api):
    r = api.post("/answer", json={"image": IMG, "question": "what color\tis\nthe shape?"})
    assert r.status_code == 200, r.text


def test_a_byte_order_mark_is_ignored_on_every_json_route(api):
    """RFC 8259 lets a parser ignore a UTF-8 BOM; /answer (its own parser) had refused a
    body that /feedback (FastAPI's) accepted."""
    import json as json_module

    bom = b"\xef\xbb\xbf"
    headers = {"content-type": "application/json"}
    body = bom + json_module.dumps({"image": IMG, "question": Q}).encode()
    r = api.post("/answer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    fb = bom + json_module.dumps({"request_id": r.json()["request_id"], "correct": True}).encode()
    assert api.post("/feedback", content=fb, headers=headers).json()["accepted"] is True
    assert_error(api.post("/answer", content=bom + bom + b"{}", headers=headers), 422, "body")


def test_a_json_body_that_is_not_utf8_is_422_on_every_json_route(api):
    """FastAPI's parser answered 400 where `/answer` answered 422: one status for one fault."""
    headers = {"content-type": "application/json"}
    for route in ("/answer", "/feedback", "/probe/score", "/probe/score_batch"):
        r = api.post(route, content='{"question": "é"}'.encode("latin-1"), headers=headers)
        assert_error(r, 422, "body: JSON must be UTF-8 text")


@pytest.mark.parametrize("value", [True, "8", 8.5])
def test_max_new_tokens_is_a_strict_integer(api, value):
    assert_error(api.post("/answer", json={"image": IMG, "question": Q,
                                           "max_new_tokens": value}), 422, "max_new_tokens")
    assert_error(api.post("/probe/counterfactual", json={
        "image": IMG, "question": Q, "counterfactual": "blank", "max_new_tokens": value}),
        422, "max_new_tokens")


# 8 as an Arabic-Indic, a full-width and a Devanagari digit
@pytest.mark.parametrize("value", ["\u0668", "\uff18", "\u0968"])
def test_multipart_max_new_tokens_is_ascii(api, value):
    files = {"file": ("x.png", png_bytes(random_image(0)))}
    r = api.post("/answer", files=files, data={"question": Q, "max_new_tokens": value})
    assert_error(r, 422, "max_new_tokens")


@pytest.mark.parametrize("value", ["yes", 1, "true", 0])
def test_feedback_correct_is_a_strict_bool(api, value):
    assert_error(api.post("/feedback", json={"request_id": "a" * 32, "correct": value}), 422,
                 "correct")
    r = api.post("/feedback", json={"request_id": "a" * 32, "correct": True})
    assert r.status_code == 200 and r.json()["accepted"] is False


# Raw ASGI calls: the client's side of the connection is scripted message by message.
async def _asgi(app, path: str, content_type: str, chunks: list[bytes], then: str,
                length: int) -> list[dict]:
    """POST `chunks` (each with more_body), then 'disconnect' or 'hang' (slow loris)."""
    queue = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        if then == "hang":
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 1234),
             "headers": [(b"content-type", content_type.encode()),
                         (b"content-length", str(length).encode())]}
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    return sent


MULTIPART = ("multipart/form-data; boundary=xyz",
             b'--xyz\r\nContent-Disposition: form-data; name="question"\r\n\r\nwhat')
JSON_START = ("application/json", b'{"image": "iVBORw0KGgo')


def _requests(app, status: str) -> float:
    text = generate_latest(app.state.metrics.registry).decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dualread_requests_total" and s.labels["status"] == status)


@pytest.mark.parametrize("content_type, start", [JSON_START, MULTIPART])
def test_client_disconnect_is_499_not_500(service, content_type, start):
    app = create_app(Settings(max_new_tokens=8), service)
    sent = asyncio.run(_asgi(app, "/answer", content_type, [start], "disconnect", 10_000))
    assert sent == []                      # nobody to answer
    assert _requests(app, "499") == 1 and _requests(app, "500") == 0


@pytest.mark.parametrize("content_type, start", [JSON_START, MULTIPART])
def test_slow_body_gets_408(service, content_type, start):
    app = create_app(Settings(max_new_tokens=8, body_timeout_s=0.2), service)
    sent = asyncio.run(_asgi(app, "/answer", content_type, [start], "hang", 1_000_000))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    # nothing ran: the clients may send it again (a load balancer may have lost the body)
    assert (b"retry-after", b"1") in sent[0]["headers"]
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert "not received within 0.2 s" in body["detail"] and HEX32.match(body["request_id"])
    assert _requests(app, "408") == 1


def test_health_answers_head_and_no_slash_redirects(api):
    for path in ("/health/live", "/health/ready"):
        r = api.head(path)
        assert r.status_code == 200 and r.content == b""
    r = api.post("/feedback/", json={"request_id": "a" * 32, "correct": True},
                 follow_redirects=False)
    assert_error(r, 404)
    assert_error(api.get("/health/live/", follow_redirects=False), 404)


def test_sixteen_bit_greys_are_scaled_by_bit_depth_not_by_their_range():
    """A 16-bit PNG of a picture gives the 8-bit picture (÷ 257); a constant white one stays
    white (min–max scaling made it black, and changed every picture's contrast)."""
    from models.images import open_image

    g8 = np.arange(64, dtype=np.uint8).reshape(8, 8) + 40            # grey levels 40..103
    got = np.asarray(open_image(png_bytes(Image.fromarray(g8.astype(np.uint16) * 257))))
    np.testing.assert_array_equal(got[..., 0], g8)
    white = Image.fromarray(np.full((16, 16), 65535, np.uint16))
    assert (np.asarray(open_image(png_bytes(white))) == 255).all()


def test_an_animated_png_is_refused():
    from models.images import ImageInvalid, open_image

    frames = [random_image(k) for k in range(2)]
    buf = io.BytesIO()
    frames[0].save(buf, "PNG", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageInvalid, match="animated image \\(2 frames\\)"):
        open_image(buf.getvalue())


def test_a_repeated_field_is_refused_not_last_wins(api):
    """Two values for one field would let the parser keep the last while a proxy checked
    the first; JSON (escaped spellings included, at any depth) and multipart alike."""
    img = f'"image": "{IMG}"'
    body = "{" + img + ', "question": "what color is the shape?", "question": "is it red?"}'
    nested = "{" + img + ', "question": "q", "response": "x", ' \
        '"mask": {"target": "think", "target": "answer"}}'
    for text in (body, body.replace('"question": "is', '"quest\\u0069on": "is'), nested):
        path = "/probe/score" if "mask" in text else "/answer"
        r = api.post(path, content=text, headers={"content-type": "application/json"})
        assert_error(r, 422, "duplicate key")
    # the same key in two different objects is fine
    ok = api.post("/probe/score", json={"image": IMG, "question": Q, "response": "x",
                                        "mask": {"target": "think"}})
    assert ok.status_code == 200
    raw = png_bytes(random_image(0))
    r = api.post("/answer", files=[("file", ("x.png", raw, "image/png")),
                                   ("question", (None, Q)), ("question", (None, "is it red?"))])
    assert_error(r, 422, "repeats a part")


def test_a_reply_to_a_closed_connection_counts_as_the_client_gone(caplog):
    """When sending the reply fails because the transport is closed, the request is
    counted and logged as 499 (the client went away), not as an unhandled server error."""
    import asyncio
    import logging

    from app.metrics import Metrics
    from app.middleware import RequestContext

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def closed(message):
        if message["type"] == "http.response.body":
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    async def misordered(message):     # an app bug, not a closed connection
        if message["type"] == "http.response.body":
            raise RuntimeError("Unexpected ASGI message 'http.response.body' sent")

    metrics = Metrics()
    mw = RequestContext(app, metrics, 1000, draining=lambda: False)
    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    with caplog.at_level(logging.INFO, logger="dualread"):
        asyncio.run(mw(scope, receive, closed))
    assert metrics.requests.labels("precheck", "499")._value.get() == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with caplog.at_level(logging.INFO, logger="dualread"):
        asyncio.run(mw({**scope}, receive, misordered))
    assert [r for r in caplog.records if r.levelno >= logging.ERROR]   # stays an error


def test_control_characters_are_refused_in_trajectories_too(api):
    for bad in ("x\u0000y", "<answer>red\u202e</answer>", "\x1b[31mred"):
        r = api.post("/probe/score", json={"image": IMG, "question": Q, "response": bad})
        assert_error(r, 422, "response: contains a control character")
    r = api.post("/probe/score_batch", json={"image": IMG, "question": Q, "trajectories": [
        {"response": "<answer>red</answer>"}, {"response": "a\u0007b"}]})
    assert_error(r, 422, "trajectories.1.response: contains a control character (U+0007)")
    ok = api.post("/probe/score", json={"image": IMG, "question": Q,
                                        "response": "<think>a\tb\nc</think><answer>red</answer>"})
    assert ok.status_code == 200      # tab and newline are text


# ------------------------------------------------------------------ third hostile round
def test_invisible_characters_do_not_change_what_the_model_reads(api):
    """Pasted text: zero-width space, soft hyphen, BOM, word joiner, non-breaking and
    full-width spaces, a line separator. The model reads the plain question."""
    clean = api.post("/answer", json={"image": IMG, "question": Q}).json()
    pasted = "\ufeffwhat\u200b color is\u00a0the\u2028sha\u00adpe\u2060?\u3000"
    # the ones that are letters or marks, not format characters: Hangul fillers, a
    # variation selector after ASCII, the combining grapheme joiner, a braille blank
    pasted = pasted.replace("color", "co\u3164lo\u115fr\uffa0\ufe0f\U000e0100\u034f") \
        .replace("the", "the\u2800")
    got = api.post("/answer", json={"image": IMG, "question": pasted})
    assert got.status_code == 200, got.text
    got = got.json()
    assert (got["response"], got["confidence"]) == (clean["response"], clean["confidence"])


def test_plain_question_by_hand():
    assert plain_question(" what\u200b  color\u00ad?\n") == "what color?"
    assert plain_question("\uff37hat\u3000size?") == "What size?"       # full width
    assert plain_question("caf\u0065\u0301?") == "caf\u00e9?"           # composed (NFC)
    assert plain_question("e\u200b\u0301") == "\u00e9"                  # composed after
    # meaning kept: no compatibility folding; joiners kept where they spell
    assert plain_question("lesion of 2 cm\u00b2, 10\u207b\u00b3 mg?") == \
        "lesion of 2 cm\u00b2, 10\u207b\u00b3 mg?"
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"
    doctor = "\U0001f468\u200d\u2695\ufe0f"
    assert plain_question(persian) == persian and plain_question(doctor) == doctor
    assert plain_question("wh\u200dat\u200c?") == "what?"             # after ASCII: dropped
    # nor after a space of any kind, another joiner, a folded letter or a Latin letter
    for pasted in ("what\u00a0\u200d\u200b\u200dcolor", "wha\uff54\u200d color",
                   "what\u2800\u200dcolor", "wh\u00e9\u200dat color"):
        assert "\u200d" not in plain_question(pasted)
    devanagari, flag = "\u0915\u094d\u200d\u0937", "\U0001f3f3\ufe0f\u200d\U0001f308"
    coder = "\U0001f468\U0001f3fd\u200d\U0001f4bb"                     # skin tone, then ZWJ
    # joiners where nothing joins (Greek, µ, Cyrillic, CJK), selectors after no emoji;
    # mathematical letters and two more blanks
    for pasted, plain in (("TNF\u03b1\u200d high", "TNF\u03b1 high"),
                          ("5 \u00b5\u200dg", "5 \u00b5g"), ("37\u00b0\ufe0f C", "37\u00b0 C"),
                          ("\u0447\u200d\u0442\u200d\u043e", "\u0447\u0442\u043e"),
                          ("\u65e5\u200c\u672c", "\u65e5\u672c"),
                          ("\U0001d416\U0001d421\U0001d41a\U0001d42d", "What"),
                          ("Wh\U00016fe4at\U0001d159", "What"),
                          ("38\u2103\u200d fever", "38\u2103 fever"),         # not an emoji
                          ("\U0001f600\u200dthis", "\U0001f600this")):      # no emoji after
        assert plain_question(pasted) == plain, pasted
    assert plain_question(devanagari) == devanagari and plain_question(flag) == flag
    assert plain_question(coder) == coder


def test_a_latin_word_with_a_cyrillic_look_alike_is_422(api):
    r = api.post("/answer", json={"image": IMG, "question": "wh\u0430t is the shape?"})
    assert_error(r, 422, "letter of another script posing as a Latin one", "U+0430")
    r = api.post("/answer", json={"image": IMG, "question": "is it \u0430 circle?"})
    assert_error(r, 422, "posing as a Latin one", "U+0430")   # a look-alike word alone
    for other in ("Wh\u03bft is the shape?", "what is the sh\u0578pe?",     # Greek, Armenian
                  "is it \u0430 circle or \u0430 square? \u0436"):         # one Russian letter
        assert_error(api.post("/answer", json={"image": IMG, "question": other}), 422,
                     "posing as a Latin one")
    for fine in ("what is the TNF\u03b1 level?", "\u0447\u0442\u043e \u044d\u0442\u043e?",
                 "\u0447\u0442\u043e \u0441 CD4?"):       # Russian with a Latin abbreviation
        assert api.post("/answer", json={"image": IMG, "question": fine}).status_code == 200


@pytest.mark.parametrize("question", ["what is \uff1c\uff5cimage_pad\uff5c\uff1e?",
                                      "what is <|image\u200b_pad|>?"])
def test_a_reserved_token_hidden_by_width_or_format_characters_is_422(api, question):
    assert_error(api.post("/answer", json={"image": IMG, "question": question}), 422,
                 "reserved token")


def test_the_question_limit_is_on_the_text_as_sent(api, service):
    """The limit the document states (`maxLength`): the characters sent, invisible ones
    included, counted before the question is normalised."""
    limit = Settings().max_question_chars
    raw = "what" + "\u200b" * limit                  # short once normalised, but not read
    assert_error(api.post("/answer", json={"image": IMG, "question": raw}), 422,
                 f"longer than {limit} characters")
    ok = "what" + "\u200b" * (limit - 11) + " color?"  # exactly the limit: read
    assert len(ok) == limit
    assert api.post("/answer", json={"image": IMG, "question": ok}).status_code == 200


@pytest.mark.parametrize("question", ["?", " ?! ", "\u200b?"])
def test_a_question_without_a_letter_or_digit_is_422(api, question):
    assert_error(api.post("/answer", json={"image": IMG, "question": question}), 422,
                 "question has no letter or digit")


def test_progressive_jpeg_scans_are_counted_and_bounded():
    rng = np.random.default_rng(3)

    def jpeg(a, **kw) -> bytes:
        b = io.BytesIO()
        Image.fromarray(a).save(b, "JPEG", **kw)
        return b.getvalue()

    a = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = 1
    with_exif = io.BytesIO()
    im.save(with_exif, "JPEG", exif=exif, progressive=True)
    assert jpeg_scans(jpeg(a)) == 1
    assert jpeg_scans(jpeg(a, progressive=True)) == jpeg_scans(with_exif.getvalue()) == 10
    assert jpeg_scans(jpeg(a[..., 0], progressive=True)) == 6
    open_image(with_exif.getvalue())
    # the last scan repeated: every copy decodes the whole image again
    p = jpeg(a, progressive=True)
    last = p.rfind(b"\xff\xda")
    bomb = p[:-2] + p[last:-2] * (MAX_JPEG_SCANS - 9) + p[-2:]
    assert jpeg_scans(bomb) == MAX_JPEG_SCANS + 1
    with pytest.raises(ImageInvalid, match=f"{MAX_JPEG_SCANS + 1} scans"):
        open_image(bomb)
    at_limit = p[:-2] + p[last:-2] * (MAX_JPEG_SCANS - 10) + p[-2:]
    assert open_image(at_limit).size == (64, 64)
    # junk the decoder skips (a byte before a marker, a stuffed zero between segments)
    # does not hide the scans from the count
    first = bomb.find(b"\xff\xda")
    for hidden in (bomb[:first] + b"\x00" + bomb[first:], bomb[:2] + b"\xff\x00" + bomb[2:]):
        assert jpeg_scans(hidden) == MAX_JPEG_SCANS + 1
        with pytest.raises(ImageInvalid, match="scans"):
            open_image(hidden)


def _segment(marker: int, payload: bytes) -> bytes:
    return b"\xff" + bytes([marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def _frame_and_scans(sof: int, scans: int) -> bytes:
    """A 4096² four-component JPEG of `scans` empty interleaved scans, frame `sof`."""
    d = b"\xff\xd8" + _segment(0xDB, bytes([0]) + bytes([1] * 64))
    d += _segment(sof, bytes([8]) + (4096).to_bytes(2, "big") * 2 + bytes([4])
                  + b"".join(bytes([i + 1, 0x11, 0]) for i in range(4)))
    sos = _segment(0xDA, bytes([4]) + b"".join(bytes([i + 1, 0]) for i in range(4))
                   + bytes([0, 63, 0]))
    return d + sos * scans + b"\xff\xd9"


def test_jpegs_that_cost_far_more_than_their_pixels_are_refused_before_pil(monkeypatch):
    """Arithmetic coding (64 empty scans in 1 KB held a decode for 4.5 s at 4096²), a
    sequential JPEG with more scans than components, a flood of segments (PIL's own
    header parser took 3 s over 2.6 M of them): refused before PIL reads a byte."""
    def no_pil(*a, **k):
        raise AssertionError("PIL was asked to open it")

    monkeypatch.setattr(Image, "open", no_pil)
    cases = {"coding not accepted": _frame_and_scans(0xC9, 64),
             "sequential JPEG of 4 component(s) with 5 scans": _frame_and_scans(0xC1, 5),
             f"over {MAX_JPEG_SEGMENTS} marker segments":
                 b"\xff\xd8" + b"\xff\xe0\x00\x02" * (MAX_JPEG_SEGMENTS + 1)
                 + _frame_and_scans(0xC0, 1)[2:],
             "without a frame header": b"\xff\xd8\xff\xe0\x00\x02\xff\xd9"}
    for why, data in cases.items():
        with pytest.raises(ImageInvalid, match=re.escape(why)):
            open_image(data, 4096 * 4096)
    assert jpeg_layout(_frame_and_scans(0xC2, 3)) == ((0xC2, 4), 3, 5, 0)
    # EXIF split over many segments: PIL copies the joined block once per segment
    app1 = b"\xff\xe1" + (2562).to_bytes(2, "big") + b"Exif\x00\x00" + bytes(2554)
    exif_flood = b"\xff\xd8" + app1 * 26 + _frame_and_scans(0xC0, 1)[2:]
    assert jpeg_layout(exif_flood)[3] == 26 * 2554
    with pytest.raises(ImageInvalid, match=f"EXIF block over {MAX_EXIF_BYTES} bytes"):
        open_image(exif_flood, 4096 * 4096)


def test_bytes_between_jpeg_segments_are_bounded_before_pil(monkeypatch):
    """Fill bytes, stuffed zeros, restart markers and junk between segments: libjpeg and
    PIL pass over them one by one (10 MiB of 0xFF took 5 s to open an 8×8 image)."""
    b = io.BytesIO()
    Image.new("L", (8, 8)).save(b, "JPEG")
    base = b.getvalue()
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("PIL was asked"))
    for filler in (b"\xff", b"\xff\x00", b"\xff\xd0", b"\x00"):
        data = base[:2] + filler * (MAX_JPEG_GAP // len(filler) + 1) + base[2:]
        with pytest.raises(ImageInvalid, match=f"over {MAX_JPEG_GAP} bytes in all between"):
            open_image(data)
    monkeypatch.setattr(Image, "open", real_open)
    assert open_image(base[:2] + b"\xff" * 1000 + base[2:]).size == (8, 8)   # some: fine
    for restarts in ({"restart_marker_blocks": 1}, {"restart_marker_rows": 1,
                                                    "progressive": True}):
        b = io.BytesIO()
        random_image(1, 64, 64).save(b, "JPEG", **restarts)
        assert open_image(b.getvalue()).size == (64, 64)


def test_a_phones_multi_picture_jpeg_is_its_first_picture():
    first, second = random_image(2, 64, 64), Image.new("RGB", (64, 64), "red")
    b = io.BytesIO()
    first.save(b, "MPO", save_all=True, append_images=[second])
    got = open_image(b.getvalue())
    want = open_image(_jpeg_of(first))
    assert np.array_equal(np.asarray(got), np.asarray(want))


def _jpeg_of(image: Image.Image) -> bytes:
    b = io.BytesIO()
    image.save(b, "JPEG")
    return b.getvalue()


def test_decoder_messages_that_quote_the_file_are_not_returned(api):
    png = png_bytes(random_image(0))
    chunk = b"eXIf" + b"garbageg-patient-42"
    bad = png[:33] + len(chunk[4:]).to_bytes(4, "big") + chunk + \
        zlib.crc32(chunk).to_bytes(4, "big") + png[33:]
    detail = assert_error(api.post("/answer", json={"image": b64(bad), "question": Q}), 422,
                          "cannot decode image")["detail"]
    assert "garbage" not in detail and "patient" not in detail


def test_malformed_json_is_located_in_the_body(api):
    for path in ("/answer", "/feedback", "/probe/score"):
        r = api.post(path, content=b'{"request_id": ', headers={"content-type":
                                                              "application/json"})
        assert_error(r, 422, "body: not valid JSON")



@pytest.mark.parametrize("mask", [{"ratio": "0.5"}, {"ratio": True}, {"seed": "3"},
                                  {"seed": 3.5}, {"target": ["0", "3"]},
                                  {"target": [False, True]}])
def test_mask_fields_are_strict_like_max_new_tokens(api, mask):
    r = api.post("/probe/score", json={"image": IMG, "question": Q, "mask": mask,
                                       "response": "<think>a red circle</think><answer>red"
                                                   "</answer>"})
    assert_error(r, 422, "mask")


def test_a_whole_number_written_with_a_fraction_is_an_integer(api):
    """3.0 is an integer to JSON Schema, so to the OpenAPI document: accepted as 3."""
    body = {"image": IMG, "question": Q, "response": "<think>a red circle</think><answer>red"
                                                     "</answer>"}
    with_int = api.post("/probe/score", json={**body, "mask": {"seed": 3, "target": [0, 9]}})
    with_float = api.post("/probe/score", json={**body, "mask": {"seed": 3.0,
                                                                 "target": [0.0, 9.0]}})
    assert with_int.status_code == with_float.status_code == 200, with_float.text
    assert with_float.json()["confidence"] == with_int.json()["confidence"]
    assert api.post("/answer", json={"image": IMG, "question": Q,
                                     "max_new_tokens": 4.0}).status_code == 200


def test_mask_accepts_an_integer_ratio(api):
    r = api.post("/probe/score", json={"image": IMG, "question": Q,
                                       "mask": {"ratio": 1, "target": [0, 3]},
                                       "response": "<think>a</think><answer>red</answer>"})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ DICOM, hostile round
def test_dicom_pixel_data_longer_than_its_pixels_is_refused_before_unpacking(monkeypatch):
    """10 MiB of 1-bit data for a 64×64 image had become 84 M floats (789 MB)."""
    long = np.zeros((64 * 64 * 4,), np.uint16)                 # 4× what 64² pixels need
    raw = _dicom(64, 64, pixels=long)
    import pydicom

    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array",
                        property(lambda self: pytest.fail("pixels were unpacked")))
    with pytest.raises(ImageInvalid, match="more than 64x64x1 pixels of 16 bits need"):
        open_image(raw)


def test_dicom_with_a_flood_of_sequence_items_is_refused_before_parsing(monkeypatch):
    import pydicom

    raw = _dicom(32, 32, pixels=MONO)
    item = b"\xfe\xff\x00\xe0\xff\xff\xff\xff\xfe\xff\x0d\xe0\x00\x00\x00\x00"
    flood = raw + item * (MAX_DICOM_ITEMS + 1)
    monkeypatch.setattr(pydicom, "dcmread", lambda *a, **k: pytest.fail("parsed"))
    with pytest.raises(ImageInvalid, match=f"over {MAX_DICOM_ITEMS} sequence items"):
        open_image(flood)


def test_flat_and_16_bit_colour_dicom_keep_their_level():
    white = _dicom(8, 8, "RGB", bits=16, pixels=np.full((8, 8, 3), 65535, np.uint16))
    dark = _dicom(8, 8, "RGB", bits=16, pixels=np.full((8, 8, 3), 200, np.uint16))
    flat = _dicom(8, 8, bits=16, pixels=np.full((8, 8), 65535, np.uint16))
    inverted = _dicom(8, 8, "MONOCHROME1", bits=16, pixels=np.zeros((8, 8), np.uint16))
    assert open_image(white).getpixel((3, 3)) == (255, 255, 255)
    assert open_image(dark).getpixel((3, 3)) == (0, 0, 0)              # 200 of 65535
    assert open_image(flat).getpixel((3, 3)) == (255, 255, 255)
    assert open_image(inverted).getpixel((3, 3)) == (255, 255, 255)   # 0 shown as white
    ramp = _dicom(32, 32, pixels=MONO)                                 # min–max as before
    got = np.asarray(open_image(ramp))[..., 0]
    assert got.min() == 0 and got.max() == 255


def test_a_png_whose_bytes_128_to_131_read_dicm_is_a_png():
    png = png_bytes(random_image(7, 32, 32))
    # a text chunk after IHDR (signature 8 + IHDR 25 bytes) whose text puts "DICM" at 128
    text = b"Comment\x00" + b"x" * (128 - 33 - 8 - 8) + b"DICM" + b"yy"
    chunk = len(text).to_bytes(4, "big") + b"tEXt" + text + \
        zlib.crc32(b"tEXt" + text).to_bytes(4, "big")
    data = png[:33] + chunk + png[33:]
    assert data[128:132] == b"DICM"
    assert open_image(data).size == (32, 32)          # "DICOM has no pixel data" before
