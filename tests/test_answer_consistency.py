"""The answer-consistency term of PER (issue 11): a reader on φ telling the actor's own
trajectories from answer-flipped replays, whose log σ(c) joins PER's calibrated log-odds.

Constructed data as in test_answer_flip: one φ coordinate is +1 on every own trajectory,
right or wrong, and −1 on its flipped replay."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from heads import registry
from heads.calibration import fuse
from heads.dualread import Heads
from heads.methods.dualread import (
    CONSISTENCY,
    CONSISTENCY_QUANTILE,
    PER,
    AnswerConsistency,
    PState,
    consistency_rows,
    p_post,
    post_logits,
)
from heads.registry import FitData

DIM = 4
AGREE = 1


def _data(seed: int = 0) -> FitData:
    g = torch.Generator().manual_seed(seed)
    n = 300
    z = (torch.rand(n, generator=g) < 0.85).float()
    h = torch.randn(n, DIM, generator=g)
    phi = torch.randn(n, 4 * DIM, generator=g)
    phi[:, AGREE] = 1.0
    fphi = phi.clone()
    fphi[:, AGREE] = -1.0
    ok = torch.ones(n)
    ok[::7] = 0                                   # no flip rule for these
    # reader items are 0..199 in a shuffled order; reader_train / reader_val split them
    reader = torch.randperm(200, generator=g)
    splits = {"reader": reader, "reader_train": reader[:150], "reader_val": reader[150:],
              "temperature": torch.arange(200, 300)}
    # scoped rows follow the reader split's order
    scoped = {"reader": {"flip_ok": ok[reader], "z": z[reader], "flip_phi": fphi[reader],
                         "flip_h_close": h[reader]}}
    return FitData({"h_close": h, "phi": phi}, z, splits, scoped, seed=seed)


def test_rows_are_own_trajectories_then_their_flips_for_the_sub_split():
    data = _data()
    x, y = consistency_rows(data, "reader_val")
    val = data.splits["reader_val"]
    with_flip = [int(i) for i in val if int(i) % 7 != 0]
    assert y.tolist() == [1.0] * len(val) + [0.0] * len(with_flip)
    torch.testing.assert_close(x[: len(val)], data.feats["phi"][val])
    flipped = data.feats["phi"][with_flip].clone()
    flipped[:, AGREE] = -1.0
    torch.testing.assert_close(x[len(val):], flipped)
    with pytest.raises(ValueError, match="answer_flip"):
        consistency_rows(FitData(data.feats, data.z, data.splits), "reader_val")


def test_the_fitted_term_is_near_zero_on_own_answers_and_strongly_negative_on_flips():
    data = _data()
    torch.manual_seed(0)
    heads = Heads.new(DIM, [AnswerConsistency()])
    log = AnswerConsistency().fit(heads, data)
    assert log["val_auroc_own_vs_flipped"] == 1.0
    assert log["val_own_mean_log_prob"] > -0.1
    assert log["val_flipped_mean_log_prob"] < -2.0
    # the hinge is the CONSISTENCY_QUANTILE quantile of log σ(c) over the held-out own
    # trajectories
    val = data.splits["reader_val"]
    with torch.no_grad():
        own = F.logsigmoid(heads.readers[CONSISTENCY](data.feats["phi"][val]).double())
    hinge = float(np.quantile(own.numpy(), CONSISTENCY_QUANTILE))
    assert heads.offsets[CONSISTENCY] == pytest.approx(hinge, rel=1e-5)
    assert log["hinge_log_prob"] == pytest.approx(heads.offsets[CONSISTENCY], abs=1e-5)
    assert log["val_flipped_mean_term"] < -1.0
    n_train = len(data.splits["reader_train"])
    assert log["rows"] == n_train + sum(int(i) % 7 != 0 for i in data.splits["reader_train"])
    assert log["flipped_rows"] == log["rows"] - n_train
    score = registry.get("answer_consistency").score(heads, {"phi": data.feats["phi"][:5]})
    assert score.dtype.kind == "f" and (score > 0.9).all()


def _set_linear(reader, w: torch.Tensor, b: float) -> None:
    with torch.no_grad():
        reader.norm.mean.zero_()
        reader.norm.std.fill_(1.0)
        reader.net[-1].weight.copy_(w[None])
        reader.net[-1].bias.fill_(b)


def test_per_adds_log_sigmoid_of_the_consistency_logit_to_its_calibrated_log_odds():
    torch.manual_seed(0)
    heads = Heads.new(DIM, [PState(), PER(), AnswerConsistency()])
    heads.temperatures["per"] = 2.0
    w_state, w_vis, w_c = torch.zeros(DIM), torch.zeros(4 * DIM), torch.zeros(4 * DIM)
    w_state[0], w_vis[1], w_c[AGREE] = 1.0, 0.5, 3.0
    _set_linear(heads.readers["state"], w_state, 0.2)
    _set_linear(heads.readers["visual"], w_vis, -0.1)
    _set_linear(heads.readers[CONSISTENCY], w_c, 1.0)
    h = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0]])
    phi = torch.zeros(2, 4 * DIM)
    phi[:, 1] = torch.tensor([1.0, -1.0])        # AGREE = 1: own, then flipped
    f = {"h_close": h, "phi": phi}
    # by hand: post = (h0 + 0.2) + (0.5·φ1 − 0.1); c = 3·φ1 + 1
    post = torch.tensor([1.0 + 0.2 + 0.5 - 0.1, 2.0 + 0.2 - 0.5 - 0.1], dtype=torch.float64)
    c = torch.tensor([4.0, -2.0], dtype=torch.float64)
    # no hinge (q = 0): log σ(c) itself
    torch.testing.assert_close(p_post(heads, f),
                               torch.sigmoid(post / 2.0 + torch.log(torch.sigmoid(c))))
    # hinge at q = −0.5: log σ(4) + 0.5 > 0 → 0; log σ(−2) + 0.5 = −1.6269...
    heads.offsets[CONSISTENCY] = -0.5
    term = torch.tensor([0.0, math.log(1 / (1 + math.exp(2.0))) + 0.5], dtype=torch.float64)
    torch.testing.assert_close(p_post(heads, f), torch.sigmoid(post / 2.0 + term))
    torch.testing.assert_close(post_logits(heads, f).double(), post, rtol=0, atol=1e-6)
    # without the reader (heads fitted before it existed) PER is the plain branch
    del heads.readers[CONSISTENCY]
    torch.testing.assert_close(p_post(heads, f), torch.sigmoid(post / 2.0))


def test_a_flipped_answer_lowers_dualread_through_the_term():
    """Fitted end to end on the constructed data: the natural readers cannot see the flip
    (the agreement coordinate is constant in natural data), the term can."""
    data = _data()
    torch.manual_seed(0)
    heads = Heads.new(DIM, [PState(0.0), PER(0.0), AnswerConsistency()])
    for m in (PState(0.0), PER(0.0), AnswerConsistency()):
        m.fit(heads, data)
    val = data.splits["reader_val"]
    own = {"h_close": data.feats["h_close"][val], "phi": data.feats["phi"][val]}
    flipped = {"h_close": own["h_close"], "phi": own["phi"].clone()}
    flipped["phi"][:, AGREE] = -1.0
    p_pre = torch.full((len(val),), 0.9, dtype=torch.float64)
    drop = fuse(p_pre, p_post(heads, own)) - fuse(p_pre, p_post(heads, flipped))
    assert float(drop.min()) > 0.2
    # and on own answers the term moves PER by little: log σ(c) ≈ 0
    lp = F.logsigmoid(heads.readers[CONSISTENCY](own["phi"]))
    assert float(lp.mean()) > math.log(0.9)


def test_without_any_flippable_answer_the_term_is_skipped_not_left_unfitted():
    data = _data()
    data.scoped["reader"]["flip_ok"] = torch.zeros_like(data.scoped["reader"]["flip_ok"])
    torch.manual_seed(0)
    heads = Heads.new(DIM, [PState(), PER(), AnswerConsistency()])
    log = AnswerConsistency().fit(heads, data)
    assert "skipped" in log and CONSISTENCY not in heads.readers
    f = {"h_close": data.feats["h_close"][:3], "phi": data.feats["phi"][:3]}
    heads.temperatures["per"] = 1.0
    torch.testing.assert_close(p_post(heads, f),
                               torch.sigmoid(post_logits(heads, f).double()))
