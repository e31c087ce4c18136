"""The batched-confidence fallback of `app.service.Service`: a failing batch call is
logged once (JSON), and each item is then scored alone."""

from __future__ import annotations

import json
import logging

from app.service import Service


class BrokenBatchHeads:
    def assess(self, readouts: list) -> list:
        raise RuntimeError("shape mismatch")


def test_failed_batch_scoring_is_logged_once(caplog):
    service = Service.__new__(Service)        # no model: only the heads are consulted
    service.heads = BrokenBatchHeads()
    with caplog.at_level(logging.WARNING, logger="dualread.service"):
        out = service._assess_batch({0: "r0", 3: "r3", 5: "r5"})
    assert out == {}                          # every item falls back to scoring alone
    records = [r for r in caplog.records if r.name == "dualread.service"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert json.loads(records[0].getMessage()) == {
        "event": "batch_scoring_failed", "items": 3, "error": "RuntimeError",
        "detail": "shape mismatch"}
