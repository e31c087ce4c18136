"""Baselines read off the natural pass's tokens (docs/method.md §7): μ(C), sequence likelihood,
mean token log-prob and predictive entropy. Cost 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from heads.calibration import fit_oriented_platt, fit_temperature, logit, platt
from heads.registry import Features, FitData, Method

if TYPE_CHECKING:
    from heads.registry import HeadsState as Heads

NEUTRAL = (1.0, 0.0)   # identity-slope Platt map for heads fitted before the map existed


class Verbalized(Method):
    """The actor's own μ(C) from the digit readout (invalid → 0.5); nothing fitted."""

    name = "verbalized"
    served = True

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return f["mu"].flatten().double().numpy()


class MaxSequenceProbability(Method):
    """Geometric mean of answer-token probabilities, temperature-scaled."""

    name = "max_sequence_probability"

    def fit(self, heads: Heads, data: FitData) -> None:
        tp = data.on("temperature")
        heads.temperatures[self.name] = fit_temperature(logit(tp["msp"].flatten()).float(),
                                                        data.y("temperature"))

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        msp = f["msp"].flatten().double().clamp(1e-6, 1 - 1e-6)
        return torch.sigmoid(torch.log(msp / (1 - msp)) / heads.temperature(self.name)
                             ).double().numpy()


class PlattMapped(Method):
    """A scalar statistic of the natural pass, Platt-mapped on the temperature split.

    Which way the statistic ranks (higher log-prob, lower entropy = more confident) is
    the usual convention, not a law: the orientation is chosen on the temperature split
    and the map's slope is floored above 0 (`fit_oriented_platt`), so the baseline always
    ranks and is never a constant (a constant scores AUROC .500 by construction)."""

    feature = ""
    sign = 1.0

    def statistic(self, f: Features) -> np.ndarray:
        return self.sign * f[self.feature].flatten().numpy()

    def fit(self, heads: Heads, data: FitData) -> dict:
        s, z = self.statistic(data.on("temperature")), data.y("temperature").numpy()
        heads.platt_maps[self.name], log = fit_oriented_platt(s, z)
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return platt(self.statistic(f), heads.platt_map(self.name, NEUTRAL))


class MeanTokenLogprob(PlattMapped):
    name = "mean_token_logprob"
    feature = "mean_logprob"


class PredictiveEntropy(PlattMapped):
    name = "predictive_entropy"
    feature = "entropy"
    sign = -1.0
