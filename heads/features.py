"""Features read off a `Readout` (SPEC §1): cheap, and the same offline and online."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.readout import Readout

# SPEC §1's κ, the default when heads are fitted. Fitted heads store the κ they were fitted
# with (`Heads.kappa`); evaluation and serving use that stored value, never this constant.
KAPPA = 0.1
# Bump when what `extract` returns changes meaning (names, shapes, definitions): cached
# readouts carry this version in their key, so old shards are not reused. The cache key
# also hashes this module's source, which catches edits nobody remembered to version.
# 3: μ in float64, mean log-prob over the answer span, SAPLMA's state
# 4: `img_mean` / `img_std` (mean and std of the image-token states), the novelty
#    detector's input beside h_pre
FEATURE_SCHEMA = 4


def evidence_pool(h_ans: torch.Tensor, v: torch.Tensor, kappa: float = KAPPA
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Answer-conditioned pooling of image states.

    α_j = softmax_j(cos(h_ans, v_j) / κ), h_evid = Σ α_j v_j. Returns (h_global, h_evid, α).
    """
    h_global = v.mean(0)
    alpha = torch.softmax(F.cosine_similarity(h_ans[None], v, dim=-1) / kappa, dim=0)
    return h_global, alpha @ v, alpha


def phi(h_ans: torch.Tensor, v: torch.Tensor, kappa: float = KAPPA) -> torch.Tensor:
    """φ = [h_global ; h_evid ; h_ans ⊙ h_evid ; |h_ans − h_evid|]  (4D)."""
    h_global, h_evid, _ = evidence_pool(h_ans, v, kappa)
    return torch.cat([h_global, h_evid, h_ans * h_evid, (h_ans - h_evid).abs()])


def image_stats(h_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std over the image tokens of [M, D] states, as the shift study
    measured them; std is 0 for a single token rather than NaN."""
    v = h_image.float()
    std = v.std(0) if len(v) > 1 else torch.zeros_like(v[0])
    return v.mean(0), std


def extract(ro: Readout, kappa: float = KAPPA) -> dict[str, torch.Tensor]:
    """Everything any scorer needs from one readout, as flat float tensors."""
    ans_lp = ro.answer_logprobs
    ans_ent = ro.token_entropy[ro.answer_index] if len(ro.answer_index) else ro.token_entropy
    mu = ro.verbalized_mu
    img_mean, img_std = image_stats(ro.h_image)
    return {
        "h_pre": ro.h_pre.float(),
        "h_close": ro.h_close.float(),
        "phi": phi(ro.h_ans.float(), ro.h_image.float(), kappa),
        "h_mid": ro.h_mid.float(),
        # the novelty detector reads [h_pre ; img_mean ; img_std] (heads.novelty)
        "img_mean": img_mean,
        "img_std": img_std,
        # sequence statistics over the answer span (SPEC §7)
        "msp": ans_lp.mean().exp().reshape(1) if len(ans_lp) else torch.zeros(1),
        # over the answer span, like the other sequence scores (SPEC §7)
        "mean_logprob": ans_lp.mean().reshape(1) if len(ans_lp) else torch.zeros(1),
        "entropy": ans_ent.mean().reshape(1) if len(ans_ent) else torch.zeros(1),
        # float64: a stated 9 must stay 0.9 (HCE@0.9, ECE bins)
        "mu": torch.tensor([0.5 if mu is None else mu], dtype=torch.float64),
    }
