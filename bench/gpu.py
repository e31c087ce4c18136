"""A Qwen3-VL-2B-sized actor with random weights, built from a config (nothing downloaded).

Real sizes (text: hidden 2048, 28 layers, 16 query / 8 key-value heads of 128, MLP 6144,
vocabulary 151,936, tied embeddings; vision: 24 blocks of 1024, patch 16, 2×2 merge,
deepstack at blocks 5, 11 and 17), the embedded actor's tokenizer (its ids are all
below the vocabulary size, and its image/vision marker ids are written into the config),
and a processor with a fixed 448×448 pixel budget: (448/16)² = 784 patches, 196 image
tokens after the merge. Random weights rarely emit EOS, so generation is forced to a
fixed length: `min_new_tokens` in the saved generation config, which every `generate`
call (plain, `Actor.answer`, `Actor.sample`, the server) inherits.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIDE = 448
PATCH = 16
TEXT_2B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128,
               vocab_size=151_936, max_position_embeddings=262_144, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                "mrope_section": [24, 20, 20], "mrope_interleaved": True})
VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                 patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=2,
                 out_hidden_size=2048, num_position_embeddings=2304,
                 deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")


def embedded_tokenizer():
    from models.compat import load_processor
    from models.loading import EMBEDDED_ACTOR

    return load_processor(str(EMBEDDED_ACTOR), "qwen3_vl").tokenizer


def qwen3vl_2b_config(tok, text: dict | None = None, vision: dict | None = None):
    """The 2B-sized `Qwen3VLConfig` bound to `tok`'s special ids; `text`/`vision` override
    individual sizes (the tests shrink it)."""
    from transformers import Qwen3VLConfig

    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    text_cfg = {**TEXT_2B, "tie_word_embeddings": True, "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id, "bos_token_id": tok.eos_token_id,
                **(text or {})}
    vision_cfg = {**VISION_2B, **(vision or {})}
    if len(tok) > text_cfg["vocab_size"]:
        raise ValueError("the tokenizer's ids must be valid in the model's vocabulary")
    return Qwen3VLConfig(text_config=text_cfg, vision_config=vision_cfg,
                         tie_word_embeddings=True, **ids)


def build_random_actor(out: str | Path, device: str = "cuda", dtype: str = "bfloat16",
                       new_tokens: int = 16, text: dict | None = None,
                       vision: dict | None = None, seed: int = 0,
                       image_side: int = IMAGE_SIDE) -> Path:
    """Build the random actor on `device` (weights are initialised there, not on the
    CPU), force `new_tokens` per answer, and save it as a loadable actor folder."""
    from transformers import AutoModelForImageTextToText

    from models.loading import DTYPES
    from models.tiny import build_processor

    out = Path(out)
    tok = embedded_tokenizer()
    config = qwen3vl_2b_config(tok, text, vision)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=DTYPES[dtype])
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id = tok.eos_token_id, tok.pad_token_id
    gc.min_new_tokens = new_tokens
    model.save_pretrained(out)
    del model
    proc = build_processor("qwen3_vl", tok, image_size=image_side, patch=PATCH)
    proc.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_random_heads(out: str | Path, actor_folder: str | Path, dim: int,
                       seed: int = 0) -> Path:
    """Heads of the right width with random weights, bound to the actor's fingerprint;
    the defer threshold is set at 0.5 (the cost, not the decision, is measured)."""
    from heads.defer import DeferPolicy
    from heads.dualread import Heads
    from models.loading import fingerprint

    torch.manual_seed(seed)
    heads = Heads.new(dim)
    for name in ("psr", "state", "visual", "saplma", "bicr"):
        getattr(heads, name).eval()
    heads.actor_fingerprint = fingerprint(actor_folder)
    heads.policy = DeferPolicy(tau=0.5, target_risk=0.05, delta=0.1, coverage=0.0,
                               empirical_risk=0.0, risk_upper_bound=1.0, n_calibration=0,
                               feasible=False)
    heads.save(out, {"command": "random heads for the GPU benchmark", "git_commit": ""})
    return Path(out)


def count_parameters_meta(config) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())
