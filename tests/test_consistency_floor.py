"""The answer-consistency term is bounded: it lowers PER's log-odds by at most
CONSISTENCY_FLOOR nats, so one odd replay cannot take DualRead from sure to zero."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from heads.calibration import fuse
from heads.methods.dualread import (
    CONSISTENCY,
    CONSISTENCY_FLOOR,
    consistency_log_prob,
)


def _heads(q: float) -> SimpleNamespace:
    """A consistency reader that returns φ's first column as its logit."""
    return SimpleNamespace(readers={CONSISTENCY: lambda phi: phi[:, 0]},
                           offsets={CONSISTENCY: q})


def test_consistency_term_is_floored_and_still_zero_above_the_hinge():
    logits = torch.tensor([[5.0], [-0.5], [-3.0], [-40.0], [-1e4]])
    term = consistency_log_prob(_heads(q=-0.7), {"phi": logits})
    assert term[0] == 0.0                                  # above the hinge: no change
    assert -CONSISTENCY_FLOOR < float(term[2]) < 0         # a partial penalty stays as it was
    assert torch.allclose(term[3:], torch.tensor(-CONSISTENCY_FLOOR, dtype=term.dtype))
    assert bool((term >= -CONSISTENCY_FLOOR).all())


def test_dualread_drop_from_the_term_is_bounded():
    """Whatever the reader says, DualRead's log-odds fall by at most half the floor."""
    p_pre = torch.tensor([0.95, 0.99, 0.9], dtype=torch.float64)
    per = torch.logit(p_pre)                               # PER's calibrated log-odds
    term = consistency_log_prob(_heads(q=-0.1), {"phi": torch.full((3, 1), -1e4)})
    before = fuse(p_pre, torch.sigmoid(per))
    after = fuse(p_pre, torch.sigmoid(per + term))
    drop = torch.logit(before) - torch.logit(after)
    assert bool((drop <= CONSISTENCY_FLOOR / 2 + 1e-9).all()) and bool((drop > 0).all())
    assert float(after[0]) >= 0.719


def test_the_bound_holds_for_any_reader_output_and_any_calibrated_per():
    """Random PER log-odds, PSR and reader logits (hinge offsets too): the term never
    takes more than the floor, never adds, and DualRead's log-odds fall by at most half."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    phi = torch.randn(n, 1, generator=g, dtype=torch.float64) * 30
    pre = torch.sigmoid(torch.randn(n, generator=g, dtype=torch.float64) * 4)
    per = torch.randn(n, generator=g, dtype=torch.float64) * 6
    for q in (-5.0, -0.7, 0.0):
        term = consistency_log_prob(_heads(q=q), {"phi": phi})
        assert bool((term <= 0).all()) and bool((term >= -CONSISTENCY_FLOOR).all())
        drop = torch.logit(fuse(pre, torch.sigmoid(per))) - torch.logit(
            fuse(pre, torch.sigmoid(per + term)))
        assert bool((drop >= -1e-9).all())
        assert bool((drop <= CONSISTENCY_FLOOR / 2 + 1e-6).all())
        assert float(drop.max()) > CONSISTENCY_FLOOR / 2 - 0.01     # the bound is reached


def test_penalty_summary_on_own_answers_by_hand():
    """`studies.consistency_check.penalty_summary`: what the report says about the term on a
    group of answers (the actor's own wrong ones in the report)."""
    from studies.consistency_check import penalty_summary

    term = [0.0, 0.0, -1.0, -CONSISTENCY_FLOOR]
    p = [0.9, 0.6, 0.75, 0.5]
    free = [0.9, 0.6, 0.8, 0.74]
    s = penalty_summary(term, p, free, tau=0.7)
    assert s["n"] == 4 and s["share_zero"] == 0.5 and s["share_at_floor"] == 0.25
    assert s["share_ge_tau"] == 0.5 and s["share_ge_tau_without_term"] == 0.75
    assert s["mean"] == round(-(1 + CONSISTENCY_FLOOR) / 4, 4)
    assert s["quantiles"]["0.5"] == -0.5
    assert s["mean_dualread_drop"] == round((0.05 + 0.24) / 4, 4)
    assert penalty_summary([], [], [], tau=0.7) == {"n": 0}


def test_penalty_report_splits_own_wrong_from_right_and_undoes_only_the_term(monkeypatch):
    """`penalty_report` on stand-in scorers: wrong and right answers are not swapped, and
    'without the term' removes exactly the term from PER before fusing."""
    import studies.consistency_check as cc

    def term(heads, f):
        return f["t"]

    monkeypatch.setattr(cc, "consistency_log_prob", term)
    monkeypatch.setattr(cc, "p_pre", lambda heads, f: f["pre"])
    monkeypatch.setattr(cc, "p_post", lambda heads, f: torch.sigmoid(f["per"] + f["t"]))
    d = torch.float64
    own = {"z": torch.tensor([0, 0, 1]), "t": torch.tensor([0.0, -3.0, 0.0], dtype=d),
           "pre": torch.tensor([0.9, 0.9, 0.9], dtype=d),
           "per": torch.tensor([2.0, 2.0, 2.0], dtype=d)}
    flips = {"z": torch.tensor([1]), "t": torch.tensor([-CONSISTENCY_FLOOR], dtype=d),
             "pre": torch.tensor([0.9], dtype=d), "per": torch.tensor([2.0], dtype=d)}
    p_free = float(fuse(torch.tensor(0.9, dtype=d), torch.sigmoid(torch.tensor(2.0, dtype=d))))
    rep = cc.penalty_report(SimpleNamespace(defer_threshold=p_free - 1e-6), own, flips)
    w, r, f = rep["own_wrong"], rep["own_right"], rep["answer_flips"]
    assert (w["n"], r["n"], f["n"]) == (2, 1, 1)
    assert w["share_zero"] == 0.5 and w["mean"] == -1.5 and r["share_zero"] == 1.0
    assert w["share_ge_tau_without_term"] == 1.0 and w["share_ge_tau"] == 0.5
    assert f["share_at_floor"] == 1.0 and f["share_ge_tau"] == 0.0
    assert r["mean_dualread_drop"] == 0.0 and w["mean_dualread_drop"] > 0
