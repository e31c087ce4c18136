"""The batched-confidence fallback of `app.service.Service`: a failing batch call is
logged once (JSON), and each item is then scored alone; a working one gives each item its
own confidences."""

from __future__ import annotations

import json
import logging

from app.service import Service


def _service(heads) -> Service:
    service = Service.__new__(Service)        # no model: only the heads are consulted
    service.heads = heads
    return service


class BrokenBatchHeads:
    def assess(self, readouts: list) -> list:
        raise RuntimeError("shape mismatch")


class EchoHeads:
    def assess(self, readouts: list) -> list:
        return [f"a-{r}" for r in readouts]


def test_failed_batch_scoring_is_logged_once(caplog):
    service = _service(BrokenBatchHeads())
    with caplog.at_level(logging.WARNING, logger="dualread.service"):
        out = service._assess_batch({0: "r0", 3: "r3", 5: "r5"})
    assert out == {}                          # every item falls back to scoring alone
    records = [r for r in caplog.records if r.name == "dualread.service"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert json.loads(records[0].getMessage()) == {
        "event": "batch_scoring_failed", "items": 3, "error": "RuntimeError",
        "detail": "shape mismatch"}


def test_each_item_gets_its_own_assessment():
    service = _service(EchoHeads())
    # items 4 and 2 are still waited for (the others' deadlines passed): each gets its own
    # assessment out of the batch's, with its share of the seconds
    out = service._assess_batch({4: "r4", 2: "r2"})
    assert {k: v[0] for k, v in out.items()} == {4: "a-r4", 2: "a-r2"}
    assert all(v[1] >= 0 for v in out.values())
