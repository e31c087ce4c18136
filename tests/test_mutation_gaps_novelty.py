"""Tests for mutants of heads/novelty.py that the module's own tests did not see: what a
recalibrated copy keeps, the clean reference drift reads, a twice-extended reference, saving
and loading (a new folder, an unsorted calibration, default prefixes, a stale clean sample),
the message refusing an image part fitted with other descriptors, the float32 token
distances of features far from zero, the scoring caches kept between scores, and what an
image part's artefact records.

No actor is built; expectations are conformal p-values counted by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heads.novelty import Novelty


def _x(n: int, seed: int, d: int = 3) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(n, d)))


def test_recalibrated_keeps_kind_feature_k_and_the_bank_cap():
    nov = Novelty("knn", "img_mean", k=2, max_bank=7).fit(_x(20, 0)).calibrate(_x(9, 1))
    other = nov.recalibrated(_x(5, 2))
    assert (other.kind, other.feature, other.k, other.max_bank) == ("knn", "img_mean", 2, 7)
    q = _x(4, 3)
    assert np.array_equal(other.score(q), nov.score(q))       # k = 2, not the default 5
    tok = Novelty("token_knn", "img_token_set", max_bank=30).fit(
        torch.from_numpy(np.random.default_rng(4).normal(size=(6, 4, 3))))
    tok.calibrate(torch.from_numpy(np.random.default_rng(5).normal(size=(3, 4, 3))))
    copy = tok.recalibrated(torch.from_numpy(np.random.default_rng(6).normal(size=(3, 4, 3))))
    assert copy.max_bank == 30
    copy.extend_bank(torch.from_numpy(np.random.default_rng(7).normal(size=(10, 4, 3))))
    assert copy.t["bank"].shape[0] == 30                       # still capped


def test_clean_scores_are_the_sorted_calibration_scores():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(15, 0))
    assert nov.clean_scores() is None
    cal = _x(6, 1)
    nov.calibrate(cal)
    assert np.array_equal(nov.clean_scores(), np.sort(nov.score(cal)))


def test_a_reference_extended_twice_pools_both_streams():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(15, 0)).calibrate(_x(4, 1))
    q = _x(3, 9) * 4                                           # far: p = 1/5 against clean
    s = nov.score(q)
    first = nov.extend_reference(s[:1] + 1.0)
    both = first.extend_reference(np.r_[s[1:] + 1.0, -1.0])
    assert both.base is nov and np.array_equal(both.extra, np.sort(np.r_[s + 1.0, -1.0]))
    assert first.extra.tolist() == [s[0] + 1.0]                # the first one unchanged
    # against the pooled stream (4 scores): p = (1 + #{extra ≥ s}) / 5, counted
    pooled = np.r_[s + 1.0, -1.0]
    by_hand = np.array([(1 + (pooled >= v).sum()) / 5 for v in s])
    p = both.p_value(q)
    assert np.allclose(p, np.maximum(nov.p_value(q), by_hand))
    assert (by_hand > nov.p_value(q)).any()                    # the stream's reference counts
    for alpha in (0.3, 0.5, 0.7, 0.9):
        assert both.novel(q, alpha=alpha).tolist() == (p < alpha).tolist()
    assert both.novel(q, alpha=0.5).tolist() != nov.novel(q, alpha=0.5).tolist()


def test_a_knn_bank_takes_new_rows_and_a_bankless_kind_says_why_not():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(10, 0))
    far = _x(2, 1) + 50
    before = nov.score(far)
    nov.extend_bank(far)
    assert tuple(nov.t["bank"].shape) == (12, 3) and np.allclose(nov.score(far), 0, atol=1e-4)
    assert (before > 10).all()
    maha = Novelty("mahalanobis", "h_pre").fit(_x(10, 0))
    with pytest.raises(ValueError, match="mahalanobis has no reference bank"):
        maha.extend_bank(far)


def test_novel_is_a_p_value_strictly_below_alpha():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(15, 0)).calibrate(_x(4, 1))
    q = _x(2, 2) + 50                                          # beyond every reference
    assert np.allclose(nov.p_value(q), 1 / 5)
    assert not nov.novel(q, alpha=0.2).any()                   # p = α: not below it
    assert nov.novel(q, alpha=0.2001).all()


def test_reading_before_calibration_says_what_to_do():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(10, 0))
    with pytest.raises(RuntimeError, match="^calibrate on a clean split before asking for p-v"):
        nov.read({"h_pre": _x(2, 1)})


def test_a_composite_extends_the_named_parts_or_every_part():
    from heads.novelty import CompositeNovelty

    def parts() -> dict[str, Novelty]:
        return {"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(_x(4, 1)),
                "m": Novelty("knn", "img_mean", k=1).fit(_x(8, 2)).calibrate(_x(4, 3))}

    feats = {"h_pre": _x(3, 4), "img_mean": _x(3, 5)}
    one = CompositeNovelty(parts()).extend_bank(feats, ("q",))
    assert len(one.parts["q"].t["bank"]) == 13 and len(one.parts["m"].t["bank"]) == 8
    every = CompositeNovelty(parts()).extend_bank(feats)
    assert len(every.parts["q"].t["bank"]) == 13 and len(every.parts["m"].t["bank"]) == 11


def test_composite_reads_scores_below_zero_as_p_one_and_digests_uncalibrated_parts():
    from heads.novelty import CompositeNovelty

    part = Novelty("knn", "h_pre", k=1).fit(_x(10, 0))
    det = CompositeNovelty({"q": part})
    assert det.p_values_of(np.array([-1.0, 0.0, 2.0])) == pytest.approx([1.0, 1.0, 0.01])
    before = det._parts_digest()                       # a part without calibration: "-"
    part.calibrate(_x(4, 1))
    assert det._parts_digest() != before


def test_an_extended_reference_reads_the_base_score_and_the_larger_p_value():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(15, 0)).calibrate(_x(4, 1))
    q = _x(3, 9) * 4
    s = nov.score(q)
    ext = nov.extend_reference(np.r_[s + 1.0, -1.0])
    got = ext.read({"h_pre": q}, alpha=0.5)
    p = ext.p_value(q)
    assert [r.score for r in got] == pytest.approx(s.tolist())
    assert [r.p_value for r in got] == pytest.approx(p.tolist())
    assert [r.novel for r in got] == (p < 0.5).tolist()
    assert [r.novel for r in got] != [r.novel for r in nov.read({"h_pre": q}, alpha=0.5)]


def test_composite_card_names_its_parts_features():
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({
        "q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(_x(4, 1)),
        "m": Novelty("knn", "img_mean", k=1).fit(_x(8, 2)).calibrate(_x(6, 3))})
    card = det.to_dict()
    assert card["kind"] == "composite" and card["feature"] == "h_pre+img_mean"
    assert card["k"] is None and card["C"] is None and card["n_fit"] == 10
    assert card["n_calibration"] == 4 and card["n_clean_sample"] is None
    assert set(card["parts"]) == {"q", "m"} and card["parts"]["m"]["n_calibration"] == 6
    assert card["p_value"] == ("min(1, m * min_j p_j), p_j = (1 + #{i : s_i >= s(x)})"
                               " / (n_j + 1)")


def test_a_composite_saves_under_its_prefix_into_a_new_folder(tmp_path):
    from heads.novelty import CompositeNovelty, load_detector

    det = CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(
        _x(4, 1))}, clean=np.array([0.3, 0.1]))
    folder = tmp_path / "a" / "b"
    det.save(folder, "det")
    assert (folder / "det.safetensors").exists() and (folder / "det.q.json").exists()
    back = load_detector(folder, "det")
    assert back.clean.tolist() == [0.1, 0.3]


def test_an_extended_reference_flags_strictly_below_alpha():
    nov = Novelty("knn", "h_pre", k=1).fit(_x(15, 0)).calibrate(_x(4, 1))
    q = _x(2, 2) + 50                                          # beyond both references
    ext = nov.extend_reference(np.zeros(4))
    assert np.allclose(ext.p_value(q), 1 / 5)
    assert not any(r.novel for r in ext.read({"h_pre": q}, alpha=0.2))
    assert all(r.novel for r in ext.read({"h_pre": q}, alpha=0.2001))
    assert not ext.novel(q, alpha=0.2).any()                   # `novel` likewise: p = α
    assert ext.novel(q, alpha=0.2001).all()


def test_a_detector_saves_into_a_folder_not_made_yet_and_loads_under_its_prefix(tmp_path):
    from heads.novelty import load_detector

    nov = Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(_x(4, 1))
    folder = tmp_path / "a" / "b"                  # neither exists: save makes both
    nov.save(folder, "det")
    assert sorted(p.name for p in folder.iterdir()) == ["det.json", "det.safetensors"]
    back = load_detector(folder, "det")             # a plain detector, by its prefix
    q = _x(3, 2)
    assert isinstance(back, Novelty) and np.array_equal(back.p_value(q), nov.p_value(q))


def test_load_sorts_a_calibration_saved_out_of_order(tmp_path):
    nov = Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(_x(6, 1))
    cal = nov.t["calibration"].numpy().copy()
    nov.t["calibration"] = torch.from_numpy(cal[::-1].copy())     # as an older file may hold
    nov.save(tmp_path)
    back = Novelty.load(tmp_path)
    assert set(back.t) == set(nov.t)
    assert back.t["calibration"].tolist() == sorted(cal.tolist())
    q = _x(5, 2)
    s = back.score(q)
    by_hand = np.array([(1 + (cal >= v).sum()) / (len(cal) + 1) for v in s])
    assert np.array_equal(back.p_value(q), by_hand)
    # a detector saved before calibration loads without one
    Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).save(tmp_path, "bare")
    assert "calibration" not in Novelty.load(tmp_path, "bare").t


def test_a_composite_flags_a_combined_p_value_strictly_below_alpha():
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({
        "q": Novelty("knn", "h_pre", k=1).fit(_x(15, 0)).calibrate(_x(4, 1)),
        "m": Novelty("knn", "img_mean", k=1).fit(_x(15, 2)).calibrate(_x(4, 3))})
    feats = {"h_pre": _x(2, 4) + 50, "img_mean": _x(2, 5) + 50}   # beyond every reference
    p = det.p_values(feats)
    assert p.tolist() == [0.4, 0.4]                        # min(1, 2 · 1/5), exactly
    assert not any(r.novel for r in det.read(feats, alpha=0.4))    # p = α: not below it
    assert all(r.novel for r in det.read(feats, alpha=0.4001))


def test_a_stale_clean_sample_is_dropped_with_a_warning_that_says_what_to_do(tmp_path):
    import re

    from heads.novelty import CompositeNovelty, load_detector

    def det(seed: int) -> CompositeNovelty:
        return CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(
            _x(4, seed))})

    det(1).keep_clean_sample({"h_pre": _x(4, 1)}).save(tmp_path)
    det(2).parts["q"].save(tmp_path, "novelty.q")   # the part recalibrated since
    want = ("novelty.safetensors: the clean sample of the combined novelty score was read "
            "against other parts; ignored (drift has no reference for it until `dualread "
            "fit-detectors`)")
    with pytest.warns(UserWarning, match=f"^{re.escape(want)}$"):
        back = load_detector(tmp_path)
    assert back.clean_scores() is None


def test_save_clean_sample_writes_under_the_detector_prefix_by_default(tmp_path):
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(
        _x(4, 1))}, clean=np.array([0.2, 0.5]))
    det.save_clean_sample(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["novelty.safetensors"]


def _layout_part(**kw):
    from heads.layout_novelty import LayoutNovelty

    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.random((12, LayoutNovelty.DIM)))
    return LayoutNovelty(**kw).fit(x[:8]).calibrate(x[8:])


def test_an_image_part_recalibrated_keeps_its_feature_k_and_bank_cap():
    part = _layout_part(feature="layout_b", k=3, max_bank=9)
    copy = part.recalibrated(torch.from_numpy(np.random.default_rng(1).random((3, part.DIM))))
    assert (copy.kind, copy.feature, copy.k, copy.max_bank) == ("layout_knn", "layout_b", 3, 9)
    assert {k: v for k, v in copy.to_dict().items() if k != "n_calibration"} == \
        {k: v for k, v in part.to_dict().items() if k != "n_calibration"}
    copy.extend_bank(torch.from_numpy(np.random.default_rng(2).random((5, part.DIM))))
    assert len(copy.t["bank"]) == 9                            # 8 + 5 rows, capped at 9


def test_an_image_part_loads_from_the_default_prefix(tmp_path):
    from heads.layout_novelty import LayoutNovelty

    part = _layout_part()
    part.save(tmp_path)
    back = LayoutNovelty.load(tmp_path)
    assert np.array_equal(back.t["bank"].numpy(), part.t["bank"].numpy())


def test_an_image_part_with_other_descriptors_is_refused_naming_each_mismatch(tmp_path):
    from heads.layout_novelty import DESCRIBED, SIDE, LayoutNovelty
    from tests.helpers import edit_card

    _layout_part().save(tmp_path, "p")
    edit_card(tmp_path / "p.json", "side", 128)
    edit_card(tmp_path / "p.json", "descriptor", None)          # deleted
    with pytest.raises(ValueError) as e:
        LayoutNovelty.load(tmp_path, "p")
    assert str(e.value) == (
        f"layout novelty part p in {tmp_path} was fitted with other descriptors; refit it "
        f"(`dualread fit-detectors`). side: the part records 128, this code computes "
        f"{SIDE!r}; descriptor: the part records 'nothing', this code computes "
        f"{DESCRIBED['descriptor']!r}")


def test_an_image_part_bank_of_other_width_is_refused_naming_both_widths(tmp_path):
    from heads.layout_novelty import LayoutNovelty

    part = _layout_part()
    part.t["bank"] = part.t["bank"][:, :-2].contiguous()
    part.save(tmp_path, "p")
    with pytest.raises(ValueError) as e:
        LayoutNovelty.load(tmp_path, "p")
    assert str(e.value).endswith(f"(`dualread fit-detectors`). bank: rows of "
                                 f"[{part.DIM - 2}] values, this code describes by {part.DIM}")


def test_an_image_part_card_counts_its_bank_rows():
    from heads.layout_novelty import LayoutNovelty

    part = _layout_part(max_bank=6)                            # 8 fitting rows, capped at 6
    assert part.to_dict()["bank"] == 6 == len(part.t["bank"]) != part.DIM
    assert _layout_part().to_dict()["bank"] == 8
    assert LayoutNovelty().to_dict()["bank"] == 0              # not fitted: no bank yet


def test_only_a_logistic_detector_card_names_its_c():
    from heads.novelty import LOGISTIC_C

    assert Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).to_dict()["C"] is None
    assert Novelty("mahalanobis", "h_pre").fit(_x(10, 0)).to_dict()["C"] is None
    logistic = Novelty("logistic", "h_pre").fit(_x(10, 0), _x(10, 1) + 3)
    assert logistic.to_dict()["C"] == LOGISTIC_C == 0.1


def test_a_score_read_again_is_found_in_the_calibration_within_its_tolerance():
    from heads.novelty import SAME_SCORE, _in_calibration

    cal = np.array([0.0, 10.0, 20.0, 30.0])
    s = np.array([20.0 * (1 + SAME_SCORE / 2), 25.0, -np.inf, np.inf, 1.5 * SAME_SCORE])
    own, lo = _in_calibration(cal, s)
    # 20.0001 is 20.0 read again (its last bits moved: within SAME_SCORE · (1 + |s|));
    # 25.0 is no calibration score; the infinite scores (an item without image tokens)
    # match none; 1.5e-5 is beyond 0.0's tolerance (1e-5 · (1 + 1.5e-5))
    assert own.tolist() == [True, False, False, False, False]
    assert lo.tolist() == [2, 3, 0, 4, 1]
    # near 0 the absolute part of the tolerance holds: 0.5e-5 is 0.0 read again
    assert _in_calibration(cal, np.array([0.5 * SAME_SCORE]))[0].tolist() == [True]
    # a calibration item without image tokens (score -inf) read again is its own copy
    own, lo = _in_calibration(np.array([-np.inf, 1.0]), np.array([-np.inf, 1.0]))
    assert own.tolist() == [True, True] and lo.tolist() == [0, 1]


def test_a_clean_sample_row_outside_the_calibration_is_read_as_a_fresh_input():
    from heads.novelty import CompositeNovelty

    q = Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).calibrate(_x(4, 1))
    det = CompositeNovelty({"q": q})
    cal = np.sort(q.score(_x(4, 1)))
    rows = torch.cat([_x(4, 1), _x(1, 2) + 50, _x(10, 0)[:1]])   # own, far, a bank row
    got = det.clean_sample({"h_pre": rows})
    own = [(cal >= v).sum() / 4 for v in q.score(_x(4, 1))]      # leave-one-out
    # fresh rows: (1 + #{s_i >= s}) / (n + 1): beyond every score 1/5, at zero 5/5
    want = -np.log10(np.r_[own, 1 / 5, 1.0])
    assert got == pytest.approx(want.tolist())
    assert got[4] == pytest.approx(np.log10(5))


def test_a_clean_sample_of_an_uncalibrated_part_says_what_to_do():
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0))})
    want = "^calibrate on a clean split before a clean sample$"
    with pytest.raises(RuntimeError, match=want):
        det.clean_sample({"h_pre": _x(2, 1)})
    with pytest.raises(RuntimeError, match=want):
        det.calibration_share({"h_pre": _x(2, 1)})


def test_an_unknown_feature_is_refused_naming_the_known_ones():
    import re

    from heads.novelty import FEATURES, features

    with pytest.raises(ValueError) as e:
        features("nope", {"h_pre": _x(2, 0)})
    assert str(e.value) == f"unknown novelty feature 'nope'; known: {', '.join(FEATURES)}"
    assert re.search(r"known: h_pre, h_close, h_mid, img_mean, ", str(e.value))


def test_refusals_of_an_empty_composite_and_an_uncalibrated_part_by_their_words():
    from heads.novelty import CompositeNovelty

    with pytest.raises(ValueError, match="^a composite detector needs at least one part$"):
        CompositeNovelty({})
    with pytest.raises(RuntimeError,
                       match="^calibrate on a clean split before asking for p-values$"):
        Novelty("knn", "h_pre", k=1).fit(_x(10, 0)).p_value(_x(2, 1))


def test_a_composite_keeps_its_clean_sample_as_sorted_floats():
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0))},
                           clean=np.array([3, 1, 2]))
    assert det.clean.dtype == np.float64 and det.clean.tolist() == [1.0, 2.0, 3.0]


def test_token_sets_without_any_token_score_minus_infinity():
    g = np.random.default_rng(4)
    nov = Novelty("token_knn", "img_token_set", max_bank=30).fit(
        torch.from_numpy(g.normal(size=(6, 4, 3))))
    empty = torch.full((2, 4, 3), float("nan"), dtype=torch.float64)   # no token at all
    assert nov.score(empty).tolist() == [-np.inf, -np.inf]


def test_the_scores_by_hand_and_the_fit_refusals_word_for_word():
    """Each kind's score from its fitted terms set by hand (a Mahalanobis location away from
    0, a logistic intercept: fitted on standardised data both sit near 0, where a sign
    slip shows in no fit); the refusals of a wrong input say what to pass."""
    maha = Novelty("mahalanobis", "x")
    maha.t = {"mean": torch.zeros(2, dtype=torch.float64), "scale": torch.ones(2).double(),
              "location": torch.tensor([1.0, 2.0]).double(),
              "precision": torch.tensor([[4.0, 0.0], [0.0, 1.0]]).double()}
    x = torch.tensor([[1.0, 2.0], [2.0, 2.0], [1.0, 5.0]]).double()
    assert maha.score(x).tolist() == pytest.approx([0.0, 2.0, 3.0])
    logistic = Novelty("logistic", "x")
    logistic.t = {"mean": torch.zeros(2).double(), "scale": torch.ones(2).double(),
                  "coef": torch.tensor([1.0, -2.0]).double(),
                  "intercept": torch.tensor([0.5]).double()}
    assert logistic.score(x).tolist() == pytest.approx([-2.5, -1.5, -8.5])
    with pytest.raises(ValueError, match="^logistic needs x_shifted; the other kinds take "
                                         "clean data only$"):
        Novelty("logistic", "x").fit(x)
    with pytest.raises(ValueError, match=r"^token_knn takes \[N, M, D\] features$"):
        Novelty("token_knn", "x").fit(x)
    with pytest.raises(ValueError, match=r"^knn takes \[N, D\] features$"):
        Novelty("knn", "x").fit(x[None])


def test_a_capped_token_bank_is_distinct_rows_of_the_tokens_the_same_each_fit():
    rng = np.random.default_rng(3)
    tokens = torch.from_numpy(rng.normal(size=(40, 5, 3)))
    banks = [Novelty("token_knn", "img_tokens", k=1, max_bank=60).fit(tokens).t["bank"]
             for _ in range(2)]
    assert torch.equal(banks[0], banks[1]) and len(banks[0]) == 60
    rows = {tuple(r.tolist()) for r in banks[0]}
    assert len(rows) == 60                                   # no row drawn twice
    z = Novelty("token_knn", "img_tokens", k=1, max_bank=10 ** 6).fit(tokens).t["bank"]
    assert rows <= {tuple(r.tolist()) for r in z}


def test_min_scale_floors_each_features_standardisation_scale():
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.normal(size=(50, 3)) * np.array([0.01, 1.0, 3.0]))
    plain = Novelty("knn", "x", k=1).fit(x)
    floor = torch.tensor([0.5, 0.5, 0.5])
    n = Novelty("knn", "x", k=1).fit(x, min_scale=floor)
    assert torch.equal(n.t["scale"], torch.maximum(plain.t["scale"], floor.double()))
    assert n.t["scale"][0] == 0.5 and n.t["scale"][2] == plain.t["scale"][2]
    fresh = Novelty()
    assert (fresh.kind, fresh.feature, fresh.k, fresh.n_fit) == ("mahalanobis", "img_mean", 5, 0)


def test_the_logistic_kind_is_l2_regularised_at_its_stated_strength():
    from sklearn.linear_model import LogisticRegression

    from heads.novelty import LOGISTIC_C

    rng = np.random.default_rng(6)
    x = torch.from_numpy(rng.normal(size=(60, 2)))
    shifted = torch.from_numpy(rng.normal(size=(40, 2)) + [0.8, -0.4])
    n = Novelty("logistic", "x").fit(x, shifted)
    z, zs = n._std(x.double()), n._std(shifted.double())
    want = LogisticRegression(C=LOGISTIC_C, max_iter=5000).fit(
        torch.cat([z, zs]).numpy(), np.r_[np.zeros(60), np.ones(40)])
    assert n.t["coef"].numpy() == pytest.approx(want.coef_[0], rel=1e-6)
    assert n.t["intercept"].numpy() == pytest.approx(want.intercept_, rel=1e-6)


def test_token_distances_stay_exact_for_features_far_from_zero():
    """`token_knn` reads distances in float32 as |a|² + |b|² − 2a·b: the standardisation's
    per-feature centring keeps |a|² small, so a token 0.03 off a fitting one scores 0.03 /
    scale even when the features sit near 1000 (centred elsewhere, the float32 sums of
    millions cancel to 0 or 1)."""
    g = np.random.default_rng(0)
    x = torch.from_numpy(g.normal(size=(6, 4, 3)) + np.array([1000.0, -500.0, 30.0]))
    nov = Novelty("token_knn", "img_token_set").fit(x)
    assert nov.t["mean"].shape == (3,)                         # one mean per feature
    q = x[:2] + torch.tensor([0.03, 0.0, 0.0], dtype=torch.float64)
    want = 0.03 / nov.t["scale"][0].item()
    assert nov.score(q) == pytest.approx([want, want], rel=1e-3)


@pytest.mark.parametrize("kind,cache", [("knn", "_b2"), ("token_knn", "_b32")])
def test_scoring_a_prepared_detector_builds_nothing_again(kind, cache, monkeypatch):
    """`prepare` builds what scoring reads from the bank so that the first score costs
    what later ones do: scores read that cache and leave it as it is until the bank
    changes (a cache rebuilt on each score gives the same numbers, slower)."""
    import heads.novelty as hn

    x = torch.from_numpy(np.random.default_rng(1).normal(size=(24, 3)))
    nov = Novelty(kind, "x", k=1).fit(x if kind == "knn" else x.reshape(6, 4, 3)).prepare()
    kept = getattr(nov, cache)
    seen = []
    real = hn.kth_distance
    monkeypatch.setattr(hn, "kth_distance", lambda z, bank, k, b2=None:
                        seen.append(b2) or real(z, bank, k, b2))
    q = _x(2, 2) if kind == "knn" else _x(8, 2).reshape(2, 4, 3)
    first = nov.score(q)
    assert getattr(nov, cache) is kept and np.array_equal(nov.score(q), first)
    assert getattr(nov, cache) is kept
    if kind == "knn":                               # the kept norms, not recomputed
        assert len(seen) == 2 and all(b2 is kept[1] for b2 in seen)


def test_a_composite_read_before_calibration_says_what_to_do():
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0))})
    with pytest.raises(RuntimeError) as e:
        det.read({"h_pre": _x(2, 1)})
    assert str(e.value) == "calibrate on a clean split before asking for p-values"


def test_combined_p_values_of_float32_scores_are_read_in_double_precision():
    """Scores stored in float32 give the p-values of the same numbers as float64: the
    powers of ten are taken in double precision, as `Novelty.p_values_of` does."""
    from heads.novelty import CompositeNovelty

    det = CompositeNovelty({"q": Novelty("knn", "h_pre", k=1).fit(_x(10, 0))})
    s32 = np.array([2.5, 0.5], dtype=np.float32)              # exact in float32
    p = det.p_values_of(s32)
    assert p.dtype == np.float64 and p.tolist() == det.p_values_of(s32.astype(float)).tolist()
    assert p.tolist() == [10.0 ** -2.5, 10.0 ** -0.5]


def test_an_image_part_records_mean_0_scale_1_and_its_defaults(tmp_path):
    """An image part's inputs are not standardised: its artefact records mean 0 and scale
    1 (float64, one per descriptor value, not per patch or image), and its card k = 1 and,
    unfitted, n_fit = 0."""
    from heads.pixel_novelty import DIM, PixelNovelty

    bare = PixelNovelty().to_dict()
    assert (bare["k"], bare["n_fit"], bare["bank"]) == (1, 0, 0)
    x = torch.from_numpy(np.random.default_rng(0).random((2, 5, DIM)))   # N, P ≠ DIM
    PixelNovelty().fit(x).save(tmp_path, "p")
    back = PixelNovelty.load(tmp_path, "p")
    assert back.k == 1 and back.n_fit == 2
    for key, value in (("mean", 0.0), ("scale", 1.0)):
        t = back.t[key]
        assert t.dtype == torch.float64 and t.tolist() == [value] * DIM
