"""Hidden-state baselines (docs/method.md §7): SAPLMA and blind-image contrast (BICR).

Both are class-weighted MLPs with early stopping on held-out images, then temperature
scaling on the temperature split: the same protocol as DualRead's PSR.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from heads.calibration import fit_temperature
from heads.modules import BICR_HIDDEN, SAPLMA_HIDDEN, fit_mlp
from heads.registry import Features, FitData, Method, ReaderSpec

if TYPE_CHECKING:
    from heads.registry import HeadsState as Heads


@torch.no_grad()
def saplma_logits(heads: Heads, h_mid: torch.Tensor) -> torch.Tensor:
    return heads.readers["saplma"](h_mid) + heads.offsets.get("saplma", 0.0)


def bicr_input(h_real: torch.Tensor, h_black: torch.Tensor) -> torch.Tensor:
    return torch.cat([h_real, h_real - h_black], -1)


@torch.no_grad()
def bicr_logits(heads: Heads, h_real: torch.Tensor, h_black: torch.Tensor) -> torch.Tensor:
    return heads.readers["bicr"](bicr_input(h_real, h_black)) + heads.offsets.get("bicr", 0.0)


def score_bicr(heads: Heads, h_real: torch.Tensor, h_black: torch.Tensor) -> np.ndarray:
    t = heads.temperature(BlindImageContrast.name)
    return torch.sigmoid(bicr_logits(heads, h_real, h_black) / t).double().numpy()


class SAPLMA(Method):
    """MLP on the 0.625-depth state at t_close (captured while generating)."""

    name = "saplma"
    cost = "0 (states captured while generating)"
    readers = {"saplma": ReaderSpec(1, SAPLMA_HIDDEN)}

    def fit(self, heads: Heads, data: FitData) -> dict:
        log = fit_mlp(heads.readers["saplma"], data.x("h_mid", "reader_train"),
                      data.y("reader_train"), data.x("h_mid", "reader_val"),
                      data.y("reader_val"), seed=data.seed)
        heads.offsets["saplma"] = log["prior_offset"]
        heads.temperatures[self.name] = fit_temperature(
            saplma_logits(heads, data.x("h_mid", "temperature")), data.y("temperature"))
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return torch.sigmoid(saplma_logits(heads, f["h_mid"]) / heads.temperature(self.name)
                             ).double().numpy()


class BlindImageContrast(Method):
    """MLP on [h_close ; h_close − h_close(black image)]: the replay on a black image."""

    name = "blind_image_contrast"
    cost = "1 replay (black image)"
    passes = ("black_image",)
    fit_passes_on = "all"
    readers = {"bicr": ReaderSpec(2, BICR_HIDDEN)}

    def fit(self, heads: Heads, data: FitData) -> dict:
        x = bicr_input(data.feats["h_close"], data.feats["h_close_black"])
        tr, val = data.splits["reader_train"], data.splits["reader_val"]
        log = fit_mlp(heads.readers["bicr"], x[tr], data.z[tr], x[val], data.z[val],
                      seed=data.seed)
        heads.offsets["bicr"] = log["prior_offset"]
        heads.temperatures[self.name] = fit_temperature(
            bicr_logits(heads, data.x("h_close", "temperature"),
                        data.x("h_close_black", "temperature")), data.y("temperature"))
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return score_bicr(heads, f["h_close"], f["h_close_black"])
