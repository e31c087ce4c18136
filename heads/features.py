"""Features read off a `Readout` (docs/method.md §1): cheap, and the same offline and online."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models.readout import Readout, mean_answer_state, mu_from_digit_probs

# docs/method.md §1's κ, the default when heads are fitted. Fitted heads store the κ they were
# fitted with (`Heads.kappa`); evaluation and serving use that stored value, never this constant.
KAPPA = 0.1
# Bump when what `extract` returns changes meaning (names, shapes, definitions): cached
# readouts carry this version in their key, so old shards are not reused. The cache key
# also hashes this module's source, which catches edits nobody remembered to version.
# 3: μ in float64, mean log-prob over the answer span, SAPLMA's state
# 4: `img_mean` / `img_std` (mean and std of the image-token states), the novelty
#    detector's input beside h_pre
# 5: `img_tokens`: the image-token states themselves (a fixed number of slots), for the
#    patch-level novelty detector
FEATURE_SCHEMA = 5
# Image-token slots kept per item in `img_tokens` [N, TOKEN_SLOTS, D]: an image with fewer
# tokens is padded with NaN rows (no token), one with more keeps TOKEN_SLOTS of them
# evenly spaced in reading order. 64 covers every image up to 128 × 128 px with the
# embedded actor (16 px a token); a fixed width lets readouts of images of any size share
# a batch and a cache shard, and serving and evaluation read the same slots.
TOKEN_SLOTS = 64


def evidence_pool(h_ans: torch.Tensor, v: torch.Tensor, kappa: float = KAPPA
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Answer-conditioned pooling of image states.

    α_j = softmax_j(cos(h_ans, v_j) / κ), h_evid = Σ α_j v_j. Returns (h_global, h_evid, α).
    One item ([D], [M, D]) or a batch ([N, D], [N, M, D]).
    """
    h_global = v.mean(-2)
    alpha = torch.softmax(F.cosine_similarity(h_ans.unsqueeze(-2), v, dim=-1) / kappa, dim=-1)
    return h_global, (alpha.unsqueeze(-2) @ v).squeeze(-2), alpha


def phi(h_ans: torch.Tensor, v: torch.Tensor, kappa: float = KAPPA) -> torch.Tensor:
    """φ = [h_global ; h_evid ; h_ans ⊙ h_evid ; |h_ans − h_evid|]  (4D; batched as
    `evidence_pool`)."""
    h_global, h_evid, _ = evidence_pool(h_ans, v, kappa)
    return torch.cat([h_global, h_evid, h_ans * h_evid, (h_ans - h_evid).abs()], -1)


def image_stats(h_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std over the image tokens of [M, D] states ([N, M, D]: per
    item), as the shift study measured them; std is 0 for a single token rather than NaN."""
    v = h_image.float()
    mean = v.mean(-2)
    m = v.shape[-2]
    if m < 2:
        return mean, torch.zeros_like(mean)
    # two passes, written out: `Tensor.std` over the token axis cost ten times as much
    return mean, ((v - mean.unsqueeze(-2)) ** 2).sum(-2).div(m - 1).sqrt()


def extract(ro: Readout, kappa: float = KAPPA) -> dict[str, torch.Tensor]:
    """Everything any scorer needs from one readout, as flat float tensors."""
    return {k: v[0] for k, v in extract_many([ro], kappa).items()}


def token_slots(v: torch.Tensor, slots: int = TOKEN_SLOTS) -> torch.Tensor:
    """[M, D] image-token states -> [slots, D]: all of them then NaN rows when M ≤ slots,
    else `slots` of them evenly spaced (first and last included)."""
    m, d = v.shape
    if m > slots:
        return v[torch.linspace(0, m - 1, slots).round().long()].float()
    out = torch.full((slots, d), float("nan"))
    out[:m] = v.float()
    return out


def _span_mean(values: list[torch.Tensor]) -> torch.Tensor:
    """[N] means of N 1-D tensors (0 for an empty one)."""
    return torch.stack([x.mean() if len(x) else torch.zeros(()) for x in values])


def extract_many(readouts: Sequence[Readout], kappa: float = KAPPA) -> dict[str, torch.Tensor]:
    """`extract` of several readouts, stacked ([N, ...] a key). Readouts with as many image
    tokens as each other (one image size) are pooled in one set of batched operations:
    one readout at a time, the operations' calls and not their arithmetic were the cost."""
    if not readouts:
        raise ValueError("no readouts to extract features from")
    if len({ro.h_image.shape[0] for ro in readouts}) > 1:
        parts = [extract_many([ro], kappa) for ro in readouts]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    tokens = torch.stack([token_slots(ro.h_image) for ro in readouts])
    v = torch.stack([ro.h_image for ro in readouts]).float()               # [N, M, D]
    h_ans = torch.stack([mean_answer_state(ro.h_answer) for ro in readouts]).float()
    img_mean, img_std = image_stats(v)
    ans_lp = [ro.answer_logprobs for ro in readouts]
    ans_ent = [ro.token_entropy[ro.answer_index] if len(ro.answer_index) else ro.token_entropy
               for ro in readouts]
    mean_lp = _span_mean(ans_lp)
    has_lp = torch.tensor([len(x) > 0 for x in ans_lp])
    # μ(C) of the readouts that stated a confidence, in one call; 0.5 for the others
    mu = torch.full((len(readouts), 1), 0.5, dtype=torch.float64)
    stated = [k for k, ro in enumerate(readouts) if ro.digit_probs is not None]
    if stated:
        mu[stated, 0] = mu_from_digit_probs(torch.stack([readouts[k].digit_probs
                                                         for k in stated]))
    return {
        "h_pre": torch.stack([ro.h_pre for ro in readouts]).float(),
        "h_close": torch.stack([ro.h_close for ro in readouts]).float(),
        "phi": phi(h_ans, v, kappa),
        "h_mid": torch.stack([ro.h_mid for ro in readouts]).float(),
        # the novelty detector reads [h_pre ; img_mean ; img_std] (heads.novelty)
        "img_mean": img_mean,
        "img_std": img_std,
        # the patch-level novelty detector reads the image tokens themselves
        "img_tokens": tokens,
        # sequence statistics over the answer span (docs/method.md §7)
        "msp": torch.where(has_lp, mean_lp.exp(), torch.zeros(())).reshape(-1, 1),
        # over the answer span, like the other sequence scores (docs/method.md §7)
        "mean_logprob": mean_lp.reshape(-1, 1),
        "entropy": _span_mean(ans_ent).reshape(-1, 1),
        # float64: a stated 9 must stay 0.9 (HCE@0.9, ECE bins)
        "mu": mu,
    }
