"""What differs between supported VLM families, kept in one table.

A family adapter knows the modality type-id key the model wants, how positions are built
for an explicit forward (M-RoPE or plain), and whether image tokens attend bidirectionally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Family:
    name: str
    type_ids_key: str          # "mm_token_type_ids" (Qwen-VL) or "token_type_ids" (Gemma3)
    mrope: bool                # positions are (text, t, h, w) rather than 1-D
    bidirectional_image: bool  # image tokens see each other both ways (Gemma3)

    def nested_images(self) -> bool:
        """Gemma3's processor wants one list of images per text."""
        return self.name == "gemma3"


FAMILIES = {
    "qwen2_vl": Family("qwen2_vl", "mm_token_type_ids", True, False),
    "qwen2_5_vl": Family("qwen2_5_vl", "mm_token_type_ids", True, False),
    "qwen3_vl": Family("qwen3_vl", "mm_token_type_ids", True, False),
    "gemma3": Family("gemma3", "token_type_ids", False, True),
}


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}") from None


def position_ids(model, family: Family, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Explicit position ids for a full forward, equal to what the model builds itself.

    `attention_mask` is the 2-D padding mask; positions of tokens it drops are irrelevant.
    """
    text = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if not family.mrope:
        return text
    vision, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=type_ids,
                                           image_grid_thw=image_grid_thw,
                                           attention_mask=attention_mask)
    return torch.cat([text[None], vision], dim=0)


def decode_position_ids(model, family: Family, attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of the newest token in a cached decode step (after a `generate`)."""
    text = attention_mask.long().sum(-1, keepdim=True) - 1          # [B, 1]
    if not family.mrope:
        return text
    delta = model.model.rope_deltas.to(text.device)
    vision = (text + delta).unsqueeze(0).expand(3, -1, -1)
    return torch.cat([text[None], vision], dim=0)
