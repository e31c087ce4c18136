"""Attention-level masking of a trajectory span (docs/method.md §3).

Masked tokens stay in the sequence with their positions; no later token may attend to
them. The mask is float additive 4-D (0 allowed, finfo.min blocked) with explicit
position ids: a bool 4-D mask is right under SDPA but silently wrong under eager.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from models.families import Family
from models.readout import overlapping

RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
TAGS = ("think", "answer")


@dataclass(frozen=True)
class MaskSpec:
    """What to mask in a supplied response: a tag's content or a character span."""

    target: str | tuple[int, int] = "think"   # "think", "answer", "response" or (start, end)
    ratio: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError("ratio must lie in [0, 1]")
        if isinstance(self.target, str) and self.target not in (*TAGS, "response"):
            raise ValueError(f"unknown mask target {self.target!r}")


def char_span(text: str, target: str | tuple[int, int]) -> tuple[int, int]:
    """Character span of the mask target inside `text` ((0, 0) when absent)."""
    if isinstance(target, tuple):
        start, end = target
        if not 0 <= start <= end <= len(text):
            raise ValueError(f"span {target} outside the response (length {len(text)})")
        return start, end
    if target == "response":
        return 0, len(text)
    m = re.search(rf"<{target}>(.*?)(</{target}>|$)", text, re.S)
    return (m.start(1), m.end(1)) if m else (0, 0)


def nested_subset(n: int, ratio: float, seed: int) -> list[int]:
    """round(ratio·n) of range(n); for one seed the subsets are nested as ratio grows."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).tolist()
    return sorted(order[: round(ratio * n)])


def masked_token_indices(text: str, spans: list[tuple[int, int]], spec: MaskSpec) -> list[int]:
    """Response-relative indices of the tokens to mask."""
    start, end = char_span(text, spec.target)
    inside = overlapping(spans, start, end)
    return [inside[i] for i in nested_subset(len(inside), spec.ratio, spec.seed)]


def attention_mask_4d(attention_mask: torch.Tensor, masked: torch.Tensor,
                      type_ids: torch.Tensor, family: Family, dtype: torch.dtype,
                      config) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive [B, 1, L, L] mask: causal + padding, minus the masked key columns.

    A masked token still attends to itself (no fully blocked rows). For Gemma3 the
    bidirectional attention among one image's tokens is kept, and a per-layer-type dict
    is returned (sliding layers add their window).
    """
    b, n = attention_mask.shape
    dev = attention_mask.device
    i = torch.arange(n, device=dev)
    causal = i[None, :] <= i[:, None]                                  # [L(q), L(k)]
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    if family.bidirectional_image:
        img = type_ids == 1
        # consecutive image tokens form one block
        start = img & ~torch.cat([torch.zeros_like(img[:, :1]), img[:, :-1]], 1)
        block = torch.where(img, start.long().cumsum(1), torch.zeros_like(start, dtype=torch.long))
        same = (block[:, :, None] == block[:, None, :]) & img[:, :, None] & img[:, None, :]
        allowed = allowed | same
    later = i[:, None] > i[None, :]                                    # query after key
    allowed = allowed & ~(masked[:, None, :] & later[None])
    allowed = allowed | torch.eye(n, dtype=torch.bool, device=dev)[None]
    full = _additive(allowed, dtype)
    if family.name != "gemma3":
        return full
    window = getattr(config.get_text_config(), "sliding_window", None) or n
    near = (i[:, None] - i[None, :]) < window
    return {"full_attention": full, "sliding_attention": _additive(allowed & near[None], dtype)}


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked)[:, None]
