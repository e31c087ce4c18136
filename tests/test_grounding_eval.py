"""Grounding in `evaluate` on constructed cases: CCG-AUC with its decisive set and power
flag, AUROC per answer type, donor planning, paired differences, the defer rule and the
question-only baseline."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from clients.maths import Pair
from heads import grounding
from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.evaluate import response_problems
from heads.fit import question_only, question_prior
from models.data import Item


def _pair(k: int, z_real: bool, z_hn: bool, c_real: float, c_hn: float, strict: bool = True,
          image: str | None = None) -> Pair:
    return Pair(f"i{k}", image or f"img{k}", z_real, z_hn, c_real, c_hn, strict)


def test_ccg_summary_known_value_and_decisive_set():
    pairs = [_pair(0, True, False, 0.9, 0.2),            # decisive, right order: 1
             _pair(1, True, False, 0.6, 0.6),            # tie: ½
             _pair(2, True, False, 0.3, 0.8, strict=False),  # wrong order: 0 (not strict)
             _pair(3, True, False, 0.7, 0.1, strict=False),  # 1 (not strict)
             _pair(4, True, True, 0.1, 0.9),             # not decisive (right on both)
             _pair(5, False, False, 0.1, 0.9)]           # not decisive
    donors = [f"d{k}" for k in range(6)]
    s = grounding.ccg_summary(pairs, donors, bootstrap=200)
    assert s["ccg_natural"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert s["ccg_strict"] == pytest.approx((1 + 0.5) / 2)
    assert (s["n_eligible"], s["ccg_natural_n_decisive"], s["ccg_strict_n_decisive"]) == \
        (6, 4, 2)
    lo, hi = s["ccg_natural_ci"]
    assert 0 <= lo <= hi <= 1
    assert s["ccg_natural_underpowered"] is True


def test_underpowered_counts_donor_images_too():
    """40 source images but all their donors come from 3 images: underpowered (the probe's
    summary counted source images only)."""
    pairs = [_pair(k, True, False, 0.9, 0.1) for k in range(40)]
    few = [f"d{k % 3}" for k in range(40)]
    many = [f"d{k}" for k in range(40)]
    assert grounding.ccg_summary(pairs, few, bootstrap=0)["ccg_natural_underpowered"] is True
    s = grounding.ccg_summary(pairs, many, bootstrap=0)
    assert s["ccg_natural_underpowered"] is False
    assert (s["ccg_natural_source_images"], s["ccg_natural_donor_images"]) == (40, 40)


def test_auroc_by_answer_type_matches_sklearn_per_subset():
    gold = ["yes", "no", "Yes", "no", "red", "blue", "green", "teal", "circle", "triangle",
            "rectangle", "circle"]
    z = np.array([1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 0])
    c = np.array([.9, .2, .8, .3, .1, .9, .2, .8, .7, .4, .5, .6])
    types = [grounding.answer_type(g) for g in gold]
    assert types == ["yes/no"] * 4 + ["colour"] * 4 + ["shape"] * 4
    out = grounding.auroc_by_type(c, z, types)
    assert out["yes/no"]["auroc"] == 1.0 and out["colour"]["auroc"] == 0.0
    assert out["shape"]["auroc"] == pytest.approx(roc_auc_score(z[8:], c[8:]))
    assert {t: out[t]["n"] for t in out} == {"yes/no": 4, "colour": 4, "shape": 4}


def _item(k: int, q: str, a: str, img: str) -> Item:
    return Item(id=f"i{k}", image_path=f"{img}.png", question=q, answer=a, image_id=img)


def test_donor_plan_reuses_the_donor_run_when_the_question_is_the_same():
    items = [_item(0, "What color is the shape?", "red", "A"),
             _item(1, "What color is the shape?", "blue", "B"),
             _item(2, "what color is the shape", "green", "C"),   # same normalised form
             _item(3, "Is there a circle?", "yes", "D")]          # no donor
    plan = grounding.plan_donors(items, seed=0)
    assert plan.source == [0, 1, 2]
    for k, d, r in zip(plan.source, plan.donor, plan.reuse):
        assert d.image_id != items[k].image_id and d.canonical != items[k].canonical
        assert r == (items.index(d) if d.question == items[k].question else None)
    extra = grounding.extra_items(items, plan)
    assert len(extra) == sum(r is None for r in plan.reuse)
    for e in extra:            # donor image and gold answer, the source's question text
        src = next(it for it in items if e.id.startswith(it.id + "@hn:"))
        assert e.question == src.question and e.image_id != src.image_id
    # the same assignment every time (seeded, before scoring)
    assert [d.id for d in grounding.plan_donors(items, 0).donor] == [d.id for d in plan.donor]


def test_pairs_from_reused_and_extra_runs():
    items = [_item(0, "q?", "red", "A"), _item(1, "q?", "blue", "B")]
    plan = grounding.DonorPlan(source=[0, 1], donor=[items[1], items[0]], reuse=[1, None])
    z, canonical = np.array([1, 1]), ["red", "blue"]
    scores = {"m": np.array([0.8, 0.6])}
    runs = grounding.donor_runs(plan, z, canonical, scores, np.array([0]), ["blue"],
                                {"m": np.array([0.7])})
    pairs = grounding.pairs_for(plan, items, z, canonical, scores["m"], runs, "m")
    # item 0's donor run is item 1's own run (right, 0.6): not decisive
    # item 1's donor run is the extra run (wrong, said "blue" again, 0.7): decisive, strict
    assert [(p.z_real, p.z_hn, p.c_real, p.c_hn, p.strict) for p in pairs] == \
        [(True, True, 0.8, 0.6, False), (True, False, 0.6, 0.7, True)]


def test_paired_difference_of_auroc():
    rng = np.random.default_rng(0)
    z = rng.integers(0, 2, 200)
    a = z + rng.normal(0, 0.5, 200)
    b = z + rng.normal(0, 2.0, 200)
    clusters = [f"img{k // 2}" for k in range(200)]
    out = grounding.paired_vs("a", {"a": a, "b": b}, z, clusters, {}, bootstrap=300)
    want = roc_auc_score(z, a) - roc_auc_score(z, b)
    assert out["b"]["auroc"]["diff"] == pytest.approx(want)
    lo, hi = out["b"]["auroc"]["ci"]
    assert lo < want < hi and lo > 0
    assert out["b"]["auroc"]["nan_resamples"] == 0


def _heads(tau: float, alpha: float | None = None) -> Heads:
    """Heads with a policy at τ and, given α, a detector (only its presence is read)."""
    h = Heads(dim=2, policy=DeferPolicy(tau=tau, target_risk=0.05, delta=0.1, coverage=0.5,
                                        empirical_risk=0.0, risk_upper_bound=0.05,
                                        n_calibration=100, feasible=True))
    if alpha is not None:
        h.novelty, h.novelty_alpha = object(), alpha
    return h


def test_defer_rule_on_evaluated_data():
    c = np.array([0.95, 0.9, 0.85, 0.5, 0.2])
    z = np.array([1, 0, 1, 1, 0])
    d = grounding.defer_on(z, {"tau": _heads(0.85).defer_mask(c)}, tau=0.85, target_risk=0.05)
    assert d["coverage"] == pytest.approx(0.6) and d["risk"] == pytest.approx(1 / 3)
    assert d["risk_within_target"] is False and d["n_kept"] == 3
    d = grounding.defer_on(z, {"tau": _heads(0.92).defer_mask(c)}, tau=0.92, target_risk=0.05)
    assert (d["coverage"], d["risk"], d["risk_within_target"]) == (0.2, 0.0, True)
    # a novelty flag defers an item whatever its confidence: the 0.9 (wrong) one here
    heads = _heads(0.85, alpha=0.01)
    why = heads.defer_reasons(c, [0.5, 0.001, 0.5, 0.5, 0.001])
    del why["problem"]
    d = grounding.defer_on(z, why, tau=0.85, target_risk=0.05)
    assert d["coverage"] == pytest.approx(0.4) and d["risk"] == 0.0 and d["n_kept"] == 2
    assert d["novelty_flag_rate"] == pytest.approx(0.4)
    assert d["coverage_tau_only"] == pytest.approx(0.6)
    # a response that does not parse is deferred too: the 0.95 (right) one here
    why = heads.defer_reasons(c, [0.5, 0.5, 0.5, 0.5, 0.001], ["no answer tag", None, None,
                                                                None, None])
    d = grounding.defer_on(z, why, tau=0.85, target_risk=0.05)
    assert d["coverage"] == pytest.approx(0.4) and d["risk"] == pytest.approx(0.5)
    assert d["deferred_share"] == {"tau": pytest.approx(0.4), "novelty": pytest.approx(0.2),
                                   "problem": pytest.approx(0.2)}


def test_defer_mask_is_the_rule_item_by_item():
    """τ = 0.625, α = 0.05, by hand: below τ; p-value below α (0.05 itself and None do
    not flag); a problem; all fine; p-value flag without a detector is ignored."""
    p = [0.6, 0.7, 0.7, 0.7, 0.9, 0.9]
    nov = [None, 0.01, 0.05, None, 0.5, 0.2]
    problems = [None, None, None, None, "truncated", None]
    heads = _heads(0.625, alpha=0.05)
    np.testing.assert_array_equal(heads.defer_mask(p, nov, problems),
                                  [True, True, False, False, True, False])
    np.testing.assert_array_equal(_heads(0.625).defer_mask(p, nov, problems),
                                  [True, False, False, False, True, False])
    # without a policy everything is deferred
    assert Heads(dim=2).defer_mask(p).all()


def test_question_only_baseline():
    fit = [_item(0, "Is it red?", "yes", "A"), _item(1, "is it red", "no", "B"),
           _item(2, "Is it red?", "yes", "C"), _item(3, "What shape?", "circle", "D")]
    table = question_prior(fit, np.array([1, 0, 1, 1]))
    assert table == {"is it red": [2, 3], "what shape": [1, 1]}
    got = question_only(table, ["IS IT RED?", "what shape", "never seen?"])
    np.testing.assert_allclose(got, [(2 + 1) / (3 + 2), (1 + 1) / (1 + 2), (3 + 1) / (4 + 2)])


class _Words:
    """A tokenizer of whitespace-separated words (distinct ids: no repetition)."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def test_response_problems_as_the_service_sees_them(tmp_path):
    (tmp_path / "actor_card.json").write_text('{"response_format": "<answer>x</answer>"}')
    actor = type("A", (), {"folder": str(tmp_path), "tokenizer": _Words()})()
    got = response_problems(actor, ["<answer>red</answer>", "I think red",
                                    "<answer></answer>", "<answer>a b c d e f g h</answer>"],
                            max_new_tokens=8)
    # the last one has 8 words = the limit: it never reached its end
    assert got == [None, "no answer tag", "empty answer",
                   "truncated (no end of response within max_new_tokens)"]
    assert response_problems(actor, None, 8) is None
