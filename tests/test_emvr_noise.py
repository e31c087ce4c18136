"""EMVR keeps the paper's strict definition (R_{k+1} > R_k, no tolerance); rises below
NOISE_TOL are reported apart, as a labelled diagnostic, and never change EMVR itself."""

from __future__ import annotations

import numpy as np
import pytest

from clients.probes import emvr as emvr_probe
from clients.probes import stats
from clients.probes.runner import Config

IFACES = ("dualread", "verbalized")


def test_strict_emvr_counts_a_float_noise_rise_and_the_diagnostic_does_not():
    flat = np.array([[0.9, 0.9 + 1e-9, 0.9, 0.9 + 2e-9, 0.9]])
    assert stats.emvr(flat) == pytest.approx(0.5)            # the paper's definition
    assert stats.emvr(flat, tol=emvr_probe.NOISE_TOL) == 0.0
    real = np.array([[0.5, 0.6, 0.4, 0.45, 0.1]])            # rises of .1 and .05
    assert stats.emvr(real) == stats.emvr(real, tol=emvr_probe.NOISE_TOL) == 0.5


def _record(image: str, rows: dict[str, list[float]]) -> dict:
    rec = {"image_id": image, "box": [0, 0, 4, 4], "control_box": [10, 10, 14, 14]}
    for v, cs in rows.items():
        rec[v] = [{"z": True, "a": "x", "c": {k: c for k in IFACES}} for c in cs]
    return rec


def test_summary_reports_both_and_emvr_is_unchanged():
    noisy = [0.9, 0.9 + 1e-9, 0.9, 0.9, 0.9 - 1e-9]          # one noise rise of four
    down = [0.9, 0.8, 0.7, 0.75, 0.1]                        # one real rise of four
    recs = [_record(f"i{k}", {"mask": down, "blur": down, "control": noisy}) for k in range(4)]
    s = emvr_probe.summarise(recs, Config(data="t", bootstrap=20))
    assert s["noise_tol"] == emvr_probe.NOISE_TOL
    for k in IFACES:
        assert s[k]["control"] == pytest.approx(0.25)            # strict: noise counts
        assert s[k]["control_above_noise"] == 0.0
        assert s[k]["mask"] == s[k]["mask_above_noise"] == pytest.approx(0.25)
    assert "diagnostic, not EMVR" in emvr_probe.markdown(s)
