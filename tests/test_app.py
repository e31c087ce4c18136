"""The HTTP contract through the ASGI app (a real uvicorn process: test_server.py)."""

import dataclasses
import io
import struct
import threading
import time
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.service import Service
from app.serving import AnswerResult, Confidences, ScoreResult, StageTimes
from app.settings import Settings
from clients.grounding import PairClass, classify_pair
from heads.dualread import FingerprintMismatch
from models.actor import Answers, StageTimings
from tests.conftest import random_image
from tests.helpers import b64, png_bytes, random_heads

Q = "what color is the shape?"


@pytest.fixture(scope="module")
def service(actor_dirs, actors, tmp_path_factory):
    heads = random_heads(tmp_path_factory.mktemp("heads"), actors["qwen3_vl"])
    return Service(actor_dirs["qwen3_vl"], heads)


def client(service, **kw) -> TestClient:
    settings = Settings(max_new_tokens=8, batch_wait_ms=5, **kw)
    return TestClient(create_app(settings, service))


@pytest.fixture(scope="module")
def api(service):
    with client(service, max_image_bytes=200_000, max_image_pixels=1_000_000) as c:
        yield c


IMG = b64(png_bytes(random_image(0)))


def test_answer_json_contract(api):
    r = api.post("/answer", json={"image": IMG, "question": Q})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"answer", "response", "confidence", "defer", "defer_threshold",
                         "model", "heads", "request_id", "timings_ms"}
    assert set(body["confidence"]) == {"dualread", "psr", "per", "verbalized"}
    assert all(0 <= v <= 1 for v in body["confidence"].values())
    below = body["confidence"]["dualread"] < body["defer_threshold"]
    assert body["defer"] == (below or body["defer_reason"] is not None)
    assert set(body["timings_ms"]) == {"read", "decode_wait", "decode", "queue", "generate",
                                       "readout", "heads"}
    assert r.headers["x-request-id"] == body["request_id"]


def test_answer_multipart_equals_json(api):
    raw = png_bytes(random_image(0))
    a = api.post("/answer", files={"file": ("x.png", raw, "image/png")}, data={"question": Q})
    b = api.post("/answer", json={"image": b64(raw), "question": Q})
    assert a.status_code == b.status_code == 200
    assert a.json()["response"] == b.json()["response"]
    assert a.json()["confidence"] == pytest.approx(b.json()["confidence"])


@pytest.mark.parametrize("question", ["", "   ", "x" * 5000])
def test_bad_question_is_422(api, question):
    assert api.post("/answer", json={"image": IMG, "question": question}).status_code == 422


def _modes():
    rgb = random_image(1)
    i16 = Image.fromarray((np.arange(32 * 32).reshape(32, 32) * 60).astype(np.uint16))
    return {"L": rgb.convert("L"), "RGBA": rgb.convert("RGBA"), "P": rgb.convert("P"),
            "I;16": i16, "CMYK": rgb.convert("CMYK")}


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16", "CMYK"])
def test_image_modes_are_converted(api, mode):
    img = _modes()[mode]
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    r = api.post("/answer", json={"image": b64(png_bytes(img, fmt)), "question": Q})
    assert r.status_code == 200, r.text


def test_corrupt_and_truncated_images_are_422(api):
    raw = png_bytes(random_image(2))
    for data, why in [(b"not an image at all", "cannot decode"),
                      (raw[: len(raw) // 2], "cannot decode"),
                      (b"", "empty")]:
        r = api.post("/answer", json={"image": b64(data), "question": Q})
        assert r.status_code == 422, r.text
        assert why in r.json()["detail"]
    r = api.post("/answer", json={"image": "***not base64***", "question": Q})
    assert r.status_code == 422 and "base64" in r.json()["detail"]


def test_huge_image_is_413(api):
    big = np.random.default_rng(0).integers(0, 255, (300, 300, 3), dtype=np.uint8)
    r = api.post("/answer", json={"image": b64(png_bytes(Image.fromarray(big))), "question": Q})
    assert r.status_code == 413


def _bomb_png(w: int, h: int) -> bytes:
    """A tiny PNG whose header claims w x h pixels (a decompression bomb)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = zlib.compress(b"\x00" * (w // 8 + 1) * 64, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


def test_decompression_bomb_rejected_before_decoding(api):
    r = api.post("/answer", json={"image": b64(_bomb_png(100_000, 100_000)), "question": Q})
    assert r.status_code == 413
    assert "pixels" in r.json()["detail"] or "bomb" in r.json()["detail"]


def test_dicom_is_accepted(api):
    pydicom = pytest.importorskip("pydicom")
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.MediaStorageSOPClassUID = generate_uid()
    meta.MediaStorageSOPInstanceUID = generate_uid()
    ds = FileDataset("x.dcm", {}, file_meta=meta, preamble=b"\0" * 128)
    a = (np.arange(32 * 32).reshape(32, 32) * 3).astype(np.uint16)
    ds.Rows, ds.Columns, ds.BitsAllocated, ds.BitsStored, ds.HighBit = 32, 32, 16, 12, 11
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PixelRepresentation = 1, "MONOCHROME2", 0
    ds.WindowCenter, ds.WindowWidth = 1500, 3000
    ds.PixelData = a.tobytes()
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    r = api.post("/answer", json={"image": b64(buf.getvalue()), "question": Q})
    assert r.status_code == 200, r.text


def test_counterfactual_blank(api):
    r = api.post("/probe/counterfactual", json={
        "question": Q, "image": IMG, "counterfactual": "blank"})
    assert r.status_code == 200, r.text
    body = r.json()
    diff = body["confidence_difference"]["dualread"]
    assert diff == pytest.approx(body["real"]["confidence"]["dualread"]
                                 - body["counterfactual"]["confidence"]["dualread"])
    assert body["decisive"] is None


class FakeBackend:
    """The model side without a model: answers the colour of the image's first pixel.

    `hold` makes every batch wait on an event (the 504 path); `seen` records deadlines.
    """

    fingerprint, heads_id, threshold = "fake-actor", "fake-heads", 0.5
    COLOURS = {(255, 0, 0): "red", (0, 0, 255): "blue", (128, 128, 128): "gray"}

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.hold = hold
        self.seen: list[list[float]] = []

    def info(self) -> dict[str, str]:
        return {"actor": self.fingerprint, "heads": self.heads_id, "family": "fake",
                "device": "none"}

    def cards(self) -> dict:
        return {"actor": {"fingerprint": self.fingerprint}, "heads": {"id": self.heads_id}}

    def check_question(self, question: str, max_chars: int, max_tokens: int) -> str:
        return question.strip()

    def check_response(self, response: str, max_tokens: int) -> str:
        return response

    def answer_batch(self, items, deadlines):
        self.seen.append(list(deadlines))
        if self.hold is not None:
            self.hold.wait(30)
        out = []
        for it in items:
            a = self.COLOURS.get(it.image.convert("RGB").getpixel((0, 0)), "green")
            c = Confidences(0.9 if a == "red" else 0.2, 0.5, 0.5, 0.5)
            out.append(AnswerResult(a, a, f"<answer>{a}</answer>", c, c.dualread < 0.5, None,
                                    StageTimes(0.0, 0.0, 0.0)))
        return out

    def score_batch(self, items, deadlines):
        return [ScoreResult(Confidences(0.5, 0.5, 0.5, 0.5), None, "x", 0) for _ in items]


def solid(rgb) -> str:
    return b64(png_bytes(Image.new("RGB", (16, 16), rgb)))


@pytest.mark.parametrize("refs, decisive, strict", [
    (("red", "red"), True, False),        # right on the real image, wrong on the other
    (("red", "blue"), False, False),      # right on both
    (("blue", "red"), False, False),      # wrong on the real image
    (("blue", "blue"), False, False),
    ((None, "red"), None, None),          # one reference missing: undefined
])
def test_counterfactual_decisive_and_strict(refs, decisive, strict):
    with TestClient(create_app(Settings(), FakeBackend())) as c:
        r = c.post("/probe/counterfactual", json={
            "question": Q, "image": solid((255, 0, 0)), "counterfactual": solid((0, 0, 255)),
            "reference_answer": refs[0], "counterfactual_reference_answer": refs[1]})
    body = r.json()
    assert r.status_code == 200, r.text
    assert (body["real"]["answer"], body["counterfactual"]["answer"]) == ("red", "blue")
    assert body["decisive"] is decisive and body["strict"] is strict
    assert body["answer_changed"] is True
    assert body["confidence_difference"]["dualread"] == pytest.approx(0.9 - 0.2)


@pytest.mark.parametrize("field", ["reference_answer", "counterfactual_reference_answer"])
@pytest.mark.parametrize("ref", ["", "  ", "?!", "\t. \n"])
def test_a_reference_with_no_answer_in_it_is_refused(field, ref):
    """An empty reference (once normalised) would grade every answer wrong: 422 naming the
    field, before any model work."""
    backend = FakeBackend()
    with TestClient(create_app(Settings(), backend)) as c:
        r = c.post("/probe/counterfactual", json={
            "question": Q, "image": solid((255, 0, 0)), "counterfactual": "blank",
            field: ref})
    assert r.status_code == 422 and field in r.json()["detail"], r.text
    assert backend.seen == []                        # refused before any model work


class TruncatingBackend(FakeBackend):
    """Every blue answer is cut at max_new_tokens: deferred for that reason."""

    def answer_batch(self, items, deadlines):
        out = FakeBackend.answer_batch(self, items, deadlines)
        return [dataclasses.replace(r, defer=True, defer_reason="truncated")
                if r.answer == "blue" else r for r in out]


def test_counterfactual_runs_carry_the_defer_decision():
    with TestClient(create_app(Settings(), TruncatingBackend())) as c:
        body = c.post("/probe/counterfactual", json={
            "question": Q, "image": solid((255, 0, 0)), "counterfactual": solid((0, 0, 255)),
            "reference_answer": "red", "counterfactual_reference_answer": "blue"}).json()
    # the counterfactual's answer matches its reference, but /answer would defer it
    assert body["counterfactual"]["correct"] is True
    assert (body["counterfactual"]["defer"], body["counterfactual"]["defer_reason"]) == \
        (True, "truncated")
    assert (body["real"]["defer"], body["real"]["defer_reason"]) == (False, None)


def test_counterfactual_strict_needs_the_same_answer():
    # the blank image is gray (128, 128, 128): the fake answers "gray" there
    with TestClient(create_app(Settings(), FakeBackend())) as c:
        body = c.post("/probe/counterfactual", json={
            "question": Q, "image": solid((128, 128, 128)), "counterfactual": "blank",
            "reference_answer": "gray", "counterfactual_reference_answer": "white"}).json()
    assert body["decisive"] is True and body["strict"] is True
    assert body["answer_changed"] is False


def test_classify_pair_by_hand():
    assert classify_pair(True, False, "red", "blue") == PairClass(True, False)
    assert classify_pair(True, False, "red", "red") == PairClass(True, True)
    assert classify_pair(True, False, "", "") == PairClass(True, False)   # canon ≠ ∅
    assert classify_pair(False, False, "a", "a") == PairClass(False, False)
    assert classify_pair(True, True, "a", "a") == PairClass(False, False)
    assert classify_pair(None, False, "a", "a") == PairClass(None, None)


def test_timeout_is_504_and_the_job_carries_the_deadline():
    hold = threading.Event()
    fake = FakeBackend(hold)
    try:
        with TestClient(create_app(Settings(request_timeout_s=0.3), fake)) as c:
            t0 = time.monotonic()
            r = c.post("/answer", json={"image": solid((255, 0, 0)), "question": Q})
            t1 = time.monotonic()
            assert r.status_code == 504, r.text
            assert set(r.json()) == {"detail", "request_id"}
            assert r.headers["x-request-id"] == r.json()["request_id"]
            # the worker was told when to give up: the caller's own timeout from submission
            [[deadline]] = fake.seen
            assert t0 + 0.3 <= deadline <= t1 + 0.3
            hold.set()
    finally:
        hold.set()


def test_probe_score_with_mask(api):
    traj = "<think>I see a red circle. so red</think><answer>red</answer>"
    plain = api.post("/probe/score", json={"image": IMG, "question": Q, "response": traj})
    masked = api.post("/probe/score", json={"image": IMG, "question": Q, "response": traj,
                                             "mask": {"target": "think", "ratio": 1.0}})
    assert plain.status_code == masked.status_code == 200
    assert plain.json()["masked_tokens"] == 0 and masked.json()["masked_tokens"] > 0
    assert plain.json()["answer"] == "red"
    assert 0 <= masked.json()["mu_c"] <= 1
    assert plain.json()["confidence"] != masked.json()["confidence"]
    # a span past the response is the slice cut at its end (docs/api.md)
    spans = [api.post("/probe/score", json={"image": IMG, "question": Q, "response": traj,
                                            "mask": {"target": [5, end]}})
             for end in (9999, len(traj))]
    assert [r.status_code for r in spans] == [200, 200]
    assert spans[0].json()["masked_tokens"] == spans[1].json()["masked_tokens"] > 0


def test_feedback_updates_gauges(api):
    ids = []
    for i in range(6):
        r = api.post("/answer", json={"image": b64(png_bytes(random_image(20 + i))),
                                      "question": Q})
        ids.append(r.json()["request_id"])
    for i, rid in enumerate(ids):
        body = api.post("/feedback", json={"request_id": rid, "correct": i % 2 == 0}).json()
        assert body["accepted"] and body["reason"] is None
    # a forged id and a second verdict are both refused, and told apart
    assert api.post("/feedback", json={"request_id": "unknown", "correct": True}).json() \
        == {"accepted": False, "window": 6, "reason": "unknown", "counted": False}
    assert api.post("/feedback", json={"request_id": ids[0], "correct": False}).json() \
        == {"accepted": False, "window": 6, "reason": "already_labelled", "counted": False}
    text = api.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert "dualread_feedback_defer_rate" in fams
    assert fams["dualread_feedback_ece"].samples[0].value >= 0


def test_metrics_parse_and_names(api):
    api.post("/answer", json={"image": IMG, "question": Q})
    text = api.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for n in ("dualread_request_duration_seconds", "dualread_requests",
              "dualread_stage_duration_seconds", "dualread_batch_size", "dualread_queue_depth",
              "dualread_confidence", "dualread_defer", "dualread_model_info"):
        assert n in names, n
    assert 'dualread_requests_total{route="/answer",status="200"}' in text


def test_health_and_models(api, service):
    assert api.get("/health/live").json() == {"status": "live"}
    assert api.get("/health/ready").status_code == 200
    cards = api.get("/v1/models").json()
    assert cards["actor"]["fingerprint"] == service.actor.fingerprint
    assert cards["heads"]["card"]["actor_fingerprint"] == service.actor.fingerprint


def test_auth_on(service):
    with client(service, api_key="s3cret") as c:
        assert c.post("/answer", json={"image": IMG, "question": Q}).status_code == 401
        bad = c.post("/answer", json={"image": IMG, "question": Q},
                     headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["detail"] == "missing or invalid credentials"
        ok = c.post("/answer", json={"image": IMG, "question": Q},
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/health/live").status_code == 200      # health and metrics stay open
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401


def test_the_key_is_checked_before_the_body(service):
    """Without the key a body is refused 401 before it is read or judged: no 422 from the
    JSON pre-check and no 413 that would tell the body limit; with the key those stand."""
    nested = '{"a": ' * 20 + "1" + "}" * 20
    key = {"Authorization": "Bearer s3cret"}
    with client(service, api_key="s3cret", max_body_bytes=10_000) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            r = c.post("/answer", content=nested,
                       headers={"content-type": "application/json", **headers})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["detail"] == "missing or invalid credentials"
            big = c.post("/probe/score", content=b"x" * 20_000,
                         headers={"content-type": "application/json", **headers})
            assert big.status_code == 401
        r = c.post("/answer", content=nested,
                   headers={"content-type": "application/json", **key})
        assert r.status_code == 422 and "nested" in r.json()["detail"]
        big = c.post("/probe/score", content=b"x" * 20_000,
                     headers={"content-type": "application/json", **key})
        assert big.status_code == 413
        ok = c.post("/answer", json={"image": IMG, "question": Q},
                    headers={"Authorization": "bEaReR s3cret"})    # scheme in any case
        assert ok.status_code == 200


def test_readiness_is_503_until_loaded(tmp_path):
    settings = Settings(actor=str(tmp_path / "missing"))
    with TestClient(create_app(settings)) as c:
        import time
        for _ in range(50):
            r = c.get("/health/ready")
            if "no actor" in r.text:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and "no actor" in r.json()["detail"]
        assert c.post("/answer", json={"image": IMG, "question": Q}).status_code == 503
        assert c.get("/health/live").status_code == 200


def test_heads_of_another_actor_are_refused(actor_dirs, actors, tmp_path):
    """Service checks the heads' fingerprint: heads fitted on qwen2_vl, actor qwen3_vl."""
    other = random_heads(tmp_path / "h", actors["qwen2_vl"])
    with pytest.raises(FingerprintMismatch):
        Service(actor_dirs["qwen3_vl"], other)
    with TestClient(create_app(Settings(actor=actor_dirs["qwen3_vl"], heads=other))) as c:
        for _ in range(200):
            r = c.get("/health/ready")
            if "FingerprintMismatch" in r.text:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and "fitted for actor" in r.json()["detail"]


def test_defer_is_decided_on_dualread_not_per(service, monkeypatch):
    """τ placed between PER and DualRead: only the DualRead side may decide."""
    traj = "<think>I see a red circle.</think><answer>red</answer><confidence>9</confidence>"
    img = random_image(0)
    ro = service.actor.score([img], [Q], [traj], cue=False)[0]
    conf = service.heads.confidence(ro.readout)
    dr, per = conf["dualread"], conf["per"]
    assert abs(dr - per) > 1e-3                      # precondition: they differ

    def answer(images, questions, max_new_tokens=64, readout="capture", deadlines=None):
        rs = service.actor.score(list(images), list(questions), [traj] * len(images), cue=False)
        for r in rs:
            r.finished = True
        return Answers(rs, StageTimings(0.0, 0.0))

    monkeypatch.setattr(service.actor, "answer", answer)
    monkeypatch.setattr(service, "needs_tag", True)
    tau = (dr + per) / 2
    monkeypatch.setattr(service.heads, "policy",
                        dataclasses.replace(service.heads.policy, tau=tau))
    with client(service) as c:
        body = c.post("/answer", json={"image": b64(png_bytes(img)), "question": Q}).json()
    assert body["defer_reason"] is None and body["defer_threshold"] == pytest.approx(tau)
    assert body["confidence"]["dualread"] == pytest.approx(dr, abs=1e-5)
    assert body["defer"] is (dr < tau)
    assert body["defer"] is not (per < tau)           # the two rules disagree here
