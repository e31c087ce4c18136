"""The cost budget `studies.heads_cost --bench` prints, against hand-computed values."""

import json

from studies.heads_cost import budget_lines, budgets


def bench(answer_b1: float, readout_b1: float, answer_b8: float, readout_b8: float) -> dict:
    def run(batch: int, answer: float, readout: float) -> dict:
        return {"batch": batch, "seconds_per_item": {"answer": answer, "capture": 9.9},
                "readout_seconds_per_item": readout}
    return {"git_commit": "0123456789abcdef",
            "in_process": {"b1": run(1, answer_b1, readout_b1),
                           "b8": run(8, answer_b8, readout_b8)}}


def test_budget_is_three_percent_of_the_answer_alone_less_the_readout():
    # 0.03 × 150 ms − 1 ms = 3.5 ms; 0.03 × 40 ms − 0.5 ms = 0.7 ms
    got = budgets(bench(0.150, 0.001, 0.040, 0.0005))
    assert set(got) == {1, 8}
    answer, readout, left = got[1]
    assert (round(answer, 6), round(readout, 6), round(left, 6)) == (150.0, 1.0, 3.5)
    assert round(got[8][2], 6) == 0.7


def test_budget_lines_compare_the_whole_heads_with_the_budget(tmp_path):
    path = tmp_path / "bench.json"
    # at batch 8 the readout alone eats the budget: 0.03 × 10 ms − 0.4 ms < 0
    path.write_text(json.dumps(bench(0.150, 0.001, 0.010, 0.0004)))
    rows = [(1, "whole `Heads.assess` (with the image)", 7.0, 14.0),
            (8, "whole `Heads.assess` (with the image)", 2.0, 4.0),
            (8, "features (extract_many)", 0.1, 0.1)]
    lines = budget_lines(str(path), rows)
    assert "commit 01234567" in lines[1]
    b1 = next(x for x in lines if x.startswith("| 1 |"))
    assert b1 == "| 1 | 150.0 | 1.00 | 3.50 | 7.00 | 2.0 |"
    b8 = next(x for x in lines if x.startswith("| 8 |"))
    assert b8.endswith("| 2.00 | budget ≤ 0 |")
