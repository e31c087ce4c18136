"""`make mutation`'s per-module report: the counts, the target and the exit status."""

from __future__ import annotations

import io
import sys

from tests.mutation_report import main, not_killed, report, tally

RESULTS = """\
    heads.defer.x_min_kept__mutmut_1: killed
    heads.defer.x_min_kept__mutmut_2: killed
    heads.defer.x_min_kept__mutmut_3: killed
    heads.defer.x_min_kept__mutmut_4: survived
    heads.recert.xǁRuleStoreǁ_close__mutmut_1: killed
    heads.recert.xǁRuleStoreǁ_close__mutmut_2: timeout
    heads.recert.x_certify__mutmut_7: no tests
    heads.recert.x_certify__mutmut_8: not checked
    heads.x_odd__mutmut_1: killed
garbage line
"""


def test_counts_per_module_and_overall():
    counts = tally(RESULTS.splitlines())
    assert counts["heads.defer"] == {"killed": 3, "survived": 1}
    assert counts["heads.recert"] == {"killed": 1, "timeout": 1, "no tests": 1,
                                      "not checked": 1}
    assert counts["heads"] == {"killed": 1}          # a module's own name holds no `.x`
    assert counts["all"] == {"killed": 5, "survived": 1, "timeout": 1, "no tests": 1,
                             "not checked": 1}
    only = tally(RESULTS.splitlines(), {"heads.defer"})
    assert set(only) == {"heads.defer", "all"} and only["all"] == only["heads.defer"]


def test_the_target_counts_timeouts_and_unreached_as_not_killed():
    text, ok = report(tally(RESULTS.splitlines(), {"heads.defer"}), 75.0)
    assert ok and "75.0% killed" in text and "target 75% killed on every module: met" in text
    text, ok = report(tally(RESULTS.splitlines(), {"heads.defer"}), 76.0)
    assert not ok and "heads.defer" in text and "UNDER TARGET" in text
    # 1 of 4 killed, and one mutant never checked: short whatever the target
    text, ok = report(tally(RESULTS.splitlines(), {"heads.recert"}), 0.0)
    assert not ok and "25.0% killed  UNDER TARGET" in text
    assert "timeout    1" in text and "no tests    1" in text
    # the overall row is reported, never judged
    counts = tally(RESULTS.splitlines(), {"heads.defer", "heads"})
    assert counts["all"]["killed"] == 4 and report(counts, 75.0)[1]
    assert report({}, 85.0) == ("no mutants in the results\n"
                                "target 85% killed on every module: NOT met", False)


def test_exit_status(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(RESULTS))
    assert main(["--modules", "heads.defer", "--target", "70"]) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO(RESULTS))
    assert main(["--target", "70"]) == 1            # heads.recert is short
    assert "UNDER TARGET" in capsys.readouterr().out


def test_the_mutants_not_killed_are_listed_for_the_modules_asked_only(monkeypatch, capsys):
    assert not_killed(RESULTS.splitlines(), {"heads.defer"}) == [
        "heads.defer.x_min_kept__mutmut_4: survived"]
    assert not_killed(RESULTS.splitlines()) == [
        "heads.defer.x_min_kept__mutmut_4: survived",
        "heads.recert.xǁRuleStoreǁ_close__mutmut_2: timeout",
        "heads.recert.x_certify__mutmut_7: no tests",
        "heads.recert.x_certify__mutmut_8: not checked"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(RESULTS))
    main(["--modules", "heads.defer", "--target", "70"])
    out = capsys.readouterr().out
    assert out.startswith("not killed:\n    heads.defer.x_min_kept__mutmut_4: survived\n")
    assert "recert" not in out
