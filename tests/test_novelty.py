"""Novelty scores and their conformal p-values (docs/method.md §8)."""

import numpy as np
import pytest
import torch
from scipy.stats import binom
from sklearn.covariance import LedoitWolf
from sklearn.neighbors import NearestNeighbors

from heads.novelty import Novelty, features, p_values


def gaussian(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 3.0, d)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * scales + 2.0


def test_p_value_formula_on_a_hand_computed_case():
    cal = np.array([0.5, 1.0, 2.0, 3.0])                 # n = 4
    got = p_values(cal, np.array([1.5, 2.0, 0.0, 9.0, 3.0]))
    # #{s_i >= s}: 1.5 -> 2, 2.0 -> 2 (ties count), 0.0 -> 4, 9.0 -> 0, 3.0 -> 1
    assert np.allclose(got, [3 / 5, 3 / 5, 5 / 5, 1 / 5, 2 / 5])


def test_p_value_through_a_fitted_score_on_a_hand_case():
    # 1-D Mahalanobis is monotone in |x - mean|; fit data symmetric around 0.
    nov = Novelty("mahalanobis", "h_pre").fit(torch.tensor([[-1.0], [1.0], [-2.0], [2.0]]))
    nov.calibrate(torch.tensor([[0.5], [-1.0], [2.0], [-3.0]]))
    got = nov.p_value(torch.tensor([[1.5], [-2.0], [0.0], [10.0]]))
    assert np.allclose(got, [3 / 5, 3 / 5, 5 / 5, 1 / 5])


def test_recalibrated_keeps_the_fit_and_leaves_the_original_alone():
    nov = Novelty("mahalanobis", "h_pre").fit(torch.tensor([[-1.0], [1.0], [-2.0], [2.0]]))
    nov.calibrate(torch.tensor([[0.5], [-1.0], [2.0], [-3.0]]))
    other = nov.recalibrated(torch.tensor([[0.1], [0.2]]))
    q = torch.tensor([[0.15], [5.0]])
    assert np.allclose(other.score(q), nov.score(q))                  # same fit
    assert np.allclose(other.p_value(q), [2 / 3, 1 / 3])              # its own reference
    assert np.allclose(nov.p_value(q), [5 / 5, 1 / 5])                # the original's


def test_clean_flag_rates_by_hand():
    """In sample on both splits, and out of sample (calibrated on one, read on the other,
    averaged): a 1-D score monotone in |x|, so every p-value is worked out by hand."""
    from heads.fit import clean_flag_rates

    nov = Novelty("mahalanobis", "h_pre").fit(torch.tensor([[-1.0], [1.0], [-2.0], [2.0]]))
    x = torch.tensor([[0.1], [0.2], [3.0], [0.5], [5.0]])
    first, second = torch.tensor([0, 1, 2]), torch.tensor([3, 4])
    nov.calibrate(x)
    got = clean_flag_rates(nov, x, first, second, 0.5)
    # all five: p = 6/6, 5/6, 4/6, 3/6, 2/6 -> only 5.0 is below 0.5
    assert got["calibration_flag_rate"] == pytest.approx(1 / 5)
    # on (0.1, 0.2, 3.0), read (0.5, 5.0): p = 2/4, 1/4 -> 1 of 2; on (0.5, 5.0), read
    # (0.1, 0.2, 3.0): p = 3/3, 3/3, 2/3 -> 0 of 3; in sample both would be 0
    assert got["cross_flag_rate"] == pytest.approx(0.25)


@pytest.mark.parametrize("kind", ["mahalanobis", "knn"])
def test_clean_p_values_are_valid_and_near_uniform(kind):
    nov = Novelty(kind, "h_pre").fit(gaussian(400, 6, 0)).calibrate(gaussian(400, 6, 1))
    p = nov.p_value(gaussian(4000, 6, 2))
    for alpha in (0.01, 0.05, 0.1, 0.3):
        # P[p <= α] <= α for exchangeable data; slack: binomial 99.9% quantile over 4000
        # test draws, on top of the calibration draw's own spread (≈ 1/sqrt(n) scale).
        slack = binom.ppf(0.999, 4000, alpha) / 4000 - alpha + 0.02
        share = float((p <= alpha).mean())
        assert share <= alpha + slack, (alpha, share)
        assert share >= alpha - slack, (alpha, share)    # near uniform, not just valid


@pytest.mark.parametrize("kind", ["mahalanobis", "knn"])
def test_far_points_get_the_smallest_p_value(kind):
    nov = Novelty(kind, "h_pre").fit(gaussian(300, 4, 0)).calibrate(gaussian(199, 4, 1))
    far = gaussian(10, 4, 3) + 100.0
    assert np.allclose(nov.p_value(far), 1 / 200)
    assert nov.novel(far, 0.01).all()


def test_mahalanobis_matches_sklearn_ledoit_wolf():
    x, q = gaussian(300, 5, 0), gaussian(20, 5, 1)
    nov = Novelty("mahalanobis", "h_pre").fit(x)
    mean, sd = x.mean(0).numpy(), x.std(0).numpy()     # unbiased std, as the scorer uses
    lw = LedoitWolf().fit((x.numpy() - mean) / sd)
    want = np.sqrt(lw.mahalanobis((q.numpy() - mean) / sd))
    assert np.allclose(nov.score(q), want, rtol=1e-6)


def test_knn_matches_sklearn_neighbours():
    x, q = gaussian(200, 3, 0), gaussian(15, 3, 1)
    nov = Novelty("knn", "h_pre", k=3).fit(x)
    mean, sd = x.mean(0).numpy(), x.std(0).numpy()
    nn = NearestNeighbors(n_neighbors=3).fit((x.numpy() - mean) / sd)
    want = nn.kneighbors((q.numpy() - mean) / sd)[0][:, -1]
    assert np.allclose(nov.score(q), want, rtol=1e-6)


def _kth_as_written(z: np.ndarray, bank: np.ndarray, k: int) -> np.ndarray:
    """`knn`'s score as first written (norms each call, roots of every distance, then the
    k-th): the reference the faster path must equal bit for bit."""
    out = np.empty(len(z))
    b2 = (bank * bank).sum(1)
    for i, a in enumerate(z):
        d = np.sqrt(np.maximum(b2 + a @ a - 2.0 * (bank @ a), 0.0))
        out[i] = np.partition(d, k - 1)[k - 1]
    return out


def _nearest_as_written(bank: torch.Tensor, z: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 k-th nearest distance as first written (temporaries, kthvalue)."""
    b, a = bank.float(), z.float()
    d2 = (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2.0 * (a @ b.T)
    best = d2.min(1).values if k == 1 else d2.kthvalue(k, dim=1).values
    return best.clamp_min(0).sqrt().double()


@pytest.mark.parametrize("k", [1, 4, 37])
def test_knn_score_is_the_distances_written_out_bit_for_bit(k):
    x, q = gaussian(500, 24, 2), gaussian(30, 24, 3) * 1.3
    nov = Novelty("knn", "h_pre", k=k).fit(x)
    z = nov._std(q).numpy()
    assert np.array_equal(nov.score(q), _kth_as_written(z, nov.t["bank"].numpy(), k))
    nov.extend_bank(q[:5])        # the kept norms follow a new bank
    assert np.array_equal(nov.score(q), _kth_as_written(z, nov.t["bank"].numpy(), k))


@pytest.mark.parametrize("k", [1, 3, 9])
def test_nearest_is_the_float32_expression_written_out_bit_for_bit(k):
    nov = Novelty("knn", "h_pre", k=k).fit(gaussian(700, 40, 4))
    z = nov._std(gaussian(50, 40, 5) * 1.2)
    assert torch.equal(nov._nearest(z, k), _nearest_as_written(nov.t["bank"], z, k))
    nov.extend_bank(gaussian(20, 40, 6))
    assert torch.equal(nov._nearest(z, k), _nearest_as_written(nov.t["bank"], z, k))


@pytest.mark.parametrize("kind,cache", [("knn", "_b2"), ("token_knn", "_b32")])
def test_prepare_builds_the_scoring_cache_and_an_extension_rebuilds_it(kind, cache):
    x = gaussian(120, 6, 8)
    nov = Novelty(kind, "h_pre").fit(x if kind == "knn" else x.reshape(30, 4, 6))
    assert not hasattr(nov, cache)                  # lazy until asked
    assert nov.prepare() is nov and getattr(nov, cache)[0] is nov.t["bank"]
    q = gaussian(10, 6, 9) if kind == "knn" else gaussian(10, 6, 9).reshape(5, 2, 6)
    nov.extend_bank(q)
    assert getattr(nov, cache)[0] is nov.t["bank"]  # for the new bank, before any score
    fresh = Novelty(kind, "h_pre")
    fresh.t = dict(nov.t)
    assert np.array_equal(nov.score(q), fresh.score(q))


def test_prepare_of_an_extended_reference_keeps_its_reference():
    """A re-certified detector (`DeferRule.apply`) prepared: its base's caches are built
    and the detector is still the extended one (a forwarded call returned the base alone,
    dropping the stream's reference)."""
    nov = Novelty("knn", "h_pre").fit(gaussian(60, 4, 1)).calibrate(gaussian(20, 4, 2))
    ext = nov.extend_reference(np.array([50.0, 60.0]))
    assert ext.prepare() is ext
    assert nov._b2[0] is nov.t["bank"]
    q = gaussian(3, 4, 3) * 10
    assert np.array_equal(ext.prepare().p_value(q), ext.p_value(q))


def test_prepare_without_a_bank_builds_nothing():
    for nov in (Novelty("knn", "h_pre"), Novelty("token_knn", "h_pre"),
                Novelty("mahalanobis", "h_pre").fit(gaussian(40, 3, 1))):
        assert nov.prepare() is nov
        assert not hasattr(nov, "_b2") and not hasattr(nov, "_b32")


def test_token_knn_is_the_worst_token():
    bank = torch.zeros(50, 4, 2, dtype=torch.float64)
    bank[:, :, 0] = torch.linspace(-1, 1, 200).reshape(50, 4)
    bank[:, :, 1] = torch.linspace(1, -1, 200).reshape(50, 4)
    nov = Novelty("token_knn", "img_token_set").fit(bank)
    query = bank[:2].clone()
    query[1, 3] = torch.tensor([5.0, 5.0])            # one odd token
    s = nov.score(query)
    flat = bank.reshape(-1, 2).numpy()
    mean, sd = flat.mean(0), flat.std(0, ddof=1)
    odd = (query[1, 3].numpy() - mean) / sd
    want = np.linalg.norm((flat - mean) / sd - odd, axis=1).min()   # brute force
    assert s[0] == pytest.approx(0.0, abs=1e-9) and s[1] == pytest.approx(want, rel=1e-6)


def test_save_load_roundtrip(tmp_path):
    nov = Novelty("knn", "img_mean").fit(gaussian(100, 3, 0)).calibrate(gaussian(50, 3, 1))
    nov.save(tmp_path)
    back = Novelty.load(tmp_path)
    q = gaussian(30, 3, 2)
    assert back.to_dict() == nov.to_dict()
    assert np.array_equal(back.p_value(q), nov.p_value(q))


def test_wrong_use_is_an_error():
    with pytest.raises(ValueError, match="kind"):
        Novelty("lof")
    with pytest.raises(RuntimeError, match="calibrate"):
        Novelty().fit(gaussian(10, 2, 0)).p_value(gaussian(2, 2, 1))
    with pytest.raises(ValueError, match=r"\[N, M, D\]"):
        Novelty("token_knn").fit(gaussian(10, 2, 0))


def test_pooled_image_keys_and_token_states_give_the_same_features():
    # heads.features.extract stores img_mean / img_std; the study's sets keep h_image
    tokens = gaussian(6 * 5, 3, 0).reshape(6, 5, 3)
    pre = gaussian(6, 3, 1)
    t = tokens.numpy()
    want = np.concatenate([pre.numpy(), t.mean(1), t.std(1, ddof=1)], 1)
    pooled = {"h_pre": pre, "img_mean": torch.from_numpy(t.mean(1)),
              "img_std": torch.from_numpy(t.std(1, ddof=1))}
    for f in ({"h_pre": pre, "h_image": tokens}, pooled):
        assert np.allclose(features("pre_img_mean_std", f).numpy(), want)
        assert np.allclose(features("img_mean_std", f).numpy(), want[:, 3:])
