"""Heads: pooling, fusion, temperature, defer guarantee, metrics, artefacts."""

import math

import numpy as np
import pytest
import torch

from heads.calibration import fit_temperature, fuse, logit
from heads.defer import choose_threshold
from heads.dualread import FingerprintMismatch, Heads
from heads.features import evidence_pool, phi
from heads.metrics import aurc, auroc, ece, hce


def test_pooling_and_phi_hand_computed():
    h_ans = torch.tensor([1.0, 0.0])
    v = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    # cos = [1, 0]; softmax([10, 0]) with kappa 0.1
    a1 = math.exp(10) / (math.exp(10) + 1)
    h_global, h_evid, alpha = evidence_pool(h_ans, v, kappa=0.1)
    torch.testing.assert_close(alpha, torch.tensor([a1, 1 - a1]))
    torch.testing.assert_close(h_global, torch.tensor([1.0, 1.5]))
    evid = torch.tensor([2 * a1, 3 * (1 - a1)])
    torch.testing.assert_close(h_evid, evid)
    expected = torch.cat([torch.tensor([1.0, 1.5]), evid, h_ans * evid, (h_ans - evid).abs()])
    torch.testing.assert_close(phi(h_ans, v, 0.1), expected)
    # a larger kappa spreads attention
    assert evidence_pool(h_ans, v, kappa=10.0)[2][0] < a1


def test_fusion_identity():
    p = torch.tensor([0.1, 0.5, 0.73, 0.99], dtype=torch.float64)
    torch.testing.assert_close(fuse(p, p), p)
    torch.testing.assert_close(fuse(p, torch.full_like(p, 0.5)), torch.sigmoid(0.5 * logit(p)))
    torch.testing.assert_close(fuse(p, 1 - p), torch.full_like(p, 0.5))


def test_temperature_lowers_nll_on_overconfident_set():
    g = torch.Generator().manual_seed(0)
    true_logit = torch.randn(4000, generator=g) * 1.5
    z = (torch.rand(4000, generator=g) < torch.sigmoid(true_logit)).double()
    over = true_logit * 4                      # over-confident by 4x
    t = fit_temperature(over, z)
    nll = lambda lg: torch.nn.functional.binary_cross_entropy_with_logits(lg, z).item()  # noqa: E731
    assert 3.0 < t < 5.5
    assert nll(over / t) < nll(over) - 0.1


def test_defer_guarantee_in_simulation():
    """Risk among accepted items is ≤ r in ≥ 1 - δ of repeated calibration draws."""
    r, delta, n, trials = 0.2, 0.1, 2000, 200
    rng = np.random.default_rng(0)
    grid = np.linspace(0, 1, 20001)[:-1] + 0.5 / 20000   # P(correct | c) = c, c ~ U(0, 1)
    ok = coverages = 0
    for _ in range(trials):
        c = rng.uniform(size=n)
        z = rng.uniform(size=n) < c
        pol = choose_threshold(c, z, r, delta)
        sel = grid[grid >= pol.tau]
        true_risk = float((1 - sel).mean()) if pol.feasible and len(sel) else 0.0
        ok += true_risk <= r
        coverages += pol.coverage
    assert ok / trials >= 1 - delta
    # oracle: tau* = 1 - 2r = 0.6 (coverage 0.4); the bound costs some coverage, not all
    assert 0.2 < coverages / trials < 0.4


def test_defer_infeasible_defers_everything():
    pol = choose_threshold(np.linspace(0, 1, 50), np.zeros(50), 0.05, 0.1)
    assert not pol.feasible and pol.defer(1.0) and pol.coverage == 0


def test_ece_hand_computed():
    c = np.array([0.05, 0.05, 0.95, 0.95, 0.55])
    z = np.array([0, 1, 1, 1, 0])
    # bins (15): [0.05,0.05] acc .5 gap .45; [.95,.95] acc 1 gap .05; [.55] acc 0 gap .55
    assert ece(c, z, 15) == pytest.approx((2 * 0.45 + 2 * 0.05 + 0.55) / 5)
    assert ece(np.array([0.25, 0.75]), np.array([0, 1]), 10) == pytest.approx(0.25)


def test_aurc_ties_use_expected_risk():
    # all tied: risk at every coverage k is the base error rate in expectation
    assert aurc(np.full(4, 0.5), np.array([1, 0, 1, 0])) == pytest.approx(0.5)
    # perfect ranking: errors last
    c, z = np.array([0.9, 0.8, 0.2, 0.1]), np.array([1, 1, 0, 0])
    assert aurc(c, z) == pytest.approx(np.mean([0, 0, 1 / 3, 2 / 4]))
    assert aurc(c, z) < aurc(-c, z)


def test_auroc_and_hce():
    assert auroc(np.array([0.9, 0.1]), np.array([1, 0])) == 1.0
    assert auroc(np.array([0.5, 0.5]), np.array([1, 0])) == 0.5
    assert math.isnan(auroc(np.array([0.5, 0.7]), np.array([1, 1])))
    assert hce(np.array([0.95, 0.95, 0.5, 0.91]), np.array([0, 1, 0, 0])) == 0.5


def _fitted_heads(dim=8):
    h = Heads.new(dim)
    for reader in (h.psr, h.state, h.visual, h.saplma, h.bicr):
        for p in reader.parameters():
            torch.nn.init.normal_(p)
        reader.eval()
    h.t_pre, h.t_post, h.actor_fingerprint = 1.7, 0.8, "abc123"
    h.policy = choose_threshold(np.linspace(0, 1, 100), np.linspace(0, 1, 100) > 0.3)
    h.platt = {"mean_token_logprob": (2.0, 0.5), "predictive_entropy": (1.0, 0.0)}
    return h


def _feats(n=5, dim=8):
    g = torch.Generator().manual_seed(1)
    return {"h_pre": torch.randn(n, dim, generator=g), "h_close": torch.randn(n, dim, generator=g),
            "phi": torch.randn(n, 4 * dim, generator=g), "h_mid": torch.randn(n, dim, generator=g),
            "msp": torch.rand(n, 1, generator=g), "mean_logprob": -torch.rand(n, 1, generator=g),
            "entropy": torch.rand(n, 1, generator=g), "mu": torch.rand(n, 1, generator=g)}


def test_save_load_round_trip(tmp_path):
    h = _fitted_heads()
    f = _feats()
    h.save(tmp_path, {"command": "test"})
    back = Heads.load(tmp_path, "abc123")
    a, b = h.score(f), back.score(f)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6)
    assert back.policy == h.policy and back.t_pre == 1.7


def test_fingerprint_mismatch_is_a_clear_error(tmp_path):
    _fitted_heads().save(tmp_path, {})
    with pytest.raises(FingerprintMismatch, match="fitted for actor abc123"):
        Heads.load(tmp_path, "somethingelse")


def test_dualread_is_the_fusion_of_branches():
    h = _fitted_heads()
    s = h.score(_feats())
    np.testing.assert_allclose(s["dualread"], fuse(torch.tensor(s["psr"]),
                                                   torch.tensor(s["per"])).numpy(), rtol=1e-9)


def test_aurc_equals_random_tie_order_on_average():
    rng = np.random.default_rng(0)
    c, z = rng.integers(0, 5, 40) / 4, rng.integers(0, 2, 40)
    runs = []
    for _ in range(4000):
        order = np.lexsort((rng.random(40), -c))
        runs.append(np.mean(np.cumsum(1 - z[order]) / np.arange(1, 41)))
    assert aurc(c, z) == pytest.approx(np.mean(runs), abs=3e-3)


def test_one_scoring_call_reads_each_dualread_reader_once_and_scores_as_separate_calls():
    """PSR's and PER's log-odds are kept within a scoring call (`registry.Scored`) for the
    served probabilities and `branch_log_odds` alike: the same numbers, bit for bit, as
    each computed on its own."""
    from heads import registry
    from heads.methods.dualread import branch_log_odds

    dim = 8
    h = Heads.new(dim)
    for reader in h.readers.values():
        reader.eval()
    g = torch.Generator().manual_seed(2)
    f = {"h_pre": torch.randn(4, dim, generator=g), "h_close": torch.randn(4, dim, generator=g),
         "phi": torch.randn(4, 4 * dim, generator=g)}
    calls = {name: 0 for name in h.readers}
    for name, reader in h.readers.items():
        reader.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    names = ("psr", "per", "dualread")
    alone = {n: registry.get(n).score(h, dict(f)) for n in names}
    lg_alone = branch_log_odds(h, dict(f))
    for n in calls:
        calls[n] = 0
    shared = registry.Scored(dict(f))
    kept = {n: registry.get(n).score(h, shared) for n in names}
    lg_kept = branch_log_odds(h, shared)
    assert all(np.array_equal(kept[n], alone[n]) for n in names)
    assert np.array_equal(lg_kept, lg_alone)
    assert calls["psr"] == 1 and calls["state"] == 1 and calls["visual"] == 1
