"""The re-certification study's target table judges the benign stream over every window:
one that does not certify leaves the shipped rule serving, so it counts at that share."""

from __future__ import annotations

from studies.recert_study import targets


def _report(certified: str, released: float) -> dict:
    v = {"certified": certified, "next_released_mean": released, "next_risk_mean": 0.03,
         "next_risk_above_r": 0}
    return {"target_risk": 0.05, "clean": {"shipped_released": 0.62},
            "benign": {"shipped_released": 0.07, "windows": {"1000": {"sequence_honest": v}}}}


def _row(report: dict) -> str:
    return next(line for line in targets(report) if line.startswith("| benign"))


def test_windows_that_do_not_certify_count_at_the_shipped_share():
    # 15 of 20 certify at 0.60: 0.75 · 0.60 + 0.25 · 0.07 = 0.4675 < 0.57
    row = _row(_report("15/20", 0.60))
    assert "all windows 0.4675" in row and row.endswith("| no |")
    # every window certifies: the mean over all is the certified mean
    row = _row(_report("20/20", 0.60))
    assert "all windows 0.6" in row and row.endswith("| yes |")
    # none certifies
    row = _row(_report("0/20", None))
    assert "all windows None" in row and row.endswith("| no |")
