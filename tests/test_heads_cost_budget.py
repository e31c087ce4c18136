"""The cost budget `studies.heads_cost --bench` prints, against hand-computed values."""

import json

from studies.heads_cost import BARE, REST, budget_lines, budgets


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


def test_budget_lines_give_the_detector_what_the_service_leaves_of_the_budget(tmp_path):
    path = tmp_path / "bench.json"
    # at batch 8 the readout alone eats the budget: 0.03 × 10 ms − 0.4 ms < 0
    path.write_text(json.dumps(bench(0.150, 0.001, 0.010, 0.0004)))
    nan = float("nan")
    rows = [(1, REST, 7.0, nan), (1, BARE, 0.5, nan),
            (8, REST, 2.0, nan), (8, BARE, 0.25, nan),
            (8, "features (extract_many)", 0.1, 0.1)]
    lines = budget_lines(str(path), rows)
    assert "commit 01234567" in lines[1]
    # budget 3.5; rest 7 = 2.0 × budget; 3.5 − 0.5 = 3.0 left; the detector 7 − 0.5 = 6.5
    b1 = next(x for x in lines if x.startswith("| 1 |"))
    assert b1 == "| 1 | 150.0 | 1.00 | 3.50 | 7.00 | 2.0 | 0.50 | 3.00 | 6.50 |"
    b8 = next(x for x in lines if x.startswith("| 8 |"))
    assert "| budget ≤ 0 |" in b8 and b8.endswith("| 0.25 | -0.35 | 1.75 |")


def test_a_batch_size_the_study_did_not_time_gets_no_row(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench(0.150, 0.001, 0.040, 0.0005)))
    lines = budget_lines(str(path), [(8, REST, 2.0, float("nan")),
                                     (8, BARE, 0.3, float("nan"))])
    assert [x[:5] for x in lines if x.startswith("| ") and x[2].isdigit()] == ["| 8 |"]
