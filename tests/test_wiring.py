"""Wiring between the parts, each against an expectation computed here by hand in numpy.

Every temperature, prior offset, Platt pair and κ is given a distinct value, so a swapped
or dropped parameter changes some output.
"""

import math

import numpy as np
import pytest
import torch

from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.features import extract
from heads.metrics import METRICS, ece
from models.readout import Readout

DIM = 6


# ------------------------------------------------------------------ independent references
def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, float)))


def np_reader(reader, x) -> np.ndarray:
    """A Reader's logits computed from its parameters: standardise, Linear/ReLU..., Linear."""
    x = (np.asarray(x, float) - reader.norm.mean.numpy()) / reader.norm.std.numpy()
    linears = [m for m in reader.net if isinstance(m, torch.nn.Linear)]
    for k, lin in enumerate(linears):
        x = x @ lin.weight.detach().double().numpy().T + lin.bias.detach().double().numpy()
        if k < len(linears) - 1:
            x = np.maximum(x, 0)
    return x[:, 0]


def np_phi(h_ans, v, kappa) -> np.ndarray:
    h_ans, v = np.asarray(h_ans, float), np.asarray(v, float)
    cos = v @ h_ans / (np.linalg.norm(v, axis=1) * np.linalg.norm(h_ans))
    a = np.exp(cos / kappa - (cos / kappa).max())
    a /= a.sum()
    h_evid = a @ v
    return np.concatenate([v.mean(0), h_evid, h_ans * h_evid, np.abs(h_ans - h_evid)])


def ece_reference(c, z, bins):
    """ECE with explicit edges [k/B, (k+1)/B), the last bin closed (docs/method.md §6)."""
    c, z = np.asarray(c, float), np.asarray(z, float)
    total = 0.0
    for k in range(bins):
        lo, hi = k / bins, (k + 1) / bins
        m = (c >= lo) & ((c < hi) if k < bins - 1 else (c <= hi))
        if m.any():
            total += m.sum() * abs(z[m].mean() - c[m].mean())
    return total / len(c)


# ------------------------------------------------------------------ ECE binning
def test_ece_truncates_into_bins_not_rounds():
    # 15 bins: 0.10 and 0.12 share bin 1 ([1/15, 2/15)), 0.14 is in bin 2, 0.30 in bin 4.
    # Rounding c·B instead would put 0.10, 0.12 and 0.14 together in bin 2.
    c = np.array([0.10, 0.12, 0.14, 0.30])
    z = np.array([1, 0, 0, 1])
    by_hand = (2 * abs(0.5 - 0.11) + abs(0 - 0.14) + abs(1 - 0.30)) / 4
    assert by_hand == pytest.approx(0.405)
    assert ece(c, z, 15) == pytest.approx(by_hand)
    assert METRICS["ece"](c, z) == pytest.approx(by_hand)
    # 10 bins: 0.10, 0.12, 0.14 share [0.1, 0.2); 0.30 alone.
    by_hand10 = (3 * abs(1 / 3 - 0.12) + abs(1 - 0.30)) / 4
    assert METRICS["ece10"](c, z) == pytest.approx(by_hand10)
    # c = 1 belongs to the last bin, c = 0 to the first.
    assert ece(np.array([1.0, 0.0]), np.array([1, 0]), 15) == pytest.approx(0.0)


def test_ece_edges_small_inputs_and_range():
    # .95 and 1.0 share the last bin (1.0 is not a bin of its own): gap |.5 - .975|
    assert ece(np.array([0.95, 1.0]), np.array([1, 0]), 15) == pytest.approx(0.475)
    assert ece(np.array([0.3]), np.array([1]), 15) == pytest.approx(0.7)
    assert math.isnan(ece(np.array([]), np.array([]), 15))
    for bad in ([1.5, 0.2], [-0.1, 0.2], [float("nan"), 0.2]):
        with pytest.raises(ValueError):
            ece(np.array(bad), np.array([1, 0]), 15)


def test_auroc_one_class_is_nan():
    from heads.metrics import auroc

    assert math.isnan(auroc(np.array([0.2, 0.7]), np.array([0, 0])))
    assert math.isnan(auroc(np.array([0.2, 0.7]), np.array([1, 1])))


def test_ece_matches_explicit_edges_on_random_data():
    rng = np.random.default_rng(3)
    c = rng.uniform(size=400)
    z = (rng.uniform(size=400) < c ** 2).astype(int)
    for bins in (10, 15):
        assert ece(c, z, bins) == pytest.approx(ece_reference(c, z, bins), abs=1e-12)


def test_brier_and_risk_coverage_by_hand():
    from heads.metrics import brier, risk_coverage

    c, z = np.array([0.9, 0.2, 0.6]), np.array([1, 0, 0])
    assert METRICS["brier"](c, z) == pytest.approx((0.01 + 0.04 + 0.36) / 3)
    assert brier(c, z) == pytest.approx((0.01 + 0.04 + 0.36) / 3)
    # high to low: .9 right, .6 wrong, .3 wrong, .1 right
    cov, risk = risk_coverage(np.array([0.3, 0.9, 0.6, 0.1]), np.array([0, 1, 0, 1]))
    np.testing.assert_allclose(cov, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(risk, [0.0, 0.5, 2 / 3, 0.5])
    cov, risk = risk_coverage(np.array([0.7]), np.array([0]))
    assert cov.tolist() == [1.0] and risk.tolist() == [1.0]
    cov, risk = risk_coverage(np.array([]), np.array([]))
    assert len(cov) == 0 and len(risk) == 0
    # tied items are kept or deferred together: one point per distinct confidence
    cov, risk = risk_coverage(np.array([0.5, 0.9, 0.5]), np.array([0, 1, 1]))
    np.testing.assert_allclose(cov, [1 / 3, 1.0])
    np.testing.assert_allclose(risk, [0.0, 1 / 3])


def test_hce_counts_the_threshold_itself_and_small_inputs():
    from heads.metrics import hce

    assert hce(np.array([0.9]), np.array([0])) == 1.0         # c = .9 is "≥ .9"
    assert hce(np.array([0.95, 0.5]), np.array([0, 0])) == 0.5
    assert math.isnan(hce(np.array([]), np.array([])))


def test_fit_platt_recovers_a_known_map_and_handles_one_class():
    from scipy.optimize import minimize

    from heads.calibration import fit_platt

    rng = np.random.default_rng(0)
    s = rng.normal(size=3000)
    z = (rng.uniform(size=3000) < sigmoid(2.0 * s - 0.5)).astype(int)
    a, b = fit_platt(s, z)

    def nll(p):          # the unregularised logistic loss, minimised by scipy
        t = p[0] * s + p[1]
        return np.mean(np.logaddexp(0, t) - z * t)

    ref = minimize(nll, [0.0, 0.0], method="BFGS").x
    assert (a, b) == pytest.approx(tuple(ref), abs=2e-3)
    assert (a, b) == pytest.approx((2.0, -0.5), abs=0.25)
    # one class only: slope 0, intercept the (clamped) log-odds of the base rate
    a1, b1 = fit_platt(np.arange(4.0), np.ones(4, int))
    assert a1 == 0.0 and b1 == pytest.approx(math.log((1 + 1e-6) / 1e-6))
    a0, b0 = fit_platt(np.arange(4.0), np.zeros(4, int))
    assert a0 == 0.0 and b0 == pytest.approx(math.log(1e-6 / (1 + 1e-6)))
    # a score that falls with correctness: the slope stops at 0 (base rate, 1:1) unless
    # a negative slope is allowed
    s_inv = np.linspace(-2, 2, 400)
    z_inv = (rng.uniform(size=400) < sigmoid(-2 * s_inv)).astype(int)
    a_n, b_n = fit_platt(s_inv, z_inv)
    assert a_n == 0.0
    assert b_n == pytest.approx(math.log(z_inv.mean() / (1 - z_inv.mean())), abs=1e-3)
    assert fit_platt(s_inv, z_inv, nonneg=False)[0] < -1.0
    # a constant score cannot rank: slope 0, intercept the log-odds of the base rate (3:1)
    ac, bc = fit_platt(np.full(4, 0.3), np.array([0, 1, 1, 1]))
    assert ac == pytest.approx(0.0, abs=1e-6) and bc == pytest.approx(math.log(3), abs=1e-4)


# ------------------------------------------------------------------ Heads.score wiring
def _heads() -> Heads:
    torch.manual_seed(0)
    h = Heads.new(DIM)
    g = torch.Generator().manual_seed(5)
    for reader in (h.psr, h.state, h.visual, h.saplma, h.bicr, h.consistency):
        d = reader.norm.mean.shape[0]
        reader.norm.mean.copy_(torch.randn(d, generator=g) * 0.3)
        reader.norm.std.copy_(torch.rand(d, generator=g) + 0.5)
        for lin in (m for m in reader.net if isinstance(m, torch.nn.Linear)):
            # scaled so the log-odds stay moderate: the fusion's clamp never bites
            scale = 1.5 / math.sqrt(lin.in_features)
            lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=g) * scale)
            lin.bias.data.copy_(torch.randn(lin.bias.shape, generator=g) * 0.3)
        reader.eval()
    h.t_pre, h.t_post, h.t_state, h.t_saplma, h.t_bicr, h.t_msp = 1.7, 0.6, 2.3, 1.3, 0.8, 3.1
    h.offsets = {"psr": -0.7, "saplma": 0.45, "bicr": -1.2, "consistency": -0.3}
    h.platt = {"mean_token_logprob": (2.0, 0.5), "predictive_entropy": (1.5, -0.25)}
    h.kappa = 0.35
    return h


def _features(n: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"h_pre": torch.randn(n, DIM, generator=g), "h_close": torch.randn(n, DIM, generator=g),
            "phi": torch.randn(n, 4 * DIM, generator=g),
            "h_mid": torch.randn(n, DIM, generator=g),
            "msp": torch.rand(n, 1, generator=g) * 0.9 + 0.05,
            "mean_logprob": -torch.rand(n, 1, generator=g) * 2,
            "entropy": torch.rand(n, 1, generator=g) * 3, "mu": torch.rand(n, 1, generator=g)}


def _expected(h: Heads, f: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    x = {k: v.double().numpy() for k, v in f.items()}
    l_pre = np_reader(h.psr, x["h_pre"]) - 0.7
    l_state = np_reader(h.state, x["h_close"])
    l_post = l_state + np_reader(h.visual, x["phi"])
    c = np_reader(h.consistency, x["phi"])
    # PER's calibrated log-odds plus the answer-consistency term min(0, log σ(c) − q)
    post = l_post / 0.6 + np.minimum(0.0, np.log(sigmoid(c)) + 0.3)
    msp = x["msp"][:, 0]
    return {
        "psr": sigmoid(l_pre / 1.7),
        "p_state": sigmoid(l_state / 2.3),
        "per": sigmoid(post),
        # logit(σ(a)) = a: the fusion is the mean of the two scaled log-odds
        "dualread": sigmoid(0.5 * l_pre / 1.7 + 0.5 * post),
        "answer_consistency": sigmoid(c),
        "verbalized": x["mu"][:, 0],
        "max_sequence_probability": sigmoid(np.log(msp / (1 - msp)) / 3.1),
        "saplma": sigmoid((np_reader(h.saplma, x["h_mid"]) + 0.45) / 1.3),
        "mean_token_logprob": sigmoid(2.0 * x["mean_logprob"][:, 0] + 0.5),
        "predictive_entropy": sigmoid(1.5 * -x["entropy"][:, 0] - 0.25),
    }


def test_score_applies_each_temperature_offset_and_platt_map():
    h, f = _heads(), _features()
    got, want = h.score(f), _expected(h, f)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # the branches are not trivially equal (each check above could fail on a swap)
    assert np.abs(got["psr"] - got["per"]).max() > 0.05
    assert 0.02 < got["dualread"].min() and got["dualread"].max() < 0.98


def test_logits_add_the_psr_offset_and_the_visual_residual():
    h, f = _heads(), _features()
    lg = h.logits(f)
    x = {k: v.double().numpy() for k, v in f.items()}
    l_state = np_reader(h.state, x["h_close"])
    np.testing.assert_allclose(lg["pre"].numpy(), np_reader(h.psr, x["h_pre"]) - 0.7, rtol=1e-5)
    np.testing.assert_allclose(lg["state"].numpy(), l_state, rtol=1e-5)
    np.testing.assert_allclose(lg["post"].numpy(), l_state + np_reader(h.visual, x["phi"]),
                               rtol=1e-5, atol=1e-6)


def test_bicr_uses_the_difference_offset_and_temperature():
    h = _heads()
    g = torch.Generator().manual_seed(2)
    real, black = torch.randn(5, DIM, generator=g), torch.randn(5, DIM, generator=g)
    x = np.concatenate([real.numpy(), real.numpy() - black.numpy()], 1)
    want = sigmoid((np_reader(h.bicr, x) - 1.2) / 0.8)
    np.testing.assert_allclose(h.score_bicr(real, black), want, rtol=1e-5)


def test_saplma_and_bicr_logits_add_their_offsets():
    h = _heads()
    g = torch.Generator().manual_seed(8)
    mid, real, black = (torch.randn(4, DIM, generator=g) for _ in range(3))
    np.testing.assert_allclose(h.saplma_logits(mid).numpy(),
                               np_reader(h.saplma, mid.numpy()) + 0.45, rtol=1e-5, atol=1e-6)
    x = np.concatenate([real.numpy(), real.numpy() - black.numpy()], 1)
    np.testing.assert_allclose(h.bicr_logits(real, black).numpy(), np_reader(h.bicr, x) - 1.2,
                               rtol=1e-5, atol=1e-6)


def test_platt_defaults_to_identity_slope():
    h, f = _heads(), _features()
    h.platt = {}
    got = h.score(f)
    np.testing.assert_allclose(got["mean_token_logprob"],
                               sigmoid(f["mean_logprob"].double().numpy()[:, 0]), rtol=1e-6)


# ------------------------------------------------------------------ Heads.defer
def _policy(tau: float) -> DeferPolicy:
    return DeferPolicy(tau=tau, target_risk=0.1, delta=0.1, coverage=0.5, empirical_risk=0.05,
                       risk_upper_bound=0.09, n_calibration=100, feasible=True)


def test_heads_defer_flips_at_tau():
    h = _heads()
    h.policy = _policy(0.6)
    assert h.defer(0.59) is True
    assert h.defer(0.6) is False            # defer when confidence < τ, strictly
    assert h.defer(0.61) is False and h.defer(1.0) is False
    assert h.defer(0.0) is True
    h.policy = None                         # no policy: nothing is answered unchecked
    assert h.defer(0.99) is True


# ------------------------------------------------------------------ features.extract
def _readout(digits: torch.Tensor | None = None) -> Readout:
    g = torch.Generator().manual_seed(4)
    h_answer = torch.randn(3, DIM, generator=g)
    return Readout(
        h_pre=torch.randn(DIM, generator=g),
        # h_close far from the answer span's mean, so using one for the other shows
        h_close=-3 * h_answer.mean(0) + torch.randn(DIM, generator=g),
        h_answer=h_answer, h_image=torch.randn(5, DIM, generator=g),
        h_mid=torch.randn(DIM, generator=g),
        token_logprobs=torch.tensor([-0.1, -0.5, -1.0, -2.0, -0.3]),
        token_entropy=torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0]),
        answer_index=torch.tensor([1, 2]), digit_probs=digits)


def test_extract_builds_phi_from_the_answer_span_and_span_statistics():
    ro = _readout()
    f = extract(ro, kappa=0.35)
    h_ans = ro.h_answer.double().numpy().mean(0)
    want_phi = np_phi(h_ans, ro.h_image.double().numpy(), 0.35)
    np.testing.assert_allclose(f["phi"].numpy(), want_phi, rtol=1e-5, atol=1e-6)
    wrong = np_phi(ro.h_close.double().numpy(), ro.h_image.double().numpy(), 0.35)
    assert np.abs(want_phi - wrong).max() > 0.1
    torch.testing.assert_close(f["h_pre"], ro.h_pre)
    torch.testing.assert_close(f["h_close"], ro.h_close)
    torch.testing.assert_close(f["h_mid"], ro.h_mid)
    # answer tokens are response tokens 1 and 2: log-probs -0.5, -1.0; entropies .4, .6
    assert float(f["msp"]) == pytest.approx(math.exp(-0.75))
    # over the answer span like the other sequence scores (was the whole response)
    assert float(f["mean_logprob"]) == pytest.approx((-0.5 - 1.0) / 2)
    assert float(f["entropy"]) == pytest.approx(0.5)
    assert float(f["mu"]) == 0.5                      # no cue: μ kept at 0.5 (docs/method.md)
    for k in ("msp", "mean_logprob", "entropy", "mu"):
        assert f[k].shape == (1,), k


def test_extract_mu_and_default_kappa():
    digits = torch.zeros(11)
    digits[7], digits[9] = 0.25, 0.75
    ro = _readout(digits)
    f = extract(ro)
    assert float(f["mu"]) == pytest.approx(0.25 * 0.7 + 0.75 * 0.9)
    want = np_phi(ro.h_answer.double().numpy().mean(0), ro.h_image.double().numpy(), 0.1)
    np.testing.assert_allclose(f["phi"].numpy(), want, rtol=1e-5, atol=1e-6)


def test_confidence_of_one_readout_uses_the_heads_kappa():
    h, ro = _heads(), _readout()
    x = {"h_pre": ro.h_pre.double().numpy()[None], "h_close": ro.h_close.double().numpy()[None],
         "phi": np_phi(ro.h_answer.double().numpy().mean(0), ro.h_image.double().numpy(),
                       0.35)[None]}
    l_pre = np_reader(h.psr, x["h_pre"])[0] - 0.7
    l_post = np_reader(h.state, x["h_close"])[0] + np_reader(h.visual, x["phi"])[0]
    post = l_post / 0.6 + min(0.0, float(np.log(sigmoid(np_reader(h.consistency,
                                                                  x["phi"])[0]))) + 0.3)
    got = h.confidence(ro)
    assert set(got) == {"dualread", "psr", "per", "verbalized"}
    assert got["psr"] == pytest.approx(float(sigmoid(l_pre / 1.7)), rel=1e-5)
    assert got["per"] == pytest.approx(float(sigmoid(post)), rel=1e-5)
    assert got["dualread"] == pytest.approx(
        float(sigmoid(0.5 * l_pre / 1.7 + 0.5 * post)), rel=1e-5)
    assert got["verbalized"] == 0.5


# ------------------------------------------------------------------ the defer search by hand
def cp_upper(errors: int, n: int, delta: float) -> float:
    """One-sided exact (Clopper–Pearson) upper bound, from scipy's binomial test."""
    from scipy.stats import binomtest

    if n == 0:
        return 1.0
    return binomtest(errors, n, alternative="less").proportion_ci(
        confidence_level=1 - delta, method="exact").high


def test_clopper_pearson_upper_matches_scipy():
    from heads.defer import clopper_pearson_upper

    assert clopper_pearson_upper(0, 1, 0.1) == pytest.approx(0.9)
    assert clopper_pearson_upper(0, 0, 0.1) == 1.0
    assert clopper_pearson_upper(5, 5, 0.1) == 1.0
    for k, n, d in [(0, 10, 0.05), (3, 20, 0.1), (1, 6, 0.1), (7, 9, 0.02)]:
        assert clopper_pearson_upper(k, n, d) == pytest.approx(cp_upper(k, n, d), rel=1e-9)


C8 = np.arange(1, 9) / 10          # confidences .1 ... .8; ⌈log2 8⌉ = 3 tests


@pytest.mark.parametrize("z, r, tau, k, errors", [
    # tests at δ/3 = 0.1. Visits index 4 (τ .5: 4 kept, 0 wrong, pass), 2 (τ .3: 6 kept,
    # 1 wrong, bound .51 > r, fail), 3 (τ .4: 5 kept, 0 wrong, pass): τ = .4
    ([0, 0, 0, 1, 1, 1, 1, 1], 0.5, 0.4, 5, 0),
    # all right: 4, 2, 1 all pass: τ = .2 (index 0 is never tested)
    ([1] * 8, 0.5, 0.2, 7, 0),
    # only the top answer is right: 4 fail, 6 fail (bound .95 > .92), 7 pass (bound .9)
    ([0, 0, 0, 0, 0, 0, 0, 1], 0.92, 0.8, 1, 0),
    # k_min = 3 (0 errors of 2 kept bound .68 > .55), so only indices 0..5 are candidates:
    # 3 fails (τ .4: 1 error of 5, bound .58), 4 passes (0 of 4, bound .44), 4 again: τ = .5.
    # (The search over all eight visited 4, 2, 1 and found τ .3, bound .51: a path, not a
    # guarantee, changed with the candidates.)
    ([0, 0, 1, 0, 1, 1, 1, 1], 0.55, 0.5, 4, 0),
])
def test_choose_threshold_hand_traced(z, r, tau, k, errors):
    from heads.defer import choose_threshold

    pol = choose_threshold(C8, np.array(z), r, 0.3)
    assert pol.tau == pytest.approx(tau)
    assert pol.feasible is True
    assert pol.coverage == pytest.approx(k / 8)
    assert pol.empirical_risk == pytest.approx(errors / k)
    assert pol.risk_upper_bound == pytest.approx(cp_upper(errors, k, 0.1), rel=1e-9)
    assert (pol.target_risk, pol.delta, pol.n_calibration) == (r, 0.3, 8)
    assert pol.defer(tau - 1e-9) and not pol.defer(tau)


def test_choose_threshold_bound_equal_to_r_passes():
    from heads.defer import choose_threshold

    # n = 2: one test at level δ; the top item alone has bound 1 − δ = 0.5 = r
    pol = choose_threshold(np.array([0.2, 0.9]), np.array([1, 1]), 0.5, 0.5)
    assert pol.feasible and pol.tau == 0.9 and pol.risk_upper_bound == pytest.approx(0.5)


def test_choose_threshold_infeasible_policy_fields():
    from heads.defer import choose_threshold

    pol = choose_threshold(C8, np.zeros(8), 0.2, 0.1)
    assert pol.feasible is False and pol.tau > 1 and pol.defer(1.0)
    assert (pol.coverage, pol.empirical_risk, pol.risk_upper_bound) == (0.0, 0.0, 1.0)
    assert (pol.target_risk, pol.delta, pol.n_calibration) == (0.2, 0.1, 8)
    assert pol.to_dict()["feasible"] is False
