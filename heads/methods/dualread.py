"""DualRead and its branches (SPEC §1): PSR, P-State, PER, and their log-odds fusion.

Fitted in this order (registration order): PSR alone; P-State, then frozen; PER's visual
reader on P-State's residual; each branch's temperature on the temperature split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from heads.calibration import fit_temperature, fuse
from heads.modules import PSR_HIDDEN, fit_linear, fit_mlp
from heads.registry import Features, FitData, Method, ReaderSpec

if TYPE_CHECKING:
    from heads.dualread import Heads

CAPTURED = "0 (states captured while generating)"
PSR_READER = {"psr": ReaderSpec(1, PSR_HIDDEN)}
STATE_READER = {"state": ReaderSpec(1)}
VISUAL_READER = {"visual": ReaderSpec(4)}


@torch.no_grad()
def pre_logits(heads: Heads, f: Features) -> torch.Tensor:
    return heads.readers["psr"](f["h_pre"]) + heads.offsets.get("psr", 0.0)


@torch.no_grad()
def state_logits(heads: Heads, f: Features) -> torch.Tensor:
    return heads.readers["state"](f["h_close"])


@torch.no_grad()
def post_logits(heads: Heads, f: Features) -> torch.Tensor:
    return state_logits(heads, f) + heads.readers["visual"](f["phi"])


def logits(heads: Heads, f: Features) -> dict[str, torch.Tensor]:
    return {"pre": pre_logits(heads, f), "state": state_logits(heads, f),
            "post": post_logits(heads, f)}


def p_pre(heads: Heads, f: Features) -> torch.Tensor:
    return torch.sigmoid(pre_logits(heads, f).double() / heads.temperature("psr"))


def p_post(heads: Heads, f: Features) -> torch.Tensor:
    return torch.sigmoid(post_logits(heads, f).double() / heads.temperature("per"))


class PSR(Method):
    name = "psr"
    cost = CAPTURED
    served = True
    ours = True
    readers = PSR_READER

    def fit(self, heads: Heads, data: FitData) -> dict:
        # MLP, class-weighted BCE, early stopping on held-out images; fitted independently
        log = fit_mlp(heads.readers["psr"], data.x("h_pre", "reader_train"),
                      data.y("reader_train"), data.x("h_pre", "reader_val"),
                      data.y("reader_val"), seed=data.seed)
        heads.offsets["psr"] = log["prior_offset"]
        heads.temperatures[self.name] = fit_temperature(
            pre_logits(heads, data.on("temperature")), data.y("temperature"))
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return p_pre(heads, f).numpy()


class PState(Method):
    name = "p_state"
    cost = CAPTURED
    ours = True
    readers = STATE_READER

    def fit(self, heads: Heads, data: FitData) -> dict:
        log = fit_linear(heads.readers["state"], data.x("h_close", "reader"), data.y("reader"))
        heads.temperatures[self.name] = fit_temperature(
            state_logits(heads, data.on("temperature")), data.y("temperature"))
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return torch.sigmoid(state_logits(heads, f) / heads.temperature(self.name)
                             ).double().numpy()


class PER(Method):
    """Post-answer branch: P-State (frozen) plus P-Visual fitted on its residual."""

    name = "per"
    cost = CAPTURED
    served = True
    ours = True
    readers = {**STATE_READER, **VISUAL_READER}

    def fit(self, heads: Heads, data: FitData) -> dict:
        l_state = state_logits(heads, data.on("reader"))
        log = fit_linear(heads.readers["visual"], data.x("phi", "reader"), data.y("reader"),
                         offset=l_state)
        heads.temperatures[self.name] = fit_temperature(
            post_logits(heads, data.on("temperature")), data.y("temperature"))
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return p_post(heads, f).numpy()


class DualRead(Method):
    """p_DR = σ(½·logit(p_pre) + ½·logit(p_post)): no weights of its own to fit."""

    name = "dualread"
    cost = CAPTURED
    served = True
    ours = True
    readers = {**PSR_READER, **STATE_READER, **VISUAL_READER}

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return fuse(p_pre(heads, f), p_post(heads, f)).double().numpy()
