"""The fitting defects of issue 11, each pinned by a case the old behaviour fails."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch
from scipy.stats import beta
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from heads import passes
from heads.calibration import fit_platt, platt, platt_inverted
from heads.defer import choose_threshold, min_kept
from heads.metrics import ece, hce, resample_clusters, resample_clusters_counted, risk_coverage
from heads.modules import Reader, fit_linear
from tests.helpers import one_commit_repo


def bce_by_hand(p: np.ndarray, z: np.ndarray) -> float:
    return float(-np.mean(z * np.log(p) + (1 - z) * np.log(1 - p)))


# ------------------------------------------------------------------ 1. linear heads converge
def test_linear_head_on_a_92_8_set_beats_the_prior():
    """Standardised inputs, Adam lr 1e-3, 1000 steps: from a zero bias the head ended above
    the base rate's BCE (the shipped P-State: 0.425 vs ≈ 0.28)."""
    g = torch.Generator().manual_seed(0)
    n, d = 2000, 32
    x = torch.randn(n, d, generator=g) * 5 + 3
    signal = x[:, 0] - 3
    z = (torch.rand(n, generator=g) < torch.sigmoid(3.0 + 0.3 * signal)).float()
    rate = float(z.mean())
    assert 0.88 < rate < 0.96
    prior = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    reader = Reader(d)
    log = fit_linear(reader, x, z)
    with torch.no_grad():
        p = torch.sigmoid(reader(x)).double().numpy()
    assert bce_by_hand(p, z.numpy()) < prior
    assert log["train_bce"] == pytest.approx(bce_by_hand(p, z.numpy()), abs=1e-4)
    assert log["prior_bce"] == pytest.approx(prior, abs=1e-4)
    # held-out images of the same law: still below the prior
    x2 = torch.randn(n, d, generator=g) * 5 + 3
    z2 = (torch.rand(n, generator=g) < torch.sigmoid(3.0 + 0.3 * (x2[:, 0] - 3))).float()
    with torch.no_grad():
        p2 = torch.sigmoid(reader(x2)).double().numpy()
    r2 = float(z2.mean())
    assert bce_by_hand(p2, z2.numpy()) < -(r2 * math.log(rate) + (1 - r2) * math.log(1 - rate))


def test_fit_heads_refuses_a_reader_worse_than_the_prior():
    from heads.fit import WorseThanPrior, prior_check, refuse_worse_than_prior

    z = np.array([1] * 23 + [0] * 2)
    good = np.where(z == 1, 0.95, 0.3)
    scores = {"psr": good, "p_state": np.full(25, 0.5), "verbalized": np.full(25, 0.5)}
    # a reader split of rate 0.92 before the 25 defer-split items
    reader = np.array([1] * 23 + [0] * 2)
    pc = prior_check(scores, np.concatenate([reader, z]),
                     {"reader": np.arange(25), "defer": np.arange(25, 50)})
    by_hand = -(0.92 * math.log(0.92) + 0.08 * math.log(0.08))
    assert pc["prior_bce"] == pytest.approx(by_hand, abs=1e-5)
    # P-State at 0.5 has BCE log 2 > prior; verbalized trains no reader: not judged
    assert pc["worse"] == ["p_state"]
    assert pc["psr"] == pytest.approx(bce_by_hand(good, z), abs=1e-5)
    with pytest.raises(WorseThanPrior, match="p_state"):
        refuse_worse_than_prior({"prior_check": pc})
    refuse_worse_than_prior({"prior_check": {**pc, "worse": []}})


# ------------------------------------------------------------------ 2. P(True)
def test_ptrue_token_sets_are_disjoint_on_the_embedded_tokenizer():
    from transformers import AutoTokenizer

    from models.loading import EMBEDDED_ACTOR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_ACTOR, local_files_only=True)
    yes, no = passes.answer_token_sets(tok)
    assert yes and no and not set(yes) & set(no)
    # the bare space is in neither set (the old sets counted it for both)
    space = tok.encode(" ", add_special_tokens=False)
    assert not set(space) & (set(yes) | set(no))


def test_ptrue_on_a_model_that_says_true_only_for_right_answers(monkeypatch):
    """A constructed model: "A" (True) when the proposed answer is right, "B" otherwise.
    P(True) must then separate right from wrong, and the Platt map must keep the order."""
    from heads.methods.extra_passes import PTrue

    class Tok:
        ids = {"A": 1, "B": 2, "True": 3, "False": 4}

        def encode(self, w, add_special_tokens=False):
            w = w.strip()
            return [self.ids.get(w, 9)]

    gold = {"q0": "red", "q1": "yes", "q2": "circle", "q3": "no"}

    def model(actor, images, questions, texts):
        probs = torch.full((len(texts), 10), 0.01)
        for k, (q, t) in enumerate(zip(questions, texts)):
            assert t.startswith("<answer>")            # read after the full response
            proposed = t.split("Proposed Answer: ")[1].split("\n")[0]
            probs[k, 1 if proposed == gold[q] else 2] = 0.9
        return probs / probs.sum(-1, keepdim=True)

    monkeypatch.setattr(passes, "continuation_probs", model)
    actor = type("Stand", (), {"tokenizer": Tok()})()
    qs = ["q0", "q1", "q2", "q3"] * 5
    answers = [gold[q] if k % 3 else "blue" for k, q in enumerate(qs)]
    responses = [f"<answer>{a}</answer>" for a in answers]
    z = np.array([float(a == gold[q]) for q, a in zip(qs, answers)])
    p = passes.ptrue_probs(actor, [None] * len(qs), qs, responses, answers)
    assert roc_auc_score(z, p) == 1.0
    # fitted map (on these items as the temperature split) keeps the order, slope > 0
    from heads.dualread import Heads
    from heads.registry import FitData

    heads = Heads(dim=4)
    f = {"ptrue": torch.tensor(p), "z": torch.tensor(z)}
    method = PTrue()
    log = method.fit(heads, FitData({}, torch.tensor(z), {}, {"temperature": f}))
    assert log["slope"] > 0 and not log["inverted"]
    assert roc_auc_score(z, method.score(heads, f)) == 1.0


# ------------------------------------------------------------------ 3. SAPLMA
def test_saplma_layer_rounds_half_up():
    from models.actor import saplma_layer

    assert saplma_layer(4) == 3            # 0.625 · 4 = 2.5; Python's round gives 2
    assert saplma_layer(32) == 20 and saplma_layer(28) == 18 and saplma_layer(1) == 1


def test_saplma_state_is_the_last_completion_token(qwen3, images):
    """h_mid is hidden_states[mid_layer] at the last token of the response, not t_close."""
    actor = qwen3
    response = "<answer>red</answer> and then some more words"
    ro = actor.score(images[:1], ["what color?"], [response], cue=False)[0].readout
    ids = actor.tokenizer.encode(actor.score_text(response, False), add_special_tokens=False)
    batch = actor.encode(images[:1], ["what color?"], [ids])
    out = actor.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      output_hidden_states=True, use_cache=False, **actor._vision_kwargs(batch))
    want = out.hidden_states[actor.mid_layer][0, batch.prompt_len + len(ids) - 1].float()
    torch.testing.assert_close(ro.h_mid, want.cpu(), rtol=1e-5, atol=1e-5)
    assert ro.positions["t_close"] < batch.prompt_len + len(ids) - 1


# ------------------------------------------------------------------ 4. Platt slopes
def test_platt_matches_logistic_regression_when_the_slope_is_positive():
    rng = np.random.default_rng(0)
    s = rng.normal(size=600) * 2
    z = (rng.random(600) < 1 / (1 + np.exp(-(0.8 * s + 1.0)))).astype(int)
    lr = LogisticRegression(C=1e4, max_iter=1000).fit(s[:, None], z)
    a, b = fit_platt(s, z)
    assert a == pytest.approx(lr.coef_[0, 0], rel=1e-3)
    assert b == pytest.approx(lr.intercept_[0], rel=1e-3)
    assert not platt_inverted(s, z)


def test_platt_never_inverts_a_score():
    """A statistic that ranks the wrong way: the old fit returned a negative slope (an
    inverted score); now the slope stops at 0 and the method is declared inverted."""
    rng = np.random.default_rng(1)
    s = rng.normal(size=600)
    z = (rng.random(600) < 1 / (1 + np.exp(-(-1.5 * s + 2.0)))).astype(int)
    assert LogisticRegression(C=1e4).fit(s[:, None], z).coef_[0, 0] < 0
    a, b = fit_platt(s, z)
    assert a == 0.0
    assert platt([0.0], (a, b))[0] == pytest.approx(z.mean(), abs=1e-4)   # the base rate
    assert platt_inverted(s, z)


# ------------------------------------------------------------------ 5. μ(C) in float64
def test_a_stated_nine_stays_0_9():
    from heads.features import extract
    from models.readout import Readout, mu_from_digit_probs

    probs = torch.zeros(11)
    probs[9] = 1.0
    assert float(mu_from_digit_probs(probs)) == 0.9           # float32 gave 0.8999999761
    ro = Readout(h_pre=torch.zeros(4), h_close=torch.zeros(4), h_answer=torch.zeros(1, 4),
                 h_image=torch.zeros(2, 4), h_mid=torch.zeros(4),
                 token_logprobs=torch.zeros(2), token_entropy=torch.zeros(2),
                 answer_index=torch.tensor([0]), digit_probs=probs)
    mu = extract(ro)["mu"].numpy()
    assert mu.dtype == np.float64 and mu[0] == 0.9
    # counted by HCE@0.9 and in ECE-10's top bin
    assert hce(mu, np.array([0])) == 1.0
    assert ece(mu, np.array([1]), 10) == pytest.approx(0.1)


# ------------------------------------------------------------------ 6. defer search
def test_min_kept_by_hand():
    # the fewest k with 1 - level^(1/k) <= r
    for r, level in [(0.05, 0.1 / 10), (0.1, 0.05), (0.2, 0.1)]:
        k = next(k for k in range(1, 10_000) if beta.ppf(1 - level, 1, k) <= r)
        assert min_kept(r, level) == k


def test_defer_search_does_not_walk_into_the_top_tail():
    """100 items, the 10 least confident wrong. The old search tested the middle (50 kept,
    bound .08 > r), then ever higher thresholds that keep too few items to pass, and
    deferred everything. Skipping thresholds below k_min kept finds a feasible one."""
    c = np.arange(100) / 100
    z = np.r_[np.zeros(10), np.ones(90)]
    pol = choose_threshold(c, z, 0.05, 0.1)
    assert pol.feasible
    kept = int((c >= pol.tau).sum())
    level = 0.1 / math.ceil(math.log2(100 - min_kept(0.05, 0.1 / 7) + 1))
    errors = int((z[c >= pol.tau] == 0).sum())
    assert beta.ppf(1 - level, errors + 1, kept - errors) <= 0.05
    assert pol.coverage == kept / 100 and kept >= min_kept(0.05, 0.1 / 7)


# ------------------------------------------------------------------ 7. provenance
def _actor_folder(tmp_path):
    from safetensors.torch import save_file

    from models.loading import EMBEDDED_ACTOR

    folder = tmp_path / "actor"
    folder.mkdir()
    for f in EMBEDDED_ACTOR.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("edit", ["tokenizer_config.json", "chat_template.jinja",
                                  "processor_config.json", "system_prompt"])
def test_fingerprint_covers_what_states_depend_on(tmp_path, edit):
    from models.loading import fingerprint

    folder = _actor_folder(tmp_path)
    before = fingerprint(folder)
    if edit == "system_prompt":
        card = json.loads((folder / "actor_card.json").read_text())
        card["system_prompt"] = (card.get("system_prompt") or "") + " Be brief."
        (folder / "actor_card.json").write_text(json.dumps(card))
    else:
        with open(folder / edit, "a") as fh:
            fh.write("\n ")
    assert fingerprint(folder) != before


def test_card_names_a_dirty_tree(tmp_path):
    from heads.fit import DirtyTree, check_tree, git_describe

    head = one_commit_repo(tmp_path)
    assert git_describe(tmp_path) == {"describe": head, "dirty": False}
    (tmp_path / "a.txt").write_text("2")
    assert git_describe(tmp_path) == {"describe": head + "-dirty", "dirty": True}
    with pytest.raises(DirtyTree):
        check_tree(cwd=tmp_path)
    with pytest.warns(UserWarning, match="dirty"):
        assert check_tree(allow_dirty=True, cwd=tmp_path)["dirty"] is True


# ------------------------------------------------------------------ 8. empty and NaN input
def test_metrics_on_empty_and_out_of_range_input():
    assert math.isnan(ece(np.array([]), np.array([])))
    assert math.isnan(hce(np.array([]), np.array([])))
    with pytest.raises(ValueError):
        ece(np.array([0.5, 1.2]), np.array([1, 0]))
    with pytest.raises(ValueError):
        ece(np.array([0.5, np.nan]), np.array([1, 0]))


def test_bootstrap_counts_nan_resamples():
    """Two images, one all right and one all wrong: a resample of the same image twice has
    one class only (AUROC NaN); that happens in about half of the resamples."""
    clusters = ["a"] * 3 + ["b"] * 3
    z = np.array([1, 1, 1, 0, 0, 0])
    c = np.array([0.9, 0.8, 0.7, 0.2, 0.3, 0.1])

    def stat(idx):
        return float("nan") if len(set(z[idx])) < 2 else roc_auc_score(z[idx], c[idx])

    lo, hi, nan = resample_clusters_counted(clusters, stat, n=400)
    assert 150 < nan < 250 and (lo, hi) == (1.0, 1.0)
    with pytest.warns(RuntimeWarning, match=f"{nan} of 400"):
        resample_clusters(clusters, stat, n=400)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resample_clusters(clusters, lambda idx: 1.0, n=10)    # nothing to report


def test_risk_coverage_treats_ties_as_one_block():
    c = np.array([0.9, 0.5, 0.5, 0.5, 0.5])
    z1 = np.array([1, 1, 1, 0, 0])
    z2 = np.array([1, 0, 0, 1, 1])           # the same tied block, another order
    cov, risk = risk_coverage(c, z1)
    np.testing.assert_allclose(cov, [0.2, 1.0])
    np.testing.assert_allclose(risk, [0.0, 0.4])
    cov2, risk2 = risk_coverage(c, z2)
    np.testing.assert_allclose(cov2, [0.2, 1.0])
    np.testing.assert_allclose(risk2, [0.0, 0.4])


def test_old_cards_load_only_for_the_same_weights_with_a_warning(tmp_path):
    """Cards written before the fingerprint covered tokenizer etc. load for the same
    weights and config (scheme-1 fingerprint), warning to refit; new cards match exactly."""
    from heads.dualread import FingerprintMismatch, Heads
    from models.loading import fingerprint, legacy_fingerprint

    folder = _actor_folder(tmp_path)
    fp, old = fingerprint(folder), legacy_fingerprint(folder)
    assert fp != old
    heads = Heads.new(4)
    heads.actor_fingerprint = fp
    heads.save(tmp_path / "new", {})
    assert Heads.load(tmp_path / "new", fp).actor_fingerprint == fp
    card = json.loads((tmp_path / "new" / "heads_card.json").read_text())
    card["actor_fingerprint"] = old
    (tmp_path / "new" / "heads_card.json").write_text(json.dumps(card))
    with pytest.raises(FingerprintMismatch):       # a scheme-2 card must match exactly
        Heads.load(tmp_path / "new", fp)
    del card["fingerprint_scheme"]
    (tmp_path / "new" / "heads_card.json").write_text(json.dumps(card))
    with pytest.warns(UserWarning, match="refit"):
        Heads.load(tmp_path / "new", fp)
    with pytest.raises(FingerprintMismatch):
        Heads.load(tmp_path / "new", "0" * 16)
