"""The cost budget `studies.heads_cost --budget` prints, against hand-computed values."""

from studies.heads_cost import budget_lines


def stages(answer: float, readout: float, rest: float, bare: float,
           decode: float = 100.0, answer_decode: float = 99.0) -> dict[str, float]:
    return {"answer": answer, "readout": readout, "rest": rest, "rest_bare": bare,
            "decode": decode, "answer_decode": answer_decode}


def test_budget_is_three_percent_of_the_answer_alone_less_the_readout():
    # budget 0.03 × 150 − 1 = 3.5; rest 7 = 2.0 × budget; left 3.5 − 0.5 = 3.0 for the
    # detector, which takes 7 − 0.5 = 6.5; decoding with capture − without: +1.00
    lines = budget_lines({1: stages(150.0, 1.0, 7.0, 0.5)})
    row = next(x for x in lines if x.startswith("| 1 |"))
    assert row == "| 1 | 150.0 | +1.00 | 1.00 | 3.50 | 7.00 | 2.0 | 0.50 | 3.00 | 6.50 |"


def test_a_readout_over_the_budget_leaves_none_and_says_so():
    # 0.03 × 10 − 0.4 = −0.1: nothing left, even without the detector
    lines = budget_lines({8: stages(10.0, 0.4, 2.0, 0.25, decode=9.0, answer_decode=9.5)})
    row = next(x for x in lines if x.startswith("| 8 |"))
    assert row == "| 8 | 10.0 | -0.50 | 0.40 | -0.10 | 2.00 | budget ≤ 0 | 0.25 | -0.35 | 1.75 |"


def test_one_row_per_batch_size_in_order():
    lines = budget_lines({8: stages(40.0, 0.5, 3.0, 0.3), 1: stages(150.0, 1.0, 7.0, 0.5)})
    assert [x[:5] for x in lines if x[:3] in ("| 1", "| 8")] == ["| 1 |", "| 8 |"]


def test_stages_are_timed_on_a_tiny_actor(service, images):
    """Every stage the budget reads is measured (positive, finite) through the service's
    own calls, and the call without the detector leaves the heads it copied untouched."""
    import math

    from studies.heads_cost import service_stages_ms

    heads = service.heads
    novelty = heads.novelty
    got = service_stages_ms(service.actor, heads, images[:4], ["what shape is it?"] * 4,
                            batch=2, rounds=1)
    assert set(got) == {"answer", "answer_decode", "decode", "readout", "rest", "rest_bare"}
    assert all(math.isfinite(v) and v > 0 for v in got.values()), got
    assert got["answer_decode"] <= got["answer"]
    assert heads.novelty is novelty
