"""Baselines that pay for extra passes (docs/method.md §7): P(True), SC@K, semantic uncertainty."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from heads.calibration import fit_platt, logit, platt, platt_log
from heads.passes import K_SAMPLES
from heads.registry import Features, FitData, Method

if TYPE_CHECKING:
    from heads.registry import HeadsState as Heads


class PTrue(Method):
    """Normalised P(True) after the actor's response and Kadavath et al.'s template, Platt-
    mapped in log-odds on the temperature split (a raw P(True) of a model never trained on
    the follow-up is not a probability of being right)."""

    name = "p_true"
    cost = "1"
    passes = ("follow_up",)
    fit_passes_on = "temperature"

    def statistic(self, f: Features) -> np.ndarray:
        return logit(f["ptrue"].double()).numpy()

    def fit(self, heads: Heads, data: FitData) -> dict:
        f = data.scoped[self.fit_passes_on]
        s, z = self.statistic(f), f["z"].numpy()
        heads.platt_maps[self.name] = fit_platt(s, z)
        return platt_log(s, z, heads.platt_maps[self.name])

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return platt(self.statistic(f), heads.platt_map(self.name))


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

    def fit(self, heads: Heads, data: FitData) -> dict:
        f = data.scoped[self.fit_passes_on]
        s, z = self.statistic(f), f["z"].numpy()
        heads.platt_maps[self.name] = fit_platt(s, z)     # slope ≥ 0: never inverted
        return platt_log(s, z, heads.platt_maps[self.name])

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
