"""The cost budget `studies.heads_cost --budget` prints, against hand-computed values."""

import math

from studies.heads_cost import budget_lines, service_stages_ms, without_detector


def stages(answer: float, readout: float, rest: float, bare: float,
           decode: float = 100.0, answer_decode: float = 99.0) -> dict[str, float]:
    return {"answer": answer, "readout": readout, "rest": rest, "rest_bare": bare,
            "decode": decode, "answer_decode": answer_decode}


def test_budget_is_three_percent_of_the_answer_alone_less_what_the_readout_adds():
    # the answer alone: 150 ms, 149.8 of them decoding, so 0.2 ms building its responses,
    # which capture's 1 ms readout stage does too: budget 0.03 × 150 − (1 − 0.2) = 3.7;
    # rest 7.4 = 2.0 × budget; left 3.7 − 0.5 = 3.2; the detector 7.4 − 0.5 = 6.9;
    # decoding with capture − without: 150.3 − 149.8 = +0.50
    lines = budget_lines({1: stages(150.0, 1.0, 7.4, 0.5, decode=150.3,
                                    answer_decode=149.8)})
    row = next(x for x in lines if x.startswith("| 1 |"))
    assert row == ("| 1 | 150.0 | 0.20 | +0.50 | 1.00 | 3.70 | 7.40 | 2.0 | 0.50 | 3.20 "
                   "| 6.90 |")


def test_a_readout_over_the_budget_leaves_none_and_says_so():
    # 0.03 × 10 − (0.45 − 0.05) = −0.1: nothing left, even without the detector
    lines = budget_lines({8: stages(10.0, 0.45, 2.0, 0.25, decode=9.5, answer_decode=9.95)})
    row = next(x for x in lines if x.startswith("| 8 |"))
    assert row == ("| 8 | 10.0 | 0.05 | -0.45 | 0.45 | -0.10 | 2.00 | budget ≤ 0 | 0.25 "
                   "| -0.35 | 1.75 |")


def test_one_row_per_batch_size_in_order():
    lines = budget_lines({8: stages(40.0, 0.5, 3.0, 0.3), 1: stages(150.0, 1.0, 7.0, 0.5)})
    assert [x[:5] for x in lines if x[:3] in ("| 1", "| 8")] == ["| 1 |", "| 8 |"]


def test_without_detector_drops_it_from_a_copy_only(service):
    heads = without_detector(service.heads)         # a copy to give a detector to
    detector = object()
    heads.novelty = detector
    bare = without_detector(heads)
    assert bare.novelty is None and heads.novelty is detector
    assert bare.policy is heads.policy and bare.readers is heads.readers


def test_stages_are_timed_on_a_tiny_actor(service, images):
    """Every stage the budget reads is measured (positive, finite) through the service's
    own calls."""
    got = service_stages_ms(service.actor, service.heads, images[:4],
                            ["what shape is it?"] * 4, batch=2, rounds=1)
    assert set(got) == {"answer", "answer_decode", "decode", "readout", "rest", "rest_bare"}
    assert all(math.isfinite(v) and v > 0 for v in got.values()), got
    assert got["answer_decode"] <= got["answer"]
