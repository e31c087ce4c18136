"""The HTTP contract through the ASGI app (a real uvicorn process: test_server.py)."""

import io
import struct
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.service import Service
from app.settings import Settings
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
    assert body["defer"] == (body["confidence"]["dualread"] < body["defer_threshold"])
    assert set(body["timings_ms"]) == {"queue", "generate", "readout", "heads"}
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


def test_counterfactual_with_references(api):
    first = api.post("/probe/counterfactual", json={
        "question": Q, "image": IMG, "counterfactual": b64(png_bytes(random_image(9)))}).json()
    real_answer = first["real"]["answer"] or "x"
    r = api.post("/probe/counterfactual", json={
        "question": Q, "image": IMG, "counterfactual": b64(png_bytes(random_image(9))),
        "reference_answer": real_answer, "counterfactual_reference_answer": "zzz"}).json()
    if first["real"]["answer"]:
        assert r["real"]["correct"] is True and r["counterfactual"]["correct"] is False
        assert r["decisive"] is True
        assert r["strict"] == (r["real"]["canonical"] == r["counterfactual"]["canonical"])


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
    bad = api.post("/probe/score", json={"image": IMG, "question": Q, "response": traj,
                                          "mask": {"target": [5, 9999]}})
    assert bad.status_code == 422


def test_feedback_updates_gauges(api):
    ids = []
    for i in range(6):
        r = api.post("/answer", json={"image": b64(png_bytes(random_image(20 + i))),
                                      "question": Q})
        ids.append(r.json()["request_id"])
    for i, rid in enumerate(ids):
        assert api.post("/feedback", json={"request_id": rid, "correct": i % 2 == 0}
                        ).json()["accepted"]
    assert not api.post("/feedback", json={"request_id": "unknown", "correct": True}
                        ).json()["accepted"]
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
