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
