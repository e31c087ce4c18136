"""Probe logic that only hand-made summaries exercised before: each test here fails if
the named piece is wired the wrong way round."""

from __future__ import annotations

import numpy as np
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


def test_alternatives_change_only_their_axis_and_are_distinct():
    labels, trajs, _, _ = tgs_probe.plan(GOOD, "what color is the shape?", "0:item", CFG)
    p = text.split(GOOD)
    spans = {"vision": p.vision, "reasoning": p.reasoning, "answer": p.answer}
    for axis, span in spans.items():
        alts = [t for lab, t in zip(labels, trajs) if lab.startswith(f"alt:{axis}:")]
        assert alts and len(set(alts)) == len(alts) <= tgs_probe.K_ALTERNATIVES
        assert all(_differs_only_inside(GOOD, t, span) for t in alts)
    # a colour answer has seven others: the paper's k = 5 alternatives
    assert sum(lab.startswith("alt:answer:") for lab in labels) == 5
    assert len(trajs) <= 64


def test_digit_jsd_is_the_papers_pairwise_11_way_statistic():
    from clients.probes import stats

    one = np.eye(11)
    assert stats.jsd(one[3], one[3])[0] == 0.0
    assert stats.jsd(one[3], one[7])[0] == pytest.approx(np.log(2))
    peaked = np.full(11, 0.01)
    peaked[9] = 0.9
    flat = np.full(11, 1 / 11)
    # three distributions: 3 pairs; two equal ones make the one pair with JSD 0
    assert stats.pairwise_jsd([peaked, peaked, flat]) == pytest.approx(
        [0.0, stats.jsd(peaked, flat)[0], stats.jsd(peaked, flat)[0]])

    def rec(alts: list[np.ndarray]) -> dict:
        sc = {"good": _conf(0.9), "answer": _conf(0.2)}
        return {"image_id": "i", "z": True, "interfaces": list(IFACES), "masked_tokens": 0,
                "scores": sc, "variants": {}, "hesitations": 0,
                "digits": {"good": peaked.tolist(),
                           **{f"alt:answer:{j}": a.tolist() for j, a in enumerate(alts)}}}
    cfg = Config(data="t", bootstrap=20, mask_ratios=(0.0, 1.0), mask_seeds=(0,))
    s = tgs_probe.summarise([rec([peaked, peaked]), rec([one[0]])], cfg)["verbalized"]
    # pairs: 3 from the first item (all JSD 0), 1 from the second (far apart)
    assert s["n_jsd11_pairs_answer"] == 4 and s["p_jsd11_le_0.1_answer"] == 0.75
    assert s["n_jsd11_pairs_vision"] == 0
    # the Bernoulli version stays beside it, on the good/bad pair
    assert s["p_jsd_le_0.1_answer"] == 0.0
    assert "p_jsd11_le_0.1_answer" not in tgs_probe.summarise(
        [rec([peaked])], cfg)["dualread"]


def test_a_probe_against_an_answer_only_deployment_says_so():
    """An answer without confidences (answer-only mode) fails the item with a message that
    names the mode, not an AttributeError on `None`."""
    import asyncio
    from types import SimpleNamespace

    from clients.probes.runner import Memo
    from models.items import Item

    class Client:
        async def answer(self, image, question, max_new_tokens):
            return SimpleNamespace(answer="yes", response="yes", confidence=None)

    ctx = SimpleNamespace(client=Client(), cfg=SimpleNamespace(max_new_tokens=8))
    item = Item(id="i", image_path="none.png", question="q?", answer="yes", image_id="im")
    with pytest.raises(RuntimeError, match="answer-only"):
        asyncio.run(Memo(ctx, item)._call(lambda: b""))


HESITANT = ("<think>I see a red circle. Wait, it may be orange. Hmm, no: the colour is red."
            "</think><answer>red</answer><confidence>8</confidence>")


def test_plan_masks_each_ratio_with_each_seed_and_the_whole_think_once():
    cfg = Config(data="test", bootstrap=50, mask_ratios=(0.0, 0.5, 1.0), mask_seeds=(3, 4))
    labels, trajs, masks, _ = tgs_probe.plan(HESITANT, "what color is the shape?", "0:i", cfg)
    assert len(labels) == len(trajs) == len(masks)
    rows = [(lab, t, m) for lab, t, m in zip(labels, trajs, masks) if lab.startswith("mask:")]
    assert rows == [
        ("mask:0.5:3", HESITANT, {"target": "think", "ratio": 0.5, "seed": 3}),
        ("mask:0.5:4", HESITANT, {"target": "think", "ratio": 0.5, "seed": 4}),
        ("mask:1:0", HESITANT, {"target": "think", "ratio": 1.0, "seed": 0})]   # 0%: none


def test_plan_cuts_around_each_hesitation_in_pairs():
    labels, trajs, masks, _ = tgs_probe.plan(HESITANT, "what color is the shape?", "0:i", CFG)
    cuts = text.hesitations(HESITANT)
    assert len(cuts) == 2
    rows = [(lab, t, m) for lab, t, m in zip(labels, trajs, masks) if lab.startswith("hes:")]
    assert rows == [(f"hes:{j}:{side}", cut, None) for j, pair in enumerate(cuts)
                    for side, cut in zip(("pre", "post"), pair)]


def test_tgs_interval_is_the_seeded_image_bootstrap_of_the_mean():
    from clients.probes.stats import cluster_bootstrap

    rows = [{"image_id": f"i{k % 6}"} for k in range(24)]
    d = np.linspace(0.0, 1.0, 24) ** 2
    cfg = Config(data="test", bootstrap=37)
    got = tgs_probe._ci(rows, d, cfg)
    ids = [r["image_id"] for r in rows]
    assert got == cluster_bootstrap(ids, lambda idx: float(d[idx].mean()), 37, 42)
    assert got != cluster_bootstrap(ids, lambda idx: float(d[idx].mean()), 1000, 42)
    assert got[0] < d.mean() < got[1]
    assert np.isnan(tgs_probe._ci([], d, cfg)).all()               # no rows: no interval
