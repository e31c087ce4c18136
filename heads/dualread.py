"""The fitted heads: DualRead branches, baselines' mappings, the defer policy, artefacts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from heads.calibration import fuse, platt
from heads.defer import DeferPolicy
from heads.features import KAPPA
from heads.modules import BICR_HIDDEN, PSR_HIDDEN, SAPLMA_HIDDEN, Reader

EMBEDDED_HEADS = Path(__file__).parent / "embedded"


class FingerprintMismatch(RuntimeError):
    pass


@dataclass
class Heads:
    dim: int
    psr: Reader
    state: Reader
    visual: Reader
    saplma: Reader
    bicr: Reader
    t_pre: float = 1.0
    t_post: float = 1.0
    t_state: float = 1.0
    t_saplma: float = 1.0
    t_bicr: float = 1.0
    t_msp: float = 1.0
    platt: dict[str, tuple[float, float]] = field(default_factory=dict)
    # -log(pos_weight) of each class-weighted MLP (PSR, SAPLMA, BICR)
    offsets: dict[str, float] = field(default_factory=dict)
    policy: DeferPolicy | None = None
    kappa: float = KAPPA
    actor_fingerprint: str = ""
    card: dict = field(default_factory=dict)

    @classmethod
    def new(cls, dim: int) -> Heads:
        return cls(dim=dim, psr=Reader(dim, PSR_HIDDEN), state=Reader(dim),
                   visual=Reader(4 * dim), saplma=Reader(dim, SAPLMA_HIDDEN),
                   bicr=Reader(2 * dim, BICR_HIDDEN))

    # ------------------------------------------------------------- scoring
    @torch.no_grad()
    def logits(self, f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        l_pre = self.psr(f["h_pre"]) + self.offsets.get("psr", 0.0)
        l_state = self.state(f["h_close"])
        l_post = l_state + self.visual(f["phi"])
        return {"pre": l_pre, "state": l_state, "post": l_post}

    @torch.no_grad()
    def score(self, f: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Confidence of every readout-only method for a batch of features."""
        lg = self.logits(f)
        p_pre = torch.sigmoid(lg["pre"].double() / self.t_pre)
        p_post = torch.sigmoid(lg["post"].double() / self.t_post)
        msp = f["msp"].flatten().double().clamp(1e-6, 1 - 1e-6)
        out = {
            "psr": p_pre,
            "p_state": torch.sigmoid(lg["state"] / self.t_state),
            "per": p_post,
            "dualread": fuse(p_pre, p_post),
            "verbalized": f["mu"].flatten(),
            "max_sequence_probability": torch.sigmoid(torch.log(msp / (1 - msp)) / self.t_msp),
            "saplma": torch.sigmoid(self.saplma_logits(f["h_mid"]) / self.t_saplma),
        }
        res = {k: v.double().numpy() for k, v in out.items()}
        res["mean_token_logprob"] = platt(f["mean_logprob"].flatten().numpy(),
                                          self.platt.get("mean_token_logprob", (1.0, 0.0)))
        res["predictive_entropy"] = platt(-f["entropy"].flatten().numpy(),
                                          self.platt.get("predictive_entropy", (1.0, 0.0)))
        return res

    def confidence(self, readout) -> dict[str, float]:
        """The online view for one readout: DualRead, its branches and μ(C)."""
        from heads.features import extract

        f = {k: v[None] for k, v in extract(readout, self.kappa).items()}
        s = self.score(f)
        return {"dualread": float(s["dualread"][0]), "psr": float(s["psr"][0]),
                "per": float(s["per"][0]), "verbalized": float(s["verbalized"][0])}

    @torch.no_grad()
    def saplma_logits(self, h_mid: torch.Tensor) -> torch.Tensor:
        return self.saplma(h_mid) + self.offsets.get("saplma", 0.0)

    @torch.no_grad()
    def bicr_logits(self, h_real: torch.Tensor, h_black: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h_real, h_real - h_black], -1)
        return self.bicr(x) + self.offsets.get("bicr", 0.0)

    @torch.no_grad()
    def score_bicr(self, h_real: torch.Tensor, h_black: torch.Tensor) -> np.ndarray:
        return torch.sigmoid(self.bicr_logits(h_real, h_black) / self.t_bicr).double().numpy()

    def defer(self, p: float) -> bool:
        return True if self.policy is None else self.policy.defer(p)

    # ------------------------------------------------------------- artefacts
    def save(self, folder: str | Path, card: dict) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name in ("psr", "state", "visual", "saplma", "bicr"):
            for k, v in getattr(self, name).state_dict().items():
                tensors[f"{name}.{k}"] = v.contiguous()
        save_file(tensors, str(folder / "heads.safetensors"))
        card = {**card, "actor_fingerprint": self.actor_fingerprint, "feature_dim": self.dim,
                "kappa": self.kappa, "temperatures": {
                    "T_pre": self.t_pre, "T_post": self.t_post, "T_state": self.t_state,
                    "T_saplma": self.t_saplma, "T_bicr": self.t_bicr, "T_msp": self.t_msp},
                "platt": self.platt, "prior_offsets": self.offsets,
                "defer": self.policy.to_dict() if self.policy else None}
        self.card = card
        (folder / "heads_card.json").write_text(json.dumps(card, indent=2))

    @classmethod
    def load(cls, folder: str | Path | None = None, actor_fingerprint: str | None = None
             ) -> Heads:
        folder = Path(folder) if folder else EMBEDDED_HEADS
        card_path = folder / "heads_card.json"
        if not card_path.exists():
            raise FileNotFoundError(f"no heads at {folder} (expected heads_card.json)")
        card = json.loads(card_path.read_text())
        if actor_fingerprint is not None and card["actor_fingerprint"] != actor_fingerprint:
            raise FingerprintMismatch(
                f"heads in {folder} were fitted for actor {card['actor_fingerprint']}, "
                f"not for the loaded actor {actor_fingerprint}; refit with `dualread fit-heads`")
        heads = cls.new(int(card["feature_dim"]))
        state = load_file(str(folder / "heads.safetensors"))
        for name in ("psr", "state", "visual", "saplma", "bicr"):
            sub = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")}
            getattr(heads, name).load_state_dict(sub)
            getattr(heads, name).eval()
        t = card["temperatures"]
        heads.t_pre, heads.t_post, heads.t_state = t["T_pre"], t["T_post"], t["T_state"]
        heads.t_saplma, heads.t_bicr, heads.t_msp = t["T_saplma"], t["T_bicr"], t["T_msp"]
        heads.platt = {k: tuple(v) for k, v in card.get("platt", {}).items()}
        heads.offsets = dict(card.get("prior_offsets", {}))
        heads.policy = DeferPolicy(**card["defer"]) if card.get("defer") else None
        heads.kappa = card.get("kappa", KAPPA)
        heads.actor_fingerprint = card["actor_fingerprint"]
        heads.card = card
        return heads
