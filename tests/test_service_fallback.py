"""The batched-confidence fallback of `app.service.Service`: a failing batch call is
logged once (JSON), and each item is then scored alone; a working one gives each item its
own confidences and image-check reading."""

from __future__ import annotations

import json
import logging

from app.service import Service

IMAGES = [f"i{k}" for k in range(6)]     # item k's image at k, as a batch holds them


def _service(heads) -> Service:
    service = Service.__new__(Service)        # no model: only the heads are consulted
    service.heads = heads
    service.check_process = None              # the image check runs in this thread
    return service


class BrokenBatchHeads:
    def assess(self, readouts: list) -> list:
        raise RuntimeError("shape mismatch")


def test_failed_batch_scoring_is_logged_once(caplog):
    service = _service(BrokenBatchHeads())
    with caplog.at_level(logging.WARNING, logger="dualread.service"):
        out = service._assess_batch({0: "r0", 3: "r3", 5: "r5"},
                                    service._check_images(IMAGES))
    assert out == {}                          # every item falls back to scoring alone
    records = [r for r in caplog.records if r.name == "dualread.service"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert json.loads(records[0].getMessage()) == {
        "event": "batch_scoring_failed", "items": 3, "error": "RuntimeError",
        "detail": "shape mismatch"}


class BrokenImageCheckHeads:
    def assess(self, readouts: list) -> list:
        return [f"a-{r}" for r in readouts]

    def image_readings(self, images: list) -> list:
        raise ValueError("image check failed")


class EchoHeads(BrokenImageCheckHeads):
    def image_readings(self, images: list) -> list:
        return [f"check-{im}" for im in images]


class NoCheckHeads(BrokenImageCheckHeads):
    def image_readings(self, images: list) -> None:
        return None


def test_a_failing_image_check_also_falls_back_to_items_alone(caplog):
    service = _service(BrokenImageCheckHeads())
    with caplog.at_level(logging.WARNING, logger="dualread.service"):
        assert service._assess_batch({1: "r1"}, service._check_images(IMAGES)) == {}
    assert json.loads(caplog.records[-1].getMessage())["error"] == "ValueError"


def test_each_item_gets_its_own_assessment_and_image_reading():
    service = _service(EchoHeads())
    # items 4 and 2 are still waited for (the others' deadlines passed): each gets the
    # reading of its own image out of the batch's
    out = service._assess_batch({4: "r4", 2: "r2"}, service._check_images(IMAGES))
    assert {k: v[:2] for k, v in out.items()} == {4: ("a-r4", "check-i4"),
                                                  2: ("a-r2", "check-i2")}
    service.heads = NoCheckHeads()            # heads without an image check
    out = service._assess_batch({4: "r4"}, service._check_images(IMAGES))
    assert out[4][:2] == ("a-r4", None)
