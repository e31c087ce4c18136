"""Edges of DualRead's scoring method (heads/methods/dualread.py) that mutation testing
found untested: `natural_intercept`'s refusal and narrow brackets, `consistency_rows` on
an empty split and its refusal, the answer-consistency reader's fit log, worked out here
from the fitted reader, on data where its term is clipped at both ends, that reader read
once per scoring call, and PER's fit by parts (rows, weights, residual, intercept refit).

No model: features are drawn here (as in tests/test_answer_consistency.py), with the
agreement coordinate noisy so that own and flipped trajectories overlap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from heads import registry
from heads.dualread import Heads
from heads.methods.dualread import (
    CONSISTENCY,
    CONSISTENCY_FLOOR,
    CONSISTENCY_QUANTILE,
    PER,
    POST_L2,
    PSR,
    AnswerConsistency,
    DualRead,
    PState,
    branch_log_odds,
    consistency_rows,
    natural_intercept,
    reader_rows,
    state_logits,
)
from heads.modules import fit_linear, prior_bce
from heads.registry import FitData

DIM = 4
AGREE = 1
SKIPPED = "no answer-flipped trajectories on the reader-train images"


def _data(seed: int = 0, n: int = 300, val: int = 50) -> FitData:
    """300 items, the first 200 the reader split (shuffled; its last `val` are
    reader_val); one φ coordinate about +1 on own trajectories and −1 on their flips,
    with unit noise, so the fitted reader ranks well but not perfectly."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.rand(n, generator=g) < 0.85).float()
    h = torch.randn(n, DIM, generator=g)
    phi = torch.randn(n, 4 * DIM, generator=g)
    fphi = phi.clone()
    phi[:, AGREE] += 1.0
    fphi[:, AGREE] -= 1.0
    ok = torch.ones(n)
    ok[::7] = 0                                   # no flip rule for these
    reader = torch.randperm(200, generator=g)
    splits = {"reader": reader, "reader_train": reader[: 200 - val],
              "reader_val": reader[200 - val:], "temperature": torch.arange(200, n)}
    scoped = {"reader": {"flip_ok": ok[reader], "z": z[reader], "flip_phi": fphi[reader],
                         "flip_h_close": h[reader]}}
    return FitData({"h_close": h, "phi": phi}, z, splits, scoped, seed=seed)


def _fit(data: FitData) -> tuple[Heads, dict]:
    torch.manual_seed(0)
    heads = Heads.new(DIM, [AnswerConsistency()])
    return heads, AnswerConsistency().fit(heads, data)


def test_the_fit_log_is_worked_out_from_the_fitted_reader():
    data = _data()
    heads, log = _fit(data)
    xv, yv = consistency_rows(data, "reader_val")
    with torch.no_grad():
        c = heads.readers[CONSISTENCY](xv).double()
    lp = F.logsigmoid(c).numpy()
    own, flipped = lp[yv.numpy() == 1], lp[yv.numpy() == 0]
    q = float(np.quantile(own, CONSISTENCY_QUANTILE))
    # the hinge binds at both ends for some flipped answers: above q (term 0) and more
    # than the floor below it
    assert (flipped - q > 0).any() and (flipped - q < -CONSISTENCY_FLOOR).any()
    term = np.clip(flipped - q, -CONSISTENCY_FLOOR, 0.0)
    assert heads.offsets[CONSISTENCY] == pytest.approx(q, abs=1e-6)
    q = heads.offsets[CONSISTENCY]
    assert log["quantile"] == CONSISTENCY_QUANTILE
    assert log["hinge_log_prob"] == round(q, 5)
    assert log["val_auroc_own_vs_flipped"] == round(float(roc_auc_score(yv.numpy(), c)), 4)
    assert log["val_own_mean_log_prob"] == round(float(own.mean()), 4)
    assert log["val_flipped_mean_log_prob"] == round(float(flipped.mean()), 4)
    assert log["val_flipped_mean_term"] == round(float(term.mean()), 4)


def test_no_held_out_own_trajectory_leaves_the_hinge_at_zero():
    """An empty reader_val: no quantile to take (the term's hinge is 0) and no validation
    numbers, rather than an error."""
    data = _data(val=0)
    x, y = consistency_rows(data, "reader_val")
    assert x.shape == (0, 4 * DIM) and y.shape == (0,)
    heads, log = _fit(data)
    assert heads.offsets[CONSISTENCY] == 0.0 and log["hinge_log_prob"] == 0.0
    assert not [k for k in log if k.startswith("val_")]


def test_held_out_images_without_a_flip_give_no_validation_numbers():
    """Own trajectories only in reader_val (no answer there has a flip rule): the hinge is
    still their quantile, but there is nothing to tell them from."""
    data = _data()
    val = torch.isin(data.splits["reader"], data.splits["reader_val"])
    data.scoped["reader"]["flip_ok"][val] = 0
    heads, log = _fit(data)
    xv, yv = consistency_rows(data, "reader_val")
    assert bool((yv == 1).all()) and len(yv) == len(data.splits["reader_val"])
    assert heads.offsets[CONSISTENCY] != 0.0
    assert not [k for k in log if k.startswith("val_")]


def test_a_skipped_fit_says_why_and_can_be_run_again():
    """No flipped trajectory on reader_train: the reader is dropped, and fitting again
    (heads without the reader now) skips again instead of failing."""
    data = _data()
    data.scoped["reader"]["flip_ok"] = torch.zeros_like(data.scoped["reader"]["flip_ok"])
    heads, log = _fit(data)
    assert log == {"skipped": SKIPPED} and CONSISTENCY not in heads.readers
    assert AnswerConsistency().fit(heads, data) == {"skipped": SKIPPED}
    assert CONSISTENCY not in heads.readers


def test_consistency_rows_refusal_names_the_missing_pass():
    data = _data()
    with pytest.raises(ValueError) as e:
        consistency_rows(FitData(data.feats, data.z, data.splits), "reader_val")
    assert str(e.value) == ("the answer-consistency reader needs the answer_flip pass on "
                            "the reader split")


def test_natural_intercept_refuses_all_wrong_labels_with_its_own_message():
    for z in (torch.zeros(3), torch.ones(3)):
        with pytest.raises(ValueError) as e:
            natural_intercept(torch.tensor([0.0, 1.0, 2.0]), z)
        assert str(e.value) == "the natural rows need both right and wrong answers"


def test_natural_intercept_solves_a_bracket_narrower_than_one():
    """Logits spread by 0.3 (not equal up to rounding): the root inside the bracket, not
    its lower end."""
    from scipy.optimize import brentq

    logits = torch.tensor([0.0, 0.1, 0.3, 0.2, 0.05])
    z = torch.tensor([1.0, 0, 0, 1, 1])
    ref = brentq(lambda b: float(torch.sigmoid(logits.double() + b).mean()) - 0.6, -5, 5,
                 xtol=1e-13)
    b = natural_intercept(logits, z)
    assert b == pytest.approx(ref, abs=1e-9)
    assert b - (np.log(0.6 / 0.4) - 0.3) > 0.01          # well inside the bracket


def test_one_scoring_call_reads_the_consistency_reader_once():
    """PER, DualRead and `branch_log_odds` in one scoring call (`registry.Scored`) share
    the consistency term, as they share PSR's and PER's log-odds (tests/test_heads.py)."""
    torch.manual_seed(0)
    h = Heads.new(DIM, [PSR(), PState(), PER(), AnswerConsistency(), DualRead()])
    for reader in h.readers.values():
        reader.eval()
    calls = []
    h.readers[CONSISTENCY].register_forward_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(1)
    f = {"h_pre": torch.randn(3, DIM, generator=g), "h_close": torch.randn(3, DIM, generator=g),
         "phi": torch.randn(3, 4 * DIM, generator=g)}
    alone = [registry.get(n).score(h, dict(f)) for n in ("per", "dualread")]
    assert len(calls) == 2
    calls.clear()
    shared = registry.Scored(dict(f))
    kept = [registry.get(n).score(h, shared) for n in ("per", "dualread")]
    lg = branch_log_odds(h, shared)
    assert len(calls) == 1
    assert all(np.array_equal(a, k) for a, k in zip(alone, kept))
    assert np.array_equal(lg, branch_log_odds(h, dict(f)))


def test_post_branch_fit_is_the_weighted_residual_fit_then_the_natural_intercept():
    """PER's fit by parts, each fitted in the test (mutmut credits a module-scoped
    fixture's fit to the first test only): `fit_linear` on `reader_rows`' rows and
    weights, on P-State's residual, then the bias moved by `natural_intercept` of the
    natural rows; without flips, no intercept refit."""
    data = _data()
    torch.manual_seed(0)
    heads = Heads.new(DIM, [PState(), PER()])
    log_state = PState(0.0).fit(heads, data)
    assert log_state["flipped_rows"] == 0 and "natural_intercept_shift" not in log_state
    log = PER(0.5).fit(heads, data)

    ref = Heads.new(DIM, [PState(), PER()])
    ref.readers["state"].load_state_dict(heads.readers["state"].state_dict())
    feats, z, w = reader_rows(data, 0.5)
    n = len(data.y("reader"))
    assert len(z) > n and not bool((w == 1).all())
    offset = state_logits(ref, feats)
    fit_linear(ref.readers["visual"], feats["phi"], z, offset=offset, weight=w, l2=POST_L2)
    with torch.no_grad():
        shift = natural_intercept(ref.readers["visual"](feats["phi"][:n]) + offset[:n], z[:n])
    assert log["flipped_rows"] == len(z) - n
    assert log["natural_intercept_shift"] == round(shift, 5)
    fitted, want = heads.readers["visual"].net[-1], ref.readers["visual"].net[-1]
    torch.testing.assert_close(fitted.weight, want.weight)
    torch.testing.assert_close(fitted.bias, want.bias + shift)
    # the natural rows' BCE after the refit, and their base rate's, to five places
    with torch.no_grad():
        nat = heads.readers["visual"](feats["phi"][:n]) + offset[:n]
    assert log["natural_bce"] == round(float(F.binary_cross_entropy_with_logits(
        nat.float(), z[:n].float())), 5)
    assert log["natural_prior_bce"] == round(prior_bce(float(z[:n].mean())), 5)


def test_reader_rows_keep_a_single_flipped_row():
    data = _data()
    scoped = data.scoped["reader"]
    one = int(torch.nonzero(scoped["z"] == 1)[0])
    scoped["flip_ok"] = torch.zeros_like(scoped["flip_ok"])
    scoped["flip_ok"][one] = 1
    feats, z, w = reader_rows(data, 0.5)
    n = len(data.y("reader"))
    assert len(z) == n + 1 and float(z[-1]) == 0.0
    assert float(w[-1]) == 0.5 * n
    torch.testing.assert_close(feats["phi"][-1], scoped["flip_phi"][one])
