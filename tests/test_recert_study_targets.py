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


# ------------------------------------------------------------ the default window's rule

def _source(windows: dict[int, int], n: int = 3500, harmful_certified: str = "0/20",
            poisoned_worst: float = 0.08, risk: float = 0.04) -> dict:
    """A study report whose benign window w has `windows[w]` of 20 splits certified and
    released at 0.60 (floor 0.57), the rest not certified."""
    def entry(meeting: int) -> dict:
        splits = [[0.6, risk]] * meeting + [None] * (20 - meeting)
        return {"certified": f"{meeting}/20", "next_risk_mean": risk if meeting else None,
                "next_by_split": splits}
    benign = {str(w): {"next_items": min(500, n - w), "sequence_honest": entry(k),
                       "sequence_poisoned_0.2": {"next_risk_max": poisoned_worst}}
              for w, k in windows.items() if w < n}
    harmful = {str(w): {"sequence_honest": {"certified": harmful_certified},
                        "sequence_poisoned_0.2": {"next_risk_max": None}}
               for w in windows if w < 1500}
    return {"target_risk": 0.05, "next": 500, "clean": {"shipped_released": 0.62},
            "benign": {"windows": benign}, "harmful": {"windows": harmful}}


def test_the_smallest_window_passing_on_every_source_that_tests_it_is_picked():
    from studies.recert_window import pick

    long = _source({300: 0, 1000: 15, 1500: 16, 3000: 20})
    short = _source({300: 0, 1000: 20}, n=1527)      # tests 300 and 1000 only
    got = pick({"dev": short, "render": long})
    # 1000 passes on dev but 15 of 20 on the longer source fall short of 16
    assert not got["windows"]["1000"]["passes"]
    assert got["windows"]["1500"]["sources"]["dev"] is None
    assert got["picked"] == 1500 and got["picked_by_rule"]
    assert pick({"dev": short})["picked"] == 1000


def test_a_split_below_the_floor_does_not_count():
    from studies.recert_window import judge

    rep = _source({1000: 20})
    rep["benign"]["windows"]["1000"]["sequence_honest"]["next_by_split"][:5] = [[0.56, 0.03]] * 5
    assert judge(rep, 1000)["splits_meeting"] == "15/20"
    assert not judge(rep, 1000)["passes"]


def test_risk_poisoning_and_harmful_each_refuse_a_window():
    from studies.recert_window import FALLBACK, judge, pick

    assert judge(_source({1000: 20}), 1000)["passes"]
    assert not judge(_source({1000: 20}, risk=0.051), 1000)["passes"]
    assert not judge(_source({1000: 20}, poisoned_worst=0.101), 1000)["passes"]
    assert not judge(_source({1000: 20}, harmful_certified="1/20"), 1000)["passes"]
    # nothing passes: the shipped default stays, and the result says the rule did not pick
    got = pick({"dev": _source({1000: 20}, risk=0.06)})
    assert got["picked"] == FALLBACK and not got["picked_by_rule"]


# ------------------------------------------------------------ the threshold search's rule

def _variants(**per: dict) -> dict:
    """One source whose report holds, for each variant, `_source`'s figures under its keys:
    per[name] = `_source` keywords."""
    rep = None
    for name, kw in per.items():
        one = _source(**kw)
        if rep is None:
            rep = {k: v for k, v in one.items() if k not in ("benign", "harmful")}
            rep["benign"], rep["harmful"] = {"windows": {}}, {"windows": {}}
        for stream in ("benign", "harmful"):
            for w, entry in one[stream]["windows"].items():
                slot = rep[stream]["windows"].setdefault(w, {})
                for key, v in entry.items():
                    slot[key.replace("sequence", name, 1) if key != "next_items" else key] = v
    return rep


def test_the_window_rule_reads_the_search_it_is_given():
    from studies.recert_window import judge

    rep = _variants(a={"windows": {1000: 5}}, b={"windows": {1000: 20}})
    assert judge(rep, 1000, "a")["splits_meeting"] == "5/20"
    assert judge(rep, 1000, "b")["passes"]


def test_the_search_with_most_splits_meeting_on_safe_windows_is_picked():
    from studies.recert_search import choose

    rep = _variants(cur={"windows": {1000: 3, 3000: 2}}, fine={"windows": {1000: 9, 3000: 0}},
                    coarse={"windows": {1000: 6, 3000: 6}})
    got = choose({"render": rep}, ["cur", "fine", "coarse"], current="cur")
    assert {v: r["splits_meeting"] for v, r in got["variants"].items()} == \
        {"cur": 5, "fine": 9, "coarse": 12}
    assert got["picked"] == "coarse"
    # a split released above the floor but with risk above r does not meet the target
    split = rep["benign"]["windows"]["1000"]["coarse_honest"]["next_by_split"]
    split[:6] = [[0.6, 0.051]] * 6
    assert choose({"render": rep}, ["cur", "fine", "coarse"], current="cur")["picked"] == "fine"


def test_unsafe_windows_do_not_count_and_harmful_certificates_rule_a_search_out():
    from studies.recert_search import choose

    # poisoned risk above 2r at 1000: that window's splits do not count
    rep = _variants(cur={"windows": {1000: 3, 3000: 0}},
                    other={"windows": {1000: 20, 3000: 2}, "poisoned_worst": 0.11})
    got = choose({"render": rep}, ["cur", "other"], current="cur")
    assert got["variants"]["other"]["safe_windows"] == []
    assert got["picked"] == "cur"
    # an honest harmful window certified at any size: out, whatever it releases
    rep = _variants(cur={"windows": {1000: 3}},
                    other={"windows": {1000: 20}, "harmful_certified": "1/20"})
    got = choose({"render": rep}, ["cur", "other"], current="cur")
    assert got["variants"]["other"]["harmful_certified_somewhere"]
    assert got["picked"] == "cur"


def test_a_tie_or_nothing_meeting_keeps_the_current_search():
    from studies.recert_search import choose

    rep = _variants(other={"windows": {1000: 4}}, cur={"windows": {1000: 4}})
    assert choose({"render": rep}, ["other", "cur"], current="cur")["picked"] == "cur"
    rep = _variants(other={"windows": {1000: 0}}, cur={"windows": {1000: 0}})
    assert choose({"render": rep}, ["other", "cur"], current="cur")["picked"] == "cur"
