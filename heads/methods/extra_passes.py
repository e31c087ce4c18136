"""Baselines that pay for extra passes (SPEC §7): P(True), SC@K, semantic uncertainty."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from heads.calibration import fit_platt, platt
from heads.passes import K_SAMPLES
from heads.registry import Features, FitData, Method

if TYPE_CHECKING:
    from heads.dualread import Heads


class PTrue(Method):
    """Normalised first-token P(Yes) after a yes/no follow-up prompt; nothing fitted."""

    name = "p_true"
    cost = "1"
    passes = ("follow_up",)

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return f["ptrue"].double().numpy()


class SelfConsistency(Method):
    """SC@K: share of the first K samples agreeing with the greedy answer, Platt-mapped.

    The samples are drawn once (K_SAMPLES of them); SC@K reads the first K, so it is
    charged K / K_SAMPLES of that pass's time.
    """

    passes = ("samples",)
    fit_passes_on = "temperature"   # K samples per item: only where the map is fitted

    def __init__(self, k: int) -> None:
        self.k = k
        self.name = f"sc_{k}"
        self.cost = f"{k} generations"
        self.pass_share = k / K_SAMPLES

    def statistic(self, f: Features) -> np.ndarray:
        return f[f"sc{self.k}"].numpy()

    def fit(self, heads: Heads, data: FitData) -> None:
        s = data.scoped[self.fit_passes_on]
        heads.platt_maps[self.name] = fit_platt(self.statistic(s), s["z"].numpy())

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return platt(self.statistic(f), heads.platt_map(self.name))


class SemanticUncertainty(SelfConsistency):
    """Normalised semantic entropy of the K_SAMPLES samples, Platt-mapped negative."""

    def __init__(self) -> None:
        self.name = "semantic_uncertainty"
        self.cost = f"{K_SAMPLES} generations"
        self.pass_share = 1.0

    def statistic(self, f: Features) -> np.ndarray:
        return -f["semantic"].numpy()
