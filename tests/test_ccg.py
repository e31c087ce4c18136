"""CCG-AUC on constructed cases (docs/method.md §2)."""

import math

import pytest

from clients.ccg import Pair, ccg_auc, summarise


def P(i, img, zr, zh, cr, ch, strict=False):
    return Pair(str(i), img, zr, zh, cr, ch, strict)


def test_ccg_auc_constructed():
    pairs = [P(1, "a", True, False, 0.9, 0.2, True),    # decisive, confidence drops: 1
             P(2, "b", True, False, 0.4, 0.4),          # decisive, tie: 1/2
             P(3, "c", True, False, 0.3, 0.8, True),    # decisive, confidence rises: 0
             P(4, "d", True, True, 0.9, 0.1),           # not decisive (both right)
             P(5, "e", False, False, 0.9, 0.1)]         # not decisive (real wrong)
    assert ccg_auc(pairs) == pytest.approx(0.5)
    assert ccg_auc(pairs, strict=True) == pytest.approx(0.5)
    s = summarise(pairs, bootstrap=50)
    assert (s["P"], s["E"], s["E_strict"]) == (5, 3, 2)
    assert s["underpowered"] is True
    assert s["vrs"] == pytest.approx(4 / 5 - 1 / 5) and s["vbr"] == pytest.approx(3 / 5)
    lo, hi = s["ccg_auc_ci"]
    assert 0 <= lo <= s["ccg_auc"] <= hi <= 1


def test_ccg_auc_empty_decisive_set_is_nan():
    assert math.isnan(ccg_auc([P(1, "a", False, False, 0.5, 0.5)]))
