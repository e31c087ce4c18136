"""TGS with a gold-conditioned good trajectory and held-out perturbation families: the
trajectories differ on the axis they name and nowhere else, the held-out families are
text the consistency reader never saw, and the summary reads each pair from the rows it
should (own: correct items; gold: every item)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clients.probes import external, text
from clients.probes import tgs as tgs_probe
from clients.probes.runner import Config
from models.data import Item
from models.synonyms import table_for
from models.trajectory import describe_images

CFG = Config(data="test", bootstrap=50)
IFACES = ("dualread", "psr", "per", "verbalized")
OWN = ("<think>I see a red circle. The question asks for the colour, so the answer is "
       "red.</think><answer>red</answer><confidence>9</confidence>")
OWN_YN = ("<think>I see a blue triangle. The question asks if there is a red shape; the "
          "colour is blue, so the answer is no.</think><answer>no</answer>")
TABLE = table_for("easyvqa")


def _only_inside(a: str, b: str, span: tuple[int, int]) -> bool:
    head, tail = a[:span[0]], a[span[1]:]
    return b != a and b.startswith(head) and b.endswith(tail)


def _axis_spans(traj: str) -> dict[str, tuple[int, int]]:
    p = text.split(traj)
    return {"vision": p.vision, "reasoning": p.reasoning, "answer": p.answer}


# ---------------------------------------------------------------- the gold trajectory
@pytest.mark.parametrize("gold, obs, question", [
    ("red", "a red circle", "what color is the shape?"),
    ("no", "a blue triangle", "is there a red shape?"),
    ("circle", "circle", "what shape is this?")])
def test_gold_trajectory_states_the_gold_and_each_variant_changes_one_axis(gold, obs, question):
    good = external.gold_trajectory(gold, obs)
    p = text.split(good)
    assert good[p.answer[0]:p.answer[1]] == gold
    assert f"the answer is {gold}" in good[p.reasoning[0]:p.reasoning[1]]
    assert obs in good[p.vision[0]:p.vision[1]]
    bad = external.gold_variants(gold, obs, question, "0:x")
    spans = _axis_spans(good)
    for axis, v in bad.items():
        assert v is not None and _only_inside(good, v, spans[axis]), axis
    # the reasoning error keeps the final answer; the answer flip changes it
    assert text.split(bad["reasoning"]) and bad["reasoning"].endswith(f"<answer>{gold}</answer>")
    assert f"<answer>{gold}</answer>" not in bad["answer"]


def test_gold_without_an_observation_has_no_vision_pair():
    bad = external.gold_variants("yes", None, "is there a red shape?", "k")
    assert bad["vision"] is None and bad["reasoning"] and bad["answer"]
    assert external.NO_OBSERVATION in external.gold_trajectory("yes", None)


def test_observation_comes_from_the_data_then_the_open_answer():
    assert external.observation_of("i", {"i": "a red circle"}, "no", "q") == "a red circle"
    assert external.observation_of("j", {"i": "a red circle"}, "teal", "q") == "teal"
    assert external.observation_of("j", {}, "Yes", "q") is None


def test_describe_images_reads_the_gold_answers_of_each_image():
    def it(k: str, img: str, q: str, a: str, domain: str = "easyvqa") -> Item:
        return Item(id=k, image_path="", question=q, answer=a, image_id=img, domain=domain)
    items = [it("1", "A", "what color is the shape?", "green"),
             it("2", "A", "is there a triangle?", "yes"),
             it("3", "B", "what shape is the blue shape?", "circle"),
             it("4", "C", "what color is the shape?", "red"),          # shape never settled
             it("5", "D", "what color is the shape?", "red", domain="other"),
             it("6", "D", "what shape is it?", "circle", domain="other")]
    assert describe_images(items) == {"A": "a green triangle", "B": "a blue circle"}


# ---------------------------------------------------------------- held-out families
def _plan(own: str, question: str, answer: str, obs: str, table=TABLE
          ) -> dict[str, str]:
    _, _, _, variants = tgs_probe.plan(own, question, "0:x", CFG)
    gold = external.gold_trajectory(answer, obs)
    bad = external.gold_variants(answer, obs, question, "0:x")
    return dict(external.plan(own, variants, gold, bad, "0:x", table))


@pytest.mark.parametrize("own, question, answer, obs", [
    (OWN, "what color is the shape?", "red", "a red circle"),
    (OWN_YN, "is there a red shape?", "no", "a blue triangle")])
def test_every_held_out_pair_differs_on_its_axis_only(own, question, answer, obs):
    by = _plan(own, question, answer, obs)
    for fam in external.FAMILIES:
        for src in external.SOURCES:
            good = by[f"{fam}:{src}:good"]
            spans = _axis_spans(good)
            for axis in tgs_probe.AXES:
                assert _only_inside(good, by[f"{fam}:{src}:{axis}"], spans[axis]), \
                    (fam, src, axis)


def test_held_out_text_is_never_a_trajectory_the_reader_was_fitted_on():
    """The reader saw the actor's own trajectories and their answer flips (the
    in-distribution answer axis): no held-out trajectory may be one of those."""
    _, trajs, _, variants = tgs_probe.plan(OWN, "what color is the shape?", "0:x", CFG)
    seen = {OWN, variants["answer"]} | set(trajs)
    by = _plan(OWN, "what color is the shape?", "red", "a red circle")
    held = [t for k, t in by.items() if k.split(":")[0] in external.FAMILIES]
    assert held and not seen & set(held)


def test_synonym_family_uses_the_data_table_and_keeps_the_rationales_no():
    s = external.synonym(OWN_YN, TABLE, "k")
    p = text.split(s)
    assert "there is a " in s and s[p.answer[0]:p.answer[1]] in external.YES_NO["no"]
    assert "blue" not in s and "triangle" not in s          # every table word reworded
    assert external.synonym(OWN, table_for("no-such-data"), "k") is None
    # the same word gets the same synonym in a good trajectory and its variants
    bad = text.answer_variant(OWN, "k")
    assert external.synonym(OWN, TABLE, "k").split("<answer>")[0] == \
        external.synonym(bad, TABLE, "k").split("<answer>")[0]


def test_paraphrase_and_phrase_keep_the_content_words():
    para = external.paraphrase(OWN)
    assert para != OWN and "red circle" in para and "I see" not in para
    assert external.paraphrase("<think>Red.</think><answer>red</answer>") is None
    assert "<answer>my answer is red</answer>" in external.phrase(OWN)


# ---------------------------------------------------------------- the summary
def _conf(x: float) -> dict:
    return {k: x for k in IFACES}


def _record(image: str, z: bool, own_good: float, own_bad: float, gold: float,
            gold_bad: float, held_good: float, held_bad: float, c_real: float = 0.9,
            tau: float | None = 0.7) -> dict:
    scores = {"good": _conf(own_good), "mask:1:0": _conf(own_good)}
    for a in tgs_probe.AXES:
        scores[a] = _conf(own_bad)
        scores[f"gold:{a}"] = _conf(gold_bad)
    scores["gold"] = _conf(gold)
    for fam in external.FAMILIES:
        for src in external.SOURCES:
            scores[f"{fam}:{src}:good"] = _conf(held_good)
            for a in tgs_probe.AXES:
                scores[f"{fam}:{src}:{a}"] = _conf(held_bad)
    return {"image_id": image, "z": z, "interfaces": list(IFACES), "masked_tokens": 5,
            "scores": scores, "variants": {}, "hesitations": 0, "real_c": _conf(c_real),
            "tau": tau}


def test_summary_reads_gold_pairs_on_every_item_and_own_pairs_on_correct_ones():
    cfg = Config(data="t", bootstrap=20, mask_ratios=(0.0, 1.0), mask_seeds=(0,))
    recs = [_record("a", True, 0.9, 0.5, 0.8, 0.6, 0.7, 0.6, c_real=0.9),
            _record("b", True, 0.9, 0.5, 0.8, 0.6, 0.7, 0.6, c_real=0.8),
            _record("c", False, 0.9, 0.1, 0.8, 0.0, 0.9, 0.1, c_real=0.75)]
    s = tgs_probe.summarise(recs, cfg)
    assert s["n_gold"] == 3 and s["n_gold_vision"] == 3
    v = s["dualread"]
    assert v["pair"] == pytest.approx(0.4)                        # own: a, b only
    assert v["gold_pair"] == pytest.approx((0.2 + 0.2 + 0.8) / 3)  # gold: every item
    own = v["heldout"]["synonym"]["own"]
    gold = v["heldout"]["synonym"]["gold"]
    assert own["pair"] == pytest.approx(0.1) and own["n_vision"] == 2
    assert gold["pair"] == pytest.approx((0.1 + 0.1 + 0.8) / 3) and gold["n_vision"] == 3
    assert own["wording_cost"] == pytest.approx(0.2)               # 0.9 − 0.7
    assert gold["wording_cost"] == pytest.approx((0.1 + 0.1 - 0.1) / 3)
    assert v["heldout_pair_own"] == pytest.approx(0.1)
    assert v["own_minus_gold"] == pytest.approx(0.1)
    d = s["deferral"]
    assert d["tau"] == 0.7 and d["own_wrong"] == {"n": 1, "ge_tau": 1.0, "mean": 0.75}
    assert d["flip_own"]["n"] == 2 and d["flip_own"]["ge_tau"] == 0.0   # 0.5 < .7
    assert d["flip_gold"] == {"n": 3, "ge_tau": 0.0, "mean": pytest.approx(0.4)}
    assert d["flip_synonym_gold"]["ge_tau"] == 0.0 and d["flip_synonym_own"]["n"] == 2
    md = tgs_probe.markdown(s)
    assert "held-out" in md and "own wrong answers 1.000 of 1" in md


def test_summary_without_external_scores_or_threshold():
    """Records stored before (no gold, no τ): the new keys are NaN or say why."""
    rec = _record("a", True, 0.9, 0.5, 0.8, 0.6, 0.7, 0.6, tau=None)
    rec["scores"] = {k: v for k, v in rec["scores"].items()
                     if k in ("good", "mask:1:0", *tgs_probe.AXES)}
    s = tgs_probe.summarise([rec], Config(data="t", bootstrap=20, mask_ratios=(0.0, 1.0),
                                          mask_seeds=(0,)))
    assert s["n_gold"] == 0 and math.isnan(s["dualread"]["gold_pair"])
    assert math.isnan(s["dualread"]["heldout_pair_gold"])
    assert isinstance(s["deferral"], str)
    assert np.isfinite(s["dualread"]["pair"])


def test_one_page_summary_shows_the_gold_and_held_out_pairs():
    from clients.probes.runner import fmt
    from clients.probes.summary import summary

    cfg = Config(data="t", bootstrap=20, mask_ratios=(0.0, 1.0), mask_seeds=(0,))
    s = tgs_probe.summarise([_record("a", True, 0.9, 0.5, 0.8, 0.3, 0.7, 0.65),
                             _record("b", False, 0.9, 0.5, 0.8, 0.3, 0.7, 0.65)], cfg)
    row = next(x for x in summary({"tgs": s}).splitlines() if x.startswith("| dualread"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4:7] == [fmt(0.4), fmt(0.5), fmt(0.05)]     # own, gold, held-out own


def test_a_wrong_answer_exactly_at_tau_counts_as_released():
    """The service defers below τ (p < τ), so c = τ is released."""
    cfg = Config(data="t", bootstrap=20, mask_ratios=(0.0, 1.0), mask_seeds=(0,))
    recs = [_record("a", False, 0.9, 0.5, 0.8, 0.3, 0.7, 0.65, c_real=0.7, tau=0.7),
            _record("b", False, 0.9, 0.5, 0.8, 0.3, 0.7, 0.65, c_real=0.69, tau=0.7)]
    d = tgs_probe.summarise(recs, cfg)["deferral"]
    assert d["own_wrong"]["n"] == 2 and d["own_wrong"]["ge_tau"] == 0.5
    assert d["own_right"]["n"] == 0 and d["flip_own"]["n"] == 0
