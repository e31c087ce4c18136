"""Greedy and sampled decoding as `generate`'s decoding loop (its `custom_generate` hook).

`generate` still prepares everything as usual: inputs, cache, the checkpoint's logits
processors and warpers (temperature, top-p), the stopping criteria (length, EOS,
deadlines). Only the loop is ours: one model call a step, with the new token, the grown
mask and its positions. transformers' own loop prepares each step's inputs from the whole
sequence and rebuilds its kwargs and output objects; on the embedded actor the answer
alone (processor inputs, decoding, parsing) took 7-10% less time per item with this loop
at batch 1 and 8 (`dualread bench`, "answer alone" against plain `generate`). The
service's answers (greedy) and SC@K's samples (the baseline gets the same loop) come out
of it. Tokens, logits and the cache are the library's: every family is tested against
its loop, sampling with the same seed.
"""

from __future__ import annotations

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from models.families import decode_position_ids, family_of

UNSUPPORTED = ("output_scores", "output_attentions", "output_hidden_states")


def decode_loop(model, input_ids: torch.Tensor, logits_processor, stopping_criteria,
                generation_config, synced_gpus: bool = False, streamer=None,
                **model_kwargs) -> GenerateDecoderOnlyOutput | torch.Tensor:
    """What `GenerationMixin._sample` does, greedy or sampling, with a cache, one model
    call a step. Pass it as `model.generate(..., custom_generate=decode_loop)`.

    It starts from an empty cache on the model's device and returns what `_sample` returns
    (sequences, the raw logits when asked, the cache). `generate` hands a callable loop
    neither its streamer nor `synced_gpus`: a streamer given to `generate` is not fed.
    """
    asked = [k for k in UNSUPPORTED if getattr(generation_config, k, False)]
    if asked or generation_config.num_beams != 1:
        raise ValueError(f"decode_loop decodes with one beam, without {asked or 'that'}")
    # A checkpoint saved with `use_cache: false` (gradient checkpointing) would otherwise
    # feed each new token with no context at all: the caller asks for the cache.
    if not model_kwargs.get("use_cache", True):
        raise ValueError("decode_loop decodes with a cache: pass use_cache=True")
    given = model_kwargs.get("cache")
    if given is not None and given.get_seq_length() > 0:
        raise ValueError("decode_loop starts from an empty cache")
    if getattr(generation_config, "prefill_chunk_size", None):
        raise ValueError("decode_loop prefills in one call: no prefill_chunk_size")
    if input_ids.device != model.device:
        raise ValueError(f"decode_loop needs the inputs on the model's device ({model.device})")
    # The length and EOS criteria are applied here as the library's do it (their own calls
    # build several tensors a step); any other criterion (deadlines, ...) is called as given.
    max_length = min((c.max_length for c in stopping_criteria
                      if isinstance(c, MaxLengthCriteria)), default=None)
    eos = [c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
    others = [c for c in stopping_criteria
              if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if max_length is None:
        raise ValueError("decode_loop needs a length limit (max_new_tokens)")
    # `generate` pads with the first EOS id when no pad id was given (and warns)
    pad = generation_config.pad_token_id
    if pad is None:
        pad = getattr(generation_config, "_pad_token_tensor", None)
    if eos and pad is None:
        raise ValueError("decode_loop needs pad_token_id to pad rows that have finished")
    eos_ids = torch.cat([e.reshape(-1) for e in eos]).to(input_ids.device) if eos else None
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    raw: list[torch.Tensor] = []
    # `generate` drops an all-ones mask (its positions still count the prompt)
    mask = model_kwargs.get("attention_mask")
    prompt = mask if mask is not None else torch.ones_like(input_ids)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    out = model(**model.prepare_inputs_for_generation(input_ids, is_first_iteration=True,
                                                      **model_kwargs), return_dict=True)
    if getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None:
        raise ValueError("decode_loop needs the model to return its cache")
    # positions of the first fed-back token (after the prefill: M-RoPE's offsets are set
    # by it); each step adds one
    first = decode_position_ids(model, family_of(model.config.model_type),
                                torch.cat([prompt, torch.ones_like(prompt[:, :1])], 1))
    step = 0
    while True:
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        del out      # the prefill's logits can be large: do not keep them for the loop
        if keep_logits:
            raw.append(logits)
        scores = logits_processor(input_ids, logits)
        if generation_config.do_sample:       # the library's draw: same seed, same tokens
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            nxt = scores.argmax(-1)
        if eos_ids is not None:               # finished rows get padding
            nxt = torch.where(unfinished, nxt, pad)
        input_ids = torch.cat([input_ids, nxt[:, None]], dim=-1)
        for criterion in others:              # every step, the last one included
            unfinished &= ~criterion(input_ids, None)
        if input_ids.shape[1] >= max_length:
            break
        if eos_ids is not None:
            unfinished &= ~torch.isin(nxt, eos_ids)
        if not bool(unfinished.any()):
            break
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, cache=cache,
                    position_ids=first + step, use_cache=True, logits_to_keep=1,
                    return_dict=True)
        step += 1
    if not generation_config.return_dict_in_generate:
        return input_ids
    return GenerateDecoderOnlyOutput(sequences=input_ids, logits=tuple(raw) if keep_logits
                                     else None, cache=cache)
