"""Tiny random (or to-be-trained) actors of each supported family, built offline.

Used by the tests (random weights, built on the fly) and as the starting point of the
embedded actor. Everything is local: a byte-level BPE trained on a small corpus, the PIL
image processors, and a config shrunk to a few layers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3")

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Tags of the trajectory format stay single tokens so positions are crisp.
FORMAT_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "<confidence>",
                 "</confidence>"] + [str(i) for i in range(11)]

QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

DEFAULT_CORPUS = [
    "what color is the shape? red green blue yellow teal brown gray black",
    "what shape is in the image? circle rectangle triangle",
    "is there a red circle? yes no. does the image contain a blue shape?",
    "I see a red circle. The question asks about the colour, so the answer is red.",
    "left right upper lower lung liver kidney brain chest abdomen ct mri x-ray",
]


def unspecial(tokenizer_json: str) -> str:
    """Mark the format tokens as ordinary added tokens (ids unchanged)."""
    data = json.loads(tokenizer_json)
    for tok in data.get("added_tokens", []):
        if tok["content"] in FORMAT_TOKENS:
            tok["special"] = False
    return json.dumps(data)


def build_tokenizer(family: str, corpus: Iterable[str] = DEFAULT_CORPUS,
                    vocab_size: int = 400) -> PreTrainedTokenizerFast:
    specials = GEMMA_SPECIALS if family == "gemma3" else QWEN_SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials + FORMAT_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus), trainer=trainer)
    # The trajectory tags and digits must survive decode(skip_special_tokens=True) (TRL
    # decodes completions that way): keep their ids, drop their "special" flag.
    tok = Tokenizer.from_str(unspecial(tok.to_str()))
    if family == "gemma3":
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<bos>", eos_token="<end_of_turn>",
            pad_token="<pad>", padding_side="left",
            extra_special_tokens={"image_token": "<image_soft_token>",
                                  "boi_token": "<start_of_image>",
                                  "eoi_token": "<end_of_image>"},
            chat_template=GEMMA_TEMPLATE)
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            padding_side="left", chat_template=QWEN_TEMPLATE)
    return fast


def _qwen_config(family: str, tok: PreTrainedTokenizerFast, hidden: int, layers: int,
                 patch: int, vision_hidden: int, vision_depth: int):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    heads, kv = 4, 2
    head_dim = hidden // heads
    # M-RoPE sections must sum to head_dim / 2.
    q = head_dim // 2
    section = [q - 2 * (q // 4), q // 4, q // 4]
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, max_position_embeddings=1024, tie_word_embeddings=True,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.eos_token_id)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if family == "qwen3_vl":
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
        vision = dict(depth=vision_depth, hidden_size=vision_hidden, num_heads=2,
                      intermediate_size=vision_hidden * 2, patch_size=patch,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=hidden,
                      num_position_embeddings=64, deepstack_visual_indexes=[])
        return Qwen3VLConfig(text_config=text, vision_config=vision,
                             tie_word_embeddings=True, **ids)
    text["rope_parameters"] = rope
    if family == "qwen2_vl":
        vision = dict(depth=vision_depth, embed_dim=vision_hidden, hidden_size=hidden,
                      num_heads=2, mlp_ratio=2, patch_size=patch, temporal_patch_size=2,
                      spatial_merge_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision,
                             tie_word_embeddings=True, **ids)
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, out_hidden_size=hidden,
                  num_heads=2, intermediate_size=vision_hidden * 2, patch_size=patch,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=patch * 4,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                            tie_word_embeddings=True, **ids)


def _gemma_config(tok: PreTrainedTokenizerFast, hidden: int, layers: int, image_size: int,
                  patch: int, vision_hidden: int, vision_depth: int, mm_tokens: int):
    from transformers import Gemma3Config

    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=hidden // 4, max_position_embeddings=1024, sliding_window=512,
                query_pre_attn_scalar=hidden // 4, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                layer_types=["full_attention"] * layers)
    vision = dict(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
                  num_hidden_layers=vision_depth, num_attention_heads=2,
                  image_size=image_size, patch_size=patch, vision_use_head=False)
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens,
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)


def build_processor(family: str, tok: PreTrainedTokenizerFast, image_size: int = 64,
                    patch: int = 8, mm_tokens: int = 4):
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from models.compat import IMAGE_ONLY

    if family == "gemma3":
        img = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size},
                                      do_pan_and_scan=False)
        return Gemma3Processor(img, tok, chat_template=tok.chat_template,
                               image_seq_length=mm_tokens)
    # Fixed pixel budget: every image becomes (image_size/patch)^2 patches.
    pixels = image_size * image_size
    img = Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=2, merge_size=2,
                                   size={"shortest_edge": pixels, "longest_edge": pixels})
    return IMAGE_ONLY[family](img, tok, chat_template=tok.chat_template)


def build_tiny_actor(family: str, out: str | Path, *, hidden: int = 64, layers: int = 2,
                     image_size: int = 32, patch: int = 8, vision_hidden: int = 32,
                     vision_depth: int = 1, corpus: Iterable[str] = DEFAULT_CORPUS,
                     vocab_size: int = 400, seed: int = 0) -> Path:
    """Build a random actor of `family` and save model, tokenizer and processor to `out`."""
    from transformers import AutoModelForImageTextToText

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    out = Path(out)
    tok = build_tokenizer(family, corpus, vocab_size)
    if family == "gemma3":
        mm_tokens = 4
        config = _gemma_config(tok, hidden, layers, image_size, patch, vision_hidden,
                               vision_depth, mm_tokens)
        proc = build_processor(family, tok, image_size, patch, mm_tokens)
    else:
        config = _qwen_config(family, tok, hidden, layers, patch, vision_hidden, vision_depth)
        proc = build_processor(family, tok, image_size, patch)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    proc.save_pretrained(out)
    tok.save_pretrained(out)
    return out
