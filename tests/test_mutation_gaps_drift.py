"""Tests for mutants of heads/drift.py that the module's own tests did not see: the window's
size and threshold, the references it skips, the rows it leaves out and its version count.

No actor is built; the statistics are scipy's KS test on the same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import ks_2samp

from heads.drift import DriftWindow


def test_default_window_and_the_twenty_answer_threshold():
    assert DriftWindow().rows.maxlen == 500
    d = DriftWindow(50)
    d.set_reference({"s": np.linspace(0, 1, 30)})
    x = np.linspace(0.2, 1.2, 20)
    for v in x[:19]:
        d.record({"s": v}, False)
    assert d.stats() == {}                     # 19 answers: no statistic
    d.record({"s": x[19]}, True)               # 20: one
    got = d.stats()
    want = ks_2samp(x, np.linspace(0, 1, 30))
    assert got["n"] == 20 and got["flagged_share"] == pytest.approx(1 / 20)
    assert got["ks"] == {"s": (pytest.approx(want.statistic), pytest.approx(want.pvalue))}


def test_rows_without_a_finite_score_are_left_out_of_its_test():
    d = DriftWindow(100)
    d.set_reference({"a": np.arange(30.0), "b": np.arange(30.0), "empty": []})
    assert set(d.reference) == {"a", "b"}      # an empty reference has no test
    for k in range(26):
        # "a" on every row, NaN or inf on six of them; "b" on 19 rows only
        a = float("nan") if k < 3 else float("inf") if k < 6 else float(k)
        d.record({"a": a, "b": k} if k < 19 else {"a": a}, bool(k % 2))
    got = d.stats()
    assert got["n"] == 26 and got["flagged_share"] == pytest.approx(13 / 26)
    assert set(got["ks"]) == {"a"}            # b: 19 scores, too few for a test
    want = ks_2samp(np.arange(6.0, 26.0), np.arange(30.0))     # the 20 finite ones
    assert got["ks"]["a"] == (pytest.approx(want.statistic), pytest.approx(want.pvalue))


def test_a_new_reference_restarts_the_window_and_every_change_counts():
    d = DriftWindow(40)
    assert d.version == 0 and d.reference == {}
    d.set_reference({"s": [3, 1, 2]})
    assert d.version == 1 and d.reference["s"].tolist() == [1.0, 2.0, 3.0]
    for k in range(25):
        d.record({"s": k}, False)
    assert d.version == 26 and len(d.rows) == 25
    assert d.rows[0] == ({"s": 0.0}, False, "") and type(d.rows[0][0]["s"]) is float
    d.set_reference({"s": [0.5]})
    assert d.version == 27 and len(d.rows) == 0 and d.stats() == {}


def test_the_window_counts_each_input_digest_once_and_forgets_it_on_eviction():
    # the one-input rule's bookkeeping, exactly: a digest is held while its row is in the
    # window (a replay is refused and says so), dropped when its row leaves (so the digest
    # table stays the window's size and the input may come back), and "" is never held
    d = DriftWindow(3)
    assert [d.record({"s": k}, False, f"k{k}") for k in (1, 2, 3)] == [True] * 3
    assert d.keys == {"k1": 1, "k2": 1, "k3": 1}
    assert d.record({"s": 9.0}, True, "k2") is False           # a replay: nothing recorded
    assert len(d.rows) == 3 and d.version == 3 and d.keys["k2"] == 1
    assert d.record({"s": 4.0}, False, "k4") is True            # k1's row leaves
    assert dict(d.keys) == {"k2": 1, "k3": 1, "k4": 1}
    assert d.record({"s": 1.0}, False, "k1") is True            # so k1 may come back
    assert dict(d.keys) == {"k3": 1, "k4": 1, "k1": 1}
    assert [r[2] for r in d.rows] == ["k3", "k4", "k1"]
    assert d.record({"s": 0.0}, False) is True and d.record({"s": 0.0}, False) is True
    assert dict(d.keys) == {"k1": 1}                            # unkeyed rows push keys out
    assert d.record({"s": 0.0}, False, "k3") is True            # k3 left with its row
