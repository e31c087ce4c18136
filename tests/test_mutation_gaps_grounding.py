"""Grounding's accounting on constructed cases (mutation gaps of heads/grounding.py): the
defer rule's counts and their edges, donor runs gathered from both places, the strict flag,
the underpowered threshold, the paired differences and what each row holds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clients.maths import Pair, ccg_auc
from heads import grounding
from heads.metrics import auroc
from models.data import Item


def _item(k: int, q: str, a: str, img: str) -> Item:
    return Item(id=f"i{k}", image_path=f"{img}.png", question=q, answer=a, image_id=img)


# ------------------------------------------------------------------ the defer rule
def test_defer_on_counts_each_reason_and_the_union():
    z = np.array([1, 0, 1, 1, 0])
    why = {"tau": np.array([0, 0, 1, 0, 1], bool), "novelty": np.array([0, 1, 1, 0, 0], bool),
           "problem": [False] * 5}
    d = grounding.defer_on(z, why, tau=0.6, target_risk=0.0)
    assert d["n_kept"] == 2 and d["coverage"] == pytest.approx(0.4)
    assert d["risk"] == 0.0 and d["risk_within_target"] is True     # risk = r is within
    assert d["deferred_share"] == {"tau": 0.4, "novelty": 0.4, "problem": 0.0}
    assert d["novelty_flag_rate"] == 0.4 and "image_flag_rate" not in d
    assert d["coverage_tau_only"] == pytest.approx(0.6)
    assert d["tau"] == 0.6 and d["target_risk"] == 0.0
    assert isinstance(d["tau"], float) and isinstance(d["n_kept"], int)


def test_defer_on_risk_just_over_the_target_and_nothing_kept():
    z = np.array([1, 0, 1, 1])
    d = grounding.defer_on(z, {"tau": np.zeros(4, bool)}, tau=0.1, target_risk=0.25)
    assert d["risk"] == 0.25 and d["risk_within_target"] is True
    d = grounding.defer_on(z, {"tau": np.zeros(4, bool)}, tau=0.1, target_risk=0.2499)
    assert d["risk_within_target"] is False
    assert "novelty_flag_rate" not in d and "image_flag_rate" not in d
    d = grounding.defer_on(z, {"tau": np.ones(4, bool)}, tau=0.9, target_risk=0.5)
    assert d["n_kept"] == 0 and d["coverage"] == 0.0 and math.isnan(d["risk"])
    assert d["risk_within_target"] is False
    # without a "tau" reason there is no τ-only coverage; no items: shares are NaN
    d = grounding.defer_on(z, {"problem": np.array([1, 0, 0, 0], bool)}, tau=0.5,
                           target_risk=0.5)
    assert "coverage_tau_only" not in d and d["n_kept"] == 3
    e = grounding.defer_on(np.zeros(0, int), {"tau": np.zeros(0, bool)}, 0.5, 0.1)
    assert math.isnan(e["coverage"]) and math.isnan(e["deferred_share"]["tau"])


@pytest.mark.filterwarnings("error")
def test_defer_on_with_nothing_kept_or_no_items_takes_no_empty_mean():
    # NaN from the guards, without numpy's "Mean of empty slice" warning
    d = grounding.defer_on(np.array([1, 0]), {"tau": np.ones(2, bool)}, 0.9, 0.5)
    assert d["n_kept"] == 0 and math.isnan(d["risk"])
    e = grounding.defer_on(np.zeros(0, int), {"tau": np.zeros(0, bool)}, 0.5, 0.1)
    assert math.isnan(e["coverage"]) and math.isnan(e["coverage_tau_only"])
    assert math.isnan(e["deferred_share"]["tau"]) and math.isnan(e["risk"])


# ------------------------------------------------------------------ types
def test_answer_types_by_canonical_gold():
    assert grounding.answer_type("Yes.") == "yes/no"
    assert grounding.answer_type("NO") == "yes/no"
    assert grounding.answer_type("Red") == "colour"
    assert grounding.answer_type("triangle") == "shape"
    assert grounding.answer_type("three") == "other"


def test_auroc_by_type_rows():
    c = np.array([.9, .1, .8, .7, .7, .6, .5])
    z = np.array([1, 0, 1, 1, 0, 1, 0])
    out = grounding.auroc_by_type(c, z, ["b", "a", "b", "a", "b", "b", "c"])
    assert list(out) == ["a", "b", "c"]
    assert out["a"] == {"auroc": 1.0, "n": 2, "accuracy": 0.5}
    assert out["b"]["n"] == 4 and out["b"]["accuracy"] == 0.75
    assert out["b"]["auroc"] == auroc(c[[0, 2, 4, 5]], z[[0, 2, 4, 5]]) != 1.0
    assert math.isnan(out["c"]["auroc"]) and out["c"]["n"] == 1


# ------------------------------------------------------------------ donors
def test_extra_items_take_the_donor_image_and_answer_with_the_source_question():
    items = [_item(0, "q0?", "red", "A"), _item(1, "q1?", "blue", "B"),
             _item(2, "q2?", "green", "C")]
    plan = grounding.DonorPlan(source=[0, 1, 2], donor=[items[1], items[2], items[0]],
                               reuse=[None, 2, None])
    extra = grounding.extra_items(items, plan)
    assert [(e.id, e.question, e.answer, e.image_id) for e in extra] == [
        ("i0@hn:i1", "q0?", "blue", "B"), ("i2@hn:i0", "q2?", "red", "A")]


def test_donor_runs_interleave_main_and_extra_runs_in_plan_order():
    items = [_item(k, "q?", a, img) for k, (a, img) in enumerate(
        [("red", "A"), ("blue", "B"), ("green", "C"), ("red", "D")])]
    plan = grounding.DonorPlan(source=[0, 1, 2, 3],
                               donor=[items[1], items[2], items[3], items[0]],
                               reuse=[None, 2, None, 0])
    z = np.array([1, 0, 1, 1])
    runs = grounding.donor_runs(plan, z, ["red", "blue", "green", "red"],
                                {"m": np.array([.1, .2, .3, .4])},
                                np.array([0, 1]), ["x", "y"], {"m": np.array([.7, .8])})
    assert runs.z.tolist() == [0, 1, 1, 1] and runs.z.dtype.kind == "i"
    assert runs.canonical == ["x", "green", "y", "red"]
    assert runs.scores["m"].tolist() == [.7, .3, .8, .1]
    assert runs.image_ids == ["B", "C", "D", "A"]
    # a method without extra scores cannot fill the extra runs
    with pytest.raises(IndexError):
        grounding.donor_runs(plan, z, ["a"] * 4, {"k": np.arange(4.0)}, np.array([0, 1]),
                             ["x", "y"], {})


def test_pairs_are_strict_only_on_the_same_non_empty_answer():
    items = [_item(k, "q?", "red", f"I{k}") for k in range(3)]
    plan = grounding.DonorPlan(source=[0, 1, 2], donor=items[::-1], reuse=[2, 1, 0])
    runs = grounding.DonorRuns(np.array([0, 0, 0]), ["red", "", "blue"],
                               {"m": np.array([.1, .2, .3])}, ["x", "y", "z"])
    pairs = grounding.pairs_for(plan, items, np.array([1, 1, 0]), ["red", "", "red"],
                                np.array([.9, .8, .7]), runs, "m")
    assert [p.strict for p in pairs] == [True, False, False]
    assert [(p.item_id, p.image_id, p.z_real, p.c_real, p.c_hn) for p in pairs] == [
        ("i0", "I0", True, .9, .1), ("i1", "I1", True, .8, .2), ("i2", "I2", False, .7, .3)]


# ------------------------------------------------------------------ summaries
def _pairs(n: int) -> list[Pair]:
    return [Pair(f"i{k}", f"img{k}", True, False, 0.9 if k % 4 else 0.2, 0.5, k % 2 == 0)
            for k in range(n)]


def test_underpowered_at_thirty_images():
    p = _pairs(60)                 # 30 strict, 60 natural, one image each
    s = grounding.ccg_summary(p, [f"d{k}" for k in range(60)], bootstrap=0)
    assert s["ccg_natural_underpowered"] is False and s["ccg_strict_underpowered"] is False
    assert s["ccg_strict_n_decisive"] == 30 and s["ccg_strict_source_images"] == 30
    assert s["ccg_strict_donor_images"] == 30
    assert "ccg_natural_ci" not in s
    s = grounding.ccg_summary(_pairs(58), [f"d{k}" for k in range(58)], bootstrap=0)
    assert s["ccg_strict_underpowered"] is True and s["ccg_natural_underpowered"] is False


def test_ccg_intervals_resample_their_own_statistic():
    p = _pairs(12)
    s = grounding.ccg_summary(p, [f"d{k}" for k in range(12)], bootstrap=300, seed=3)
    assert s["ccg_natural"] == ccg_auc(p) and s["ccg_strict"] == ccg_auc(p, True)
    assert s["ccg_natural"] != s["ccg_strict"]
    assert s["ccg_natural_ci"] != s["ccg_strict_ci"]
    assert s["ccg_natural_ci"][0] <= s["ccg_natural"] <= s["ccg_natural_ci"][1]
    assert s["ccg_strict_ci_nan_resamples"] >= 0
    assert grounding.ccg_summary(p, [f"d{k}" for k in range(12)], bootstrap=300, seed=3) == s
    assert grounding.ccg_summary(p, [f"d{k}" for k in range(12)], bootstrap=300,
                                 seed=4)["ccg_natural_ci"] != s["ccg_natural_ci"]


def test_paired_diff_without_and_with_the_bootstrap():
    clusters = [f"c{k // 2}" for k in range(40)]
    u, v = np.random.default_rng(5).normal(size=(2, 40))
    v = v + 0.5
    a = lambda i: float(u[i].mean())                                 # noqa: E731
    b = lambda i: float(v[i].mean())                                 # noqa: E731
    every = np.arange(40)
    assert grounding.paired_diff(clusters, a, b, bootstrap=0) == {"diff": a(every) - b(every)}
    out = grounding.paired_diff(clusters, a, b, bootstrap=200, seed=1)
    lo, hi = out["ci"]
    assert lo < out["diff"] < hi and out["nan_resamples"] == 0
    assert grounding.paired_diff(clusters, a, b, bootstrap=200, seed=2)["ci"] != out["ci"]


def test_paired_vs_skips_the_reference_and_needs_pairs_of_both():
    rng = np.random.default_rng(0)
    z = (rng.uniform(size=40) < 0.5).astype(int)
    scores = {"ref": z + rng.normal(0, .3, 40), "m": rng.normal(size=40),
              "k": z + rng.normal(0, 1, 40)}
    clusters = [f"c{k}" for k in range(40)]
    pairs = {"ref": _pairs(20), "m": [Pair(p.item_id, p.image_id, p.z_real, p.z_hn, 0.1,
                                           0.9, p.strict) for p in _pairs(20)]}
    out = grounding.paired_vs("ref", scores, z, clusters, pairs, bootstrap=50)
    assert set(out) == {"m", "k"}
    assert out["m"]["auroc"]["diff"] == pytest.approx(auroc(scores["ref"], z)
                                                      - auroc(scores["m"], z))
    assert out["k"]["auroc"]["diff"] == pytest.approx(auroc(scores["ref"], z)
                                                      - auroc(scores["k"], z))
    assert out["m"]["ccg_natural"]["diff"] == pytest.approx(ccg_auc(pairs["ref"])
                                                            - ccg_auc(pairs["m"]))
    assert "ccg_natural" not in out["k"]
    assert "ci" in out["m"]["ccg_natural"]
    assert "ccg_natural" not in grounding.paired_vs("ref", scores, z, clusters,
                                                    {"m": pairs["m"]}, bootstrap=0)["m"]


def test_plan_donors_uses_its_seed_and_skips_items_without_a_donor():
    from models.data import HardNegativeIndex

    items = [_item(9, "Is there a circle?", "yes", "Z")]   # no donor: first, not last
    items += [_item(k, "What color is the shape?", c, f"I{k}")
              for k, c in enumerate(["red", "blue", "green", "teal", "red", "blue"])]
    for seed in (0, 3):
        plan = grounding.plan_donors(items, seed=seed)
        index = HardNegativeIndex(items, seed)
        assert plan.source == list(range(1, len(items)))
        assert [d.id for d in plan.donor] == [index.assign(it).id for it in items[1:]]


def test_each_extra_run_is_read_once_in_order():
    items = [_item(k, "q?", a, f"I{k}") for k, a in enumerate(["red", "blue", "green"])]
    plan = grounding.DonorPlan(source=[0, 1, 2], donor=[items[1], items[2], items[0]],
                               reuse=[None, None, None])
    runs = grounding.donor_runs(plan, np.array([1, 1, 1]), ["red", "blue", "green"],
                                {"m": np.array([1, 2, 3])}, np.array([0, 1, 0]),
                                ["x", "y", "z"], {"m": np.array([7, 8, 9])})
    assert runs.canonical == ["x", "y", "z"] and runs.z.tolist() == [0, 1, 0]
    assert runs.scores["m"].tolist() == [7.0, 8.0, 9.0]
    assert runs.scores["m"].dtype == np.float64              # confidences, whatever came in
    # a method without scores on the extra runs cannot be filled in
    one = grounding.DonorPlan(source=[0], donor=[items[1]], reuse=[None])
    with pytest.raises(IndexError):
        grounding.donor_runs(one, np.array([1]), ["red"], {"m": np.array([0.5])},
                             np.array([0]), ["x"], {})


def test_ccg_interval_is_the_cluster_bootstrap_with_the_given_count():
    from clients.maths import resample_clusters_counted

    p = _pairs(12)
    s = grounding.ccg_summary(p, [f"d{k}" for k in range(12)], bootstrap=300, seed=3)
    lo, hi, nan = resample_clusters_counted([q.image_id for q in p],
                                            lambda i: ccg_auc([p[k] for k in i]), 300, 3)
    assert s["ccg_natural_ci"] == (lo, hi) and s["ccg_natural_ci_nan_resamples"] == nan


def test_paired_intervals_are_seeded_and_resample_the_given_count():
    # `paired_diff`'s interval is the cluster bootstrap with its count and seed (the same on
    # every call), and `paired_vs` passes its count on to both of its intervals
    from clients.maths import resample_clusters_counted

    rng = np.random.default_rng(2)
    z = (rng.uniform(size=30) < 0.5).astype(int)
    scores = {"ref": z + rng.normal(0, .8, 30), "m": z + rng.normal(0, 1.5, 30)}
    clusters = [f"c{k // 2}" for k in range(30)]
    ref = lambda i: auroc(scores["ref"][i], z[i])                     # noqa: E731
    m = lambda i: auroc(scores["m"][i], z[i])                         # noqa: E731
    lo, hi, nan = resample_clusters_counted(clusters, lambda i: ref(i) - m(i), 40, 1)
    got = grounding.paired_diff(clusters, ref, m, bootstrap=40, seed=1)
    assert got["ci"] == (lo, hi) and got["nan_resamples"] == nan
    assert grounding.paired_diff(clusters, ref, m, bootstrap=40, seed=1) == got
    pairs = {"ref": _pairs(16), "m": [Pair(p.item_id, p.image_id, p.z_real, p.z_hn, 0.1, 0.9,
                                           p.strict) for p in _pairs(16)][::-1]}
    out = grounding.paired_vs("ref", scores, z, clusters, pairs, bootstrap=40)["m"]
    assert out["auroc"]["ci"] == resample_clusters_counted(
        clusters, lambda i: ref(i) - m(i), 40, 42)[:2]
    a, b = pairs["ref"], pairs["m"]
    assert out["ccg_natural"]["ci"] == resample_clusters_counted(
        [p.image_id for p in a], lambda i: ccg_auc([a[k] for k in i]) - ccg_auc([b[k] for k in i]),
        40, 42)[:2]
