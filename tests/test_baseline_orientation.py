"""Mean token log-prob and predictive entropy choose their orientation on the fitting split
and never collapse to a constant (a constant scores AUROC .500 by construction)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heads import registry
from heads.calibration import fit_oriented_platt
from heads.dualread import Heads
from heads.metrics import auroc
from heads.registry import FitData


def _data(n: int, rank: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A statistic that ranks correct answers *below* wrong ones when `rank` < 0."""
    rng = np.random.default_rng(seed)
    z = rng.uniform(size=n) < 0.7
    return rank * z + rng.normal(size=n), z


@pytest.mark.parametrize("name,feature,sign", [("mean_token_logprob", "mean_logprob", 1.0),
                                               ("predictive_entropy", "entropy", -1.0)])
@pytest.mark.parametrize("rank", [-1.0, 1.0, 0.0])
def test_baseline_ranks_on_fitting_orientation_and_is_never_constant(name, feature, sign, rank):
    method = registry.get(name)
    # `rank` is how the *usual* orientation (high log-prob / low entropy) ranks
    fit_s, fit_z = _data(400, rank, 0)
    test_s, test_z = _data(400, rank, 1)
    feats = {feature: torch.tensor(sign * fit_s)[:, None]}
    data = FitData(feats=feats, z=torch.tensor(fit_z, dtype=torch.float32),
                   splits={"temperature": torch.arange(400)})
    heads = Heads.new(8, methods=[])
    log = method.fit(heads, data)
    scores = method.score(heads, {feature: torch.tensor(sign * test_s)[:, None]})
    assert np.ptp(scores) > 1e-3                              # not a constant
    got = auroc(scores, test_z)
    assert got != 0.5
    if rank:    # ranks the fitting split's way, whichever that is
        assert got > 0.65
        assert log["orientation"] == ("as defined" if rank > 0 else "flipped")
    assert log["fit_auroc_as_defined"] + log["fit_auroc_flipped"] == pytest.approx(1.0)


def test_oriented_platt_on_a_constant_statistic_stays_defined():
    ab, log = fit_oriented_platt(np.ones(50), np.r_[np.ones(25), np.zeros(25)])
    assert np.isfinite(ab).all() and log["orientation"] == "as defined"
