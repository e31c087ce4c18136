"""The frozen actor: batched greedy answering, replay, teacher-forced scoring, sampling."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from PIL import Image
from transformers import StoppingCriteria, StoppingCriteriaList

from models.canon import canon
from models.decoding import decode_loop
from models.families import Family, decode_position_ids, position_ids
from models.masking import MaskSpec, attention_mask_4d, masked_token_indices
from models.parse import parse_response
from models.readout import Readout, Response, StateTap, locate, token_spans

ReadoutMode = Literal["capture", "replay", "none"]
CONFIDENCE_CUE = "<confidence>"
SAPLMA_DEPTH = 0.625
# Most logits (rows x vocabulary) the token statistics hold at once: a batch of 64 with 64
# response tokens and a 152k vocabulary is ~0.6G elements, ~10 GB with the log-softmax and
# the entropy's temporaries, so it is computed in slices of at most this many elements.
TOKEN_STATS_ELEMENTS = 64 * 2**20


def saplma_layer(num_layers: int) -> int:
    """Index into `hidden_states` at SAPLMA_DEPTH of the model, rounded half up."""
    return min(num_layers, max(1, math.floor(SAPLMA_DEPTH * num_layers + 0.5)))


@dataclass(frozen=True)
class StageTimings:
    """Seconds one `Actor.answer` batch spent per stage."""

    generate: float
    readout: float


class Answers(list):
    """`Actor.answer`'s responses, in input order, with the batch's stage timings."""

    def __init__(self, responses: Sequence[Response], timings: StageTimings) -> None:
        super().__init__(responses)
        self.timings = timings


class DeadlineCriteria(StoppingCriteria):
    """Stops each row once its deadline (time.monotonic seconds) has passed.

    Checked between decode steps, so no generation outlives the caller waiting for it.
    Until the earliest deadline, every step gets the same all-false answer: building a
    fresh one per row and step cost 2% of a batch of eight's decoding.
    """

    def __init__(self, deadlines: Sequence[float]) -> None:
        self.deadlines = list(deadlines)
        self.earliest = min(self.deadlines, default=math.inf)
        self.cut: dict[int, int] = {}     # row -> sequence length when it was stopped
        self.none_late: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        now = time.monotonic()
        if now <= self.earliest:
            if self.none_late is None:
                self.none_late = torch.zeros(input_ids.shape[0], dtype=torch.bool,
                                             device=input_ids.device)
            return self.none_late
        late = [now > d for d in self.deadlines]
        for b, stop in enumerate(late):
            if stop:
                self.cut.setdefault(b, input_ids.shape[1])
        return torch.tensor(late, device=input_ids.device)


class RowLimits(StoppingCriteria):
    """Stops each row once it has generated its own number of tokens (the batch runs to
    the largest)."""

    def __init__(self, prompt_len: int, limits: Sequence[int]) -> None:
        self.ends = torch.tensor([prompt_len + n for n in limits])

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.ends = self.ends.to(input_ids.device)
        return input_ids.shape[1] >= self.ends


def processor_size(image_processor: object, height: int, width: int) -> tuple[int, int] | None:
    """The (height, width) a Qwen2-VL-style PIL image processor resizes an image to (its own
    module's `smart_resize`), or None for processors that do not resize that way (the
    torchvision ones resample differently) or would refuse the size."""
    if not type(image_processor).__name__.endswith("Pil"):
        return None
    smart_resize = getattr(sys.modules.get(type(image_processor).__module__), "smart_resize",
                           None)
    size = getattr(image_processor, "size", None)
    patch, merge = (getattr(image_processor, k, None) for k in ("patch_size", "merge_size"))
    if (smart_resize is None or not getattr(image_processor, "do_resize", False)
            or not patch or not merge or not getattr(size, "longest_edge", None)):
        return None
    try:
        return tuple(smart_resize(height, width, factor=patch * merge,
                                  min_pixels=size.shortest_edge, max_pixels=size.longest_edge))
    except ValueError:      # e.g. an aspect ratio past its limit after rounding
        return None


def prepared_images(images: Sequence[Image.Image], image_processor: object = None
                    ) -> list[Image.Image]:
    """Each distinct image (by identity) made RGB once and, when the processor would
    shrink it (`processor_size`), shrunk once to that size with the processor's own
    resampling: the processor then resizes nothing and computes the same pixels. One
    large image scored under 64 trajectories is resized once, not 64 times (~0.5 s each
    at 4096²)."""
    done: dict[int, Image.Image] = {}
    out = []
    for im in images:
        if id(im) not in done:
            rgb = im.convert("RGB")
            hw = processor_size(image_processor, rgb.height, rgb.width)
            # only where the processor would leave the shrunk image as it is (its size
            # rule is not idempotent at extreme aspect ratios)
            if (hw is not None and hw[0] * hw[1] < rgb.height * rgb.width
                    and processor_size(image_processor, *hw) == hw):
                rgb = rgb.resize((hw[1], hw[0]), resample=image_processor.resample)
            done[id(im)] = rgb
        out.append(done[id(im)])
    return out


@dataclass
class Batch:
    """Prompt (left padded) + response (right padded) for one forward."""

    input_ids: torch.Tensor        # [B, L]
    attention_mask: torch.Tensor   # [B, L] 1 = real token
    type_ids: torch.Tensor         # [B, L] modality ids (0 text, 1 image)
    prompt_len: int                # Lp: responses start here
    vision: dict                   # pixel_values, image_grid_thw (family-specific)


class Actor:
    """A frozen VLM with its processor and family adapter. Build with `load_actor`."""

    def __init__(self, model, processor, family: Family, folder: str, fingerprint: str,
                 system_prompt: str | None = None) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.family = family
        self.folder = folder
        self.fingerprint = fingerprint
        self.system_prompt = system_prompt
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        text_cfg = cfg.get_text_config()
        self.num_layers = int(text_cfg.num_hidden_layers)
        # 0.625 of depth, rounded half up: Python's round(2.5) is 2, which on a 4-layer
        # model reads half depth instead of the layer SAPLMA asks for.
        self.mid_layer = saplma_layer(self.num_layers)
        self.softcap = getattr(text_cfg, "final_logit_softcapping", None)
        self.hidden_size = int(text_cfg.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos_ids))
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.digit_ids = self._digit_ids()
        self.known_digits = [k for k, d in enumerate(self.digit_ids) if d is not None]
        # Ids a user's text must not contain: chat, image and padding markers.
        self.reserved_ids = {i for i, t in self.tokenizer.added_tokens_decoder.items()
                             if t.special} | {self.image_token_id}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---------------------------------------------------------------- encoding
    def _digit_ids(self) -> list[int | None]:
        """Token id of each verbalized level 0..10, None where it is not one token."""
        out: list[int | None] = []
        for c in range(11):
            ids = self.tokenizer.encode(str(c), add_special_tokens=False)
            out.append(ids[0] if len(ids) == 1 else None)
        return out

    # ---------------------------------------------------------------- input budgets
    def count_tokens(self, text: str) -> int:
        """Tokens `text` costs inside a prompt or a scored response."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def reserved_tokens_in(self, text: str) -> list[str]:
        """Reserved markers (image pad, chat turns, ...) written in a user's text."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return sorted({self.tokenizer.convert_ids_to_tokens(i) for i in ids
                       if i in self.reserved_ids})

    @staticmethod
    def score_text(response: str, cue: bool = True) -> str:
        """The text `score` actually feeds for a supplied response (masks index into it)."""
        return response.split(CONFIDENCE_CUE)[0] + (CONFIDENCE_CUE if cue else "")

    def prompt_text(self, question: str) -> str:
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": question}]})
        return self.processor.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)

    def encode(self, images: Sequence[Image.Image], questions: Sequence[str],
               responses: Sequence[Sequence[int]] | None = None) -> Batch:
        """Tokenise prompts (left padded) and append response ids (right padded)."""
        if len(images) != len(questions):
            raise ValueError("one image per question")
        texts = [self.prompt_text(q) for q in questions]
        rgb = prepared_images(images, getattr(self.processor, "image_processor", None))
        imgs = [[im] for im in rgb] if self.family.nested_images() else rgb
        self.tokenizer.padding_side = "left"
        enc = self.processor(text=texts, images=imgs, return_tensors="pt", padding=True)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        type_ids = enc.get(self.family.type_ids_key)
        if type_ids is None:
            type_ids = (ids == self.image_token_id).long()
        vision = {k: v for k, v in enc.items()
                  if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                               "token_type_ids")}
        lp = ids.shape[1]
        if responses is not None:
            width = max((len(r) for r in responses), default=0)
            rid = torch.full((len(responses), width), self.pad_id, dtype=ids.dtype)
            rmask = torch.zeros((len(responses), width), dtype=mask.dtype)
            for b, r in enumerate(responses):
                rid[b, : len(r)] = torch.tensor(list(r), dtype=ids.dtype)
                rmask[b, : len(r)] = 1
            ids = torch.cat([ids, rid], 1)
            mask = torch.cat([mask, rmask], 1)
            type_ids = torch.cat([type_ids, torch.zeros_like(rid, dtype=type_ids.dtype)], 1)
        dev = self.device
        vision = {k: (v.to(dev, self.dtype) if torch.is_floating_point(v) else v.to(dev))
                  for k, v in vision.items()}
        return Batch(ids.to(dev), mask.to(dev), type_ids.to(dev), lp, vision)

    # ---------------------------------------------------------------- forward passes
    def _vision_kwargs(self, batch: Batch) -> dict:
        """The model's extra inputs for a batch: vision tensors plus the modality ids."""
        return {**batch.vision, self.family.type_ids_key: batch.type_ids}

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM-head logits from final-layer states (only where they are needed)."""
        w = self.model.get_output_embeddings()
        logits = w(h.to(self.dtype)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def forward_states(self, batch: Batch, attn: torch.Tensor | dict | None = None,
                       pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Final-layer and mid-layer states over the whole batch sequence ([B, L, D] each).

        `attn`, when given, is a 4-D additive mask (or Gemma3's per-layer-type dict) and
        then `pos` must be the explicit position ids.
        """
        kwargs = self._vision_kwargs(batch)
        with StateTap(self.model, self.mid_layer) as tap:
            self.model(input_ids=batch.input_ids,
                       attention_mask=batch.attention_mask if attn is None else attn,
                       position_ids=pos, use_cache=False, logits_to_keep=1, **kwargs)
        return tap.states["last"][0].float(), tap.states["mid"][0].float()

    # ---------------------------------------------------------------- readout assembly
    def _token_stats(self, last: torch.Tensor, seq: torch.Tensor, lp: int,
                     limit: int = TOKEN_STATS_ELEMENTS, logits: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At each response step of a batch: the log-prob of the response token taken there
        and the predictive entropy ([B, N]), and the log-probs of the known confidence
        digits ([B, N, K], for `_digit_probs`).

        `last` [B, L, D] and `seq` [B, L'] cover [prompt ; response]; N is the response
        width. `logits` [B, N, V], when given, are those steps' logits as `generate` kept
        them (then the LM head does not run again). Otherwise the LM head runs on slices of
        whole items, at most `limit` logits each (one item a slice when one alone is over
        it), so memory stays bounded while the calls stay few. Whole items because an
        item's rows are then bitwise the same alone or in any batch, while splitting an
        item's steps into smaller matrix products changes bits. (Which of the two runs is
        the caller's choice, by the batch's size against the bound: the two agree to
        rounding, ~1e-6, not bit for bit.)
        """
        h = last[:, lp - 1: seq.shape[1] - 1]
        b, n = h.shape[:2]
        if logits is not None and logits.shape[1] < n:
            logits = None                     # a caller's mistake must not cost rows
        tgt = seq[:, lp: lp + n].to(h.device)
        digits = torch.tensor([d for d in self.digit_ids if d is not None], dtype=torch.long,
                              device=h.device)
        items = max(1, limit // max(1, n * self.vocab_size))   # whole items per slice
        tok = torch.empty(b, n, device=h.device)
        ent = torch.empty(b, n, device=h.device)
        dlp = torch.empty(b, n, len(digits), device=h.device)
        for i in range(0, b, items):
            sl = slice(i, i + items)
            z = self._logits(h[sl]) if logits is None else logits[sl, :n].to(h.device)
            logp = torch.log_softmax(z, -1)
            tok[sl] = logp.gather(-1, tgt[sl][..., None]).squeeze(-1)
            ent[sl] = -(logp.exp() * logp).sum(-1)
            dlp[sl] = logp[..., digits]
            del logp                                  # freed before the next slice's logits
        return tok, ent, dlp

    def _responses(self, resp_ids: list[list[int]], last: torch.Tensor,
                   mid: torch.Tensor | None, seq: torch.Tensor, lp: int,
                   logits: torch.Tensor | None = None) -> list[Response]:
        """Every item's Response, the token statistics computed once for the batch
        (from `logits` [B, N, V] when `generate` kept them)."""
        stats = self._token_stats(last, seq, lp, logits=logits)
        # image-token positions of every row in one call, not one per item
        where = (seq[:, :lp] == self.image_token_id).nonzero()
        counts = torch.bincount(where[:, 0], minlength=len(resp_ids)).tolist()
        img_pos = where[:, 1].split(counts)
        return [self._response(r, last[b], mid[b] if mid is not None else None, seq[b], lp,
                               tuple(x[b] for x in stats), img_pos[b])
                for b, r in enumerate(resp_ids)]

    def _response(self, ids: list[int], last: torch.Tensor, mid: torch.Tensor | None,
                  input_ids: torch.Tensor, lp: int,
                  stats: tuple[torch.Tensor, ...] | None = None,
                  img_pos: torch.Tensor | None = None) -> Response:
        """Assemble one item's Response from its states over [prompt ; response].

        `stats`: this item's rows of `_token_stats` (needed when `last` is given);
        `img_pos`: its image-token positions, when the caller found them already.
        """
        ids = self._trim(ids)
        finished = bool(ids) and ids[-1] in self.eos_ids
        body = ids[:-1] if finished else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        parsed = parse_response(text, finished)
        resp = Response(text=text, parsed=parsed, canonical=canon(parsed.answer),
                        token_ids=list(ids), finished=finished, readout=None)
        if last is None:
            return resp
        spans = token_spans(self.tokenizer, body, text)
        special = {k for k, t in enumerate(body) if t in self.special_ids}
        answer_idx, t_close = locate(parsed, spans, special)
        t_prompt = lp - 1
        close_pos = lp + t_close if t_close >= 0 else t_prompt
        ans_pos = [lp + k for k in answer_idx] or [close_pos]
        # SAPLMA reads the last token of the completion (the EOS is never fed back, so
        # the last body token; t_prompt for an empty one), not t_close.
        last_pos = lp + len(body) - 1 if body else t_prompt
        if img_pos is None:
            img_pos = (input_ids[:lp] == self.image_token_id).nonzero().flatten()
        n = len(ids)
        tok_lp, ent, digit_lp = (x[:n] for x in stats)
        digits = self._digit_probs(text, spans, last, lp, digit_lp)
        ro = Readout(
            h_pre=last[t_prompt].cpu(), h_close=last[close_pos].cpu(),
            h_answer=last[ans_pos].cpu(), h_image=last[img_pos].cpu(),
            h_mid=(mid if mid is not None else last)[last_pos].cpu(),
            token_logprobs=tok_lp.cpu(), token_entropy=ent.cpu(),
            answer_index=torch.tensor(answer_idx, dtype=torch.long),
            digit_probs=digits,
            positions={"t_prompt": t_prompt, "t_close": close_pos, "A": ans_pos,
                       "V": img_pos.tolist(), "prompt_len": lp})
        resp.readout = ro
        return resp

    def _digit_probs(self, text: str, spans, last: torch.Tensor, lp: int,
                     digit_lp: torch.Tensor | None = None) -> torch.Tensor | None:
        """P(C=c) at the position whose next token is the verbalized level (docs/method.md §3).

        `digit_lp` holds the response's next-token log-probabilities of the known digits
        (row k predicts response token k; `_token_stats`); when it covers the cue's
        position its row is reused instead of a second LM-head pass.
        """
        cue = text.find(CONFIDENCE_CUE)
        if cue < 0 or all(d is None for d in self.digit_ids):
            return None
        end = cue + len(CONFIDENCE_CUE)
        idx = [k for k, (a, b) in enumerate(spans) if a < end and b >= end and b > a]
        if not idx:
            return None
        row = idx[0] + 1
        known = self.known_digits
        if digit_lp is not None and row < len(digit_lp):
            p_known = digit_lp[row].exp()
        else:
            p = torch.softmax(self._logits(last[lp + idx[0]]), -1)
            p_known = p[[self.digit_ids[k] for k in known]]
        p_known = p_known.float().cpu()
        if len(known) == len(self.digit_ids):
            probs = p_known
        else:
            probs = torch.zeros(len(self.digit_ids))
            probs[known] = p_known
        return probs / probs.sum().clamp_min(1e-12)

    # ---------------------------------------------------------------- public API
    @torch.no_grad()
    def answer(self, images: Sequence[Image.Image], questions: Sequence[str],
               max_new_tokens: int | Sequence[int] = 64, readout: ReadoutMode = "capture",
               deadlines: Sequence[float] | None = None) -> Answers:
        """Greedy answers for a batch, each with its readout, plus the stage timings.

        `capture` reads states out of `generate` (plus one cached step when the last
        generated token needs a state); `replay` runs one teacher-forced pass instead.
        `max_new_tokens`: one limit, or one per item (a row stops at its own, so requests
        with different limits can share a batch). `deadlines` (time.monotonic seconds, one
        per item) stop an item's decoding once passed; its response is then truncated.
        """
        t0 = time.perf_counter()
        limits = [max_new_tokens] * len(questions) if isinstance(max_new_tokens, int) \
            else list(max_new_tokens)
        if len(limits) != len(questions):
            raise ValueError(f"{len(limits)} limits for {len(questions)} questions")
        max_new_tokens = max(limits, default=1)
        batch = self.encode(images, questions)
        kwargs = self._vision_kwargs(batch)
        stop = DeadlineCriteria(deadlines) if deadlines is not None else None
        criteria = [c for c in (stop, RowLimits(batch.prompt_len, limits)
                                if min(limits, default=1) < max_new_tokens else None) if c]
        tap = StateTap(self.model, self.mid_layer)
        # generate computes every step's logits anyway: keeping them spares the LM head a
        # second run for the token statistics, where they and their stacked copy fit the
        # memory bound. Not under a final-logit softcap: some classes apply it in forward
        # (Gemma3ForCausalLM), others not (Gemma3ForConditionalGeneration); `_logits`
        # applies it once.
        keep_logits = readout == "capture" and not self.softcap and (
            2 * len(questions) * max_new_tokens * self.vocab_size <= TOKEN_STATS_ELEMENTS)
        with tap if readout == "capture" else nullcontext():
            out = self.model.generate(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids), return_dict_in_generate=True,
                output_logits=keep_logits, top_p=None,
                top_k=None, temperature=None, custom_generate=decode_loop, use_cache=True,
                stopping_criteria=StoppingCriteriaList(criteria) if criteria else None,
                **kwargs)
        lp = batch.prompt_len
        gen = out.sequences[:, lp:]
        # a row stopped at its deadline or its own limit is padded afterwards: cut it there
        resp_ids = [self._trim(row.tolist())[: min(limits[b], stop.cut[b] - lp
                                                   if stop and b in stop.cut else limits[b])]
                    for b, row in enumerate(gen)]
        t1 = time.perf_counter()
        if readout == "none":
            res = [self._response(r, None, None, batch.input_ids[b], lp)
                   for b, r in enumerate(resp_ids)]
        elif readout == "replay":
            full = self.encode(images, questions, resp_ids)
            last, mid = self.forward_states(full)
            res = self._responses(resp_ids, last, mid, full.input_ids, lp)
        else:
            last, mid = self._captured(out, batch, gen, resp_ids, tap)
            logits = torch.stack(out.logits, 1) if keep_logits and out.logits else None
            res = self._responses(resp_ids, last, mid, out.sequences, lp, logits)
        return Answers(res, StageTimings(t1 - t0, time.perf_counter() - t1))

    def _trim(self, ids: list[int]) -> list[int]:
        """Ids up to and including the first EOS (all of them when there is none)."""
        eos_at = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
        return ids[: eos_at + 1] if eos_at is not None else ids

    def _captured(self, out, batch: Batch, gen: torch.Tensor, resp_ids: list[list[int]],
                  tap: StateTap) -> tuple[torch.Tensor, torch.Tensor]:
        """States over [prompt ; generated], as `tap` kept them during `generate`.

        Forward 0 (prefill) holds the prompt; forward k holds the token fed at step k,
        i.e. generated token k-1. The last generated token is never fed back, so when an
        item needs it (truncated without EOS) one more cached decode step supplies its state.
        """
        n = gen.shape[1]
        if any(len(r) == n and r[-1] not in self.eos_ids for r in resp_ids):
            mask = torch.cat([batch.attention_mask,
                              torch.ones_like(gen, dtype=batch.attention_mask.dtype)], 1)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            with tap:
                self.model(input_ids=gen[:, -1:], attention_mask=mask, cache=cache,
                           position_ids=decode_position_ids(self.model, self.family, mask),
                           use_cache=True, logits_to_keep=1)
        return torch.cat(tap.states["last"], 1).float(), torch.cat(tap.states["mid"], 1).float()

    @torch.no_grad()
    def score(self, images: Sequence[Image.Image], questions: Sequence[str],
              responses: Sequence[str],
              mask: MaskSpec | Sequence[MaskSpec | None] | None = None,
              cue: bool = True) -> list[Response]:
        """Teacher-forced readout of supplied responses (trajectories).

        With `cue`, anything from `<confidence>` on is dropped and the cue is appended,
        so the readout carries μ(C) for the supplied trajectory. With `mask` (one for all
        items, or one per item, None for unmasked), the chosen tokens keep their
        positions but no later token can attend to them.
        """
        texts = [self.score_text(r, cue) for r in responses]
        masks = list(mask) if isinstance(mask, (list, tuple)) else [mask] * len(texts)
        if len(masks) != len(texts):
            raise ValueError("one mask (or None) per response")
        mask = next((m for m in masks if m is not None), None)
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        batch = self.encode(images, questions, ids)
        attn = pos = None
        if mask is not None:
            lp = batch.prompt_len
            masked = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
            for b, (t, r, m) in enumerate(zip(texts, ids, masks)):
                if m is None:
                    continue
                spans = token_spans(self.tokenizer, r)
                for k in masked_token_indices(t, spans, m):
                    masked[b, lp + k] = True
            attn = attention_mask_4d(batch.attention_mask, masked, batch.type_ids,
                                     self.family, self.dtype, self.model.config)
            pos = position_ids(self.model, self.family, batch.input_ids,
                               batch.attention_mask, batch.type_ids,
                               batch.vision.get("image_grid_thw"))
        last, mid = self.forward_states(batch, attn, pos)
        out = self._responses(ids, last, mid, batch.input_ids, batch.prompt_len)
        if mask is not None:
            for b, r in enumerate(out):
                r.readout.positions["masked"] = masked[b].nonzero().flatten().tolist()
        return out

    @torch.no_grad()
    def next_token_probs(self, images: Sequence[Image.Image], questions: Sequence[str]
                         ) -> torch.Tensor:
        """Next-token distribution right after each prompt ([B, V]); one pass (P(True))."""
        batch = self.encode(images, questions)
        last, _ = self.forward_states(batch)
        return torch.softmax(self._logits(last[:, batch.prompt_len - 1]), -1).cpu()

    @torch.no_grad()
    def sample(self, images: Sequence[Image.Image], questions: Sequence[str], k: int,
               temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 64,
               seed: int | None = None) -> list[list[Response]]:
        """K sampled completions per item (SC@K, semantic uncertainty); no readout."""
        if seed is not None:
            torch.manual_seed(seed)
        # Repeat items rather than num_return_sequences: the latter trips on Qwen3-VL
        # configs without deepstack layers in this transformers release.
        rep_imgs = [im for im in images for _ in range(k)]
        rep_qs = [q for q in questions for _ in range(k)]
        batch = self.encode(rep_imgs, rep_qs)
        kwargs = self._vision_kwargs(batch)
        out = self.model.generate(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, do_sample=True,
            temperature=temperature, top_p=top_p, top_k=None, max_new_tokens=max_new_tokens,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
            custom_generate=decode_loop, use_cache=True, **kwargs)
        gen = out[:, batch.prompt_len:]
        rows = [self._response(self._trim(r.tolist()), None, None, None, batch.prompt_len)
                for r in gen]
        return [rows[i * k: (i + 1) * k] for i in range(len(questions))]
