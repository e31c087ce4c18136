"""Greedy decoding as `generate`'s decoding loop (its `custom_generate` hook).

`generate` still prepares everything as usual: inputs, cache, the checkpoint's logits
processors, the stopping criteria (length, EOS, deadlines). Only the loop is ours: one
model call a step, with the new token, the grown mask and its positions. transformers'
own loop prepares each step's inputs from the whole sequence and rebuilds its kwargs
and output objects; on the embedded actor that Python cost was ~7% of decoding at batch
1 and 8 (`dualread bench`'s decoding row). Tokens and logits are the same: every family
is tested against the library's loop.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from models.families import decode_position_ids, family_of

UNSUPPORTED = ("output_scores", "output_attentions", "output_hidden_states", "do_sample")


def greedy_loop(model, input_ids: torch.Tensor, logits_processor, stopping_criteria,
                generation_config, synced_gpus: bool = False, streamer=None,
                **model_kwargs) -> GenerateDecoderOnlyOutput | torch.Tensor:
    """What `GenerationMixin._sample` does for greedy search with a cache, one model call
    a step. Pass it as `model.generate(..., custom_generate=greedy_loop)`."""
    asked = [k for k in UNSUPPORTED if getattr(generation_config, k, False)]
    if asked or synced_gpus or streamer is not None or generation_config.num_beams != 1:
        raise ValueError(f"greedy_loop decodes greedily with one beam, without {asked or 'that'}")
    pad = generation_config.pad_token_id
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    if has_eos and pad is None:
        raise ValueError("greedy_loop needs pad_token_id to pad rows that have finished")
    family = family_of(model.config.model_type)
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    raw: list[torch.Tensor] = []
    # `generate` drops an all-ones mask; positions still count the prompt
    mask = model_kwargs.get("attention_mask")
    seen = mask if mask is not None else torch.ones_like(input_ids)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    out = model(**model.prepare_inputs_for_generation(input_ids, is_first_iteration=True,
                                                      **model_kwargs), return_dict=True)
    while True:
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        del out      # the prefill's logits can be large: do not keep them for the loop
        if keep_logits:
            raw.append(logits)
        nxt = logits_processor(input_ids, logits).argmax(-1)
        if has_eos:
            nxt = nxt * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, nxt[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, None)
        if not bool(unfinished.any()):
            break
        seen = torch.cat([seen, torch.ones_like(seen[:, :1])], dim=-1)
        if mask is not None:
            mask = seen
        out = model(input_ids=nxt[:, None], attention_mask=mask, cache=cache,
                    position_ids=decode_position_ids(model, family, seen), use_cache=True,
                    logits_to_keep=1, return_dict=True)
    if not generation_config.return_dict_in_generate:
        return input_ids
    return GenerateDecoderOnlyOutput(sequences=input_ids, logits=tuple(raw) if keep_logits
                                     else None, cache=cache)
