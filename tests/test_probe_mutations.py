"""Probe logic that only hand-made summaries exercised before: each test here fails if
the named piece is wired the wrong way round."""

from __future__ import annotations

import pytest

from clients.probes import reliance as reliance_probe
from clients.probes import text
from clients.probes import tgs as tgs_probe
from clients.probes.runner import Config

CFG = Config(data="test", bootstrap=50)
IFACES = ("dualread", "psr", "per", "verbalized")
GOOD = ("<think>I see a red circle in the upper left. The question asks for the colour, "
        "so the answer is red.</think><answer>red</answer><confidence>9</confidence>")


def _differs_only_inside(a: str, b: str, span: tuple[int, int]) -> bool:
    """`b` equals `a` outside `span` of `a` (what lies inside may change length)."""
    head, tail = a[:span[0]], a[span[1]:]
    return b != a and b.startswith(head) and b.endswith(tail)


@pytest.mark.parametrize("question", ["what color is the shape?", "is there a red circle?"])
def test_plan_puts_each_bad_variant_on_its_own_axis(question):
    labels, trajs, masks, variants = tgs_probe.plan(GOOD, question, "0:item", CFG)
    by = dict(zip(labels, trajs))
    p = text.split(GOOD)
    assert by["good"] == GOOD
    assert _differs_only_inside(GOOD, by["vision"], p.vision)
    assert _differs_only_inside(GOOD, by["reasoning"], p.reasoning)
    assert _differs_only_inside(GOOD, by["answer"], p.answer)
    for axis in ("vision", "reasoning", "answer"):
        assert variants[axis] == by[axis] and masks[labels.index(axis)] is None


def _conf(x: float) -> dict:
    return {k: x for k in IFACES}


def test_vrs_p_value_is_against_the_shuffle_and_bd_against_the_blank():
    """Shuffled images are answered as well as the real ones (VRS = 0) while the blank
    one gets everything wrong (BD = 1): a p-value taken against the wrong condition swaps
    their p-values."""
    recs = [{"image_id": f"i{k}", "shuffle_image": "x", "nvc": False,
             "real": {"z": True, "a": "red", "c": _conf(0.9)},
             "blank": {"z": False, "a": "no", "c": _conf(0.4)},
             "shuffle": {"z": True, "a": "red", "c": _conf(0.8)}} for k in range(16)]
    s = reliance_probe.summarise(recs, CFG)
    assert s["vrs"] == 0.0 and s["bd"] == 1.0
    assert s["vrs_p"] > 0.5
    assert s["bd_p"] < 0.01
