"""The readout: hidden states at named positions, plus token statistics.

One heavy pass (generation with capture, or a teacher-forced replay) fills a `Readout`;
every confidence method is a cheap function of it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from models.parse import Parsed


class StateTap:
    """Keeps, for every forward run while entered (calling thread only), the output of
    the decoder's final norm and of decoder layer `mid_layer - 1`.

    These are `hidden_states[-1]` and `hidden_states[mid_layer]` of `output_hidden_states`,
    which is not used: the first such call installs a hook on every decoder layer that
    then stays for every later forward, and plain generation in the same process pays
    for it (measured ~2% on the embedded actor). These two hooks exist only while entered.
    Re-entering keeps appending.
    """

    def __init__(self, model, mid_layer: int) -> None:
        decoder = model.get_decoder()
        self.modules = {"last": decoder.norm, "mid": decoder.layers[mid_layer - 1]}
        self.states: dict[str, list[torch.Tensor]] = {"last": [], "mid": []}
        self.handles: list = []
        self.thread = threading.get_ident()

    def _keep(self, key: str):
        def hook(module, args, output) -> None:
            if threading.get_ident() == self.thread:
                self.states[key].append(output[0] if isinstance(output, tuple) else output)
        return hook

    def __enter__(self) -> StateTap:
        self.handles = [m.register_forward_hook(self._keep(k)) for k, m in self.modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@dataclass
class Readout:
    h_pre: torch.Tensor            # [D] state at t_prompt (PSR)
    h_close: torch.Tensor          # [D] state at t_close (P-State)
    h_answer: torch.Tensor         # [|A|, D] states over the answer span
    h_image: torch.Tensor          # [M, D] states at the image-token positions
    h_mid: torch.Tensor            # [D] state at t_close from the layer at 0.625 depth (SAPLMA)
    token_logprobs: torch.Tensor   # [n] log p of each response token (EOS included)
    token_entropy: torch.Tensor    # [n] predictive entropy at each response step
    answer_index: torch.Tensor     # [|A|] indices of answer tokens among response tokens
    digit_probs: torch.Tensor | None  # [11] P(C=c), renormalised over digits; None if no cue
    positions: dict[str, object] = field(default_factory=dict)

    # The properties are thin: their logic sits in plain functions below, which mutation
    # testing can reach (it skips decorated functions).
    @property
    def h_ans(self) -> torch.Tensor:
        return mean_answer_state(self.h_answer)

    @property
    def verbalized_mu(self) -> float | None:
        """μ(C) = Σ_c (c/10)·P(C=c) (docs/method.md §3)."""
        return stated_mu(self.digit_probs)

    @property
    def answer_logprobs(self) -> torch.Tensor:
        return answer_span_logprobs(self.token_logprobs, self.answer_index)

    def shapes(self) -> dict[str, list[int]]:
        out = {}
        for name in ("h_pre", "h_close", "h_answer", "h_image", "h_mid", "token_logprobs",
                     "token_entropy", "answer_index", "digit_probs"):
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value.shape)
        return out


def mean_answer_state(h_answer: torch.Tensor) -> torch.Tensor:
    """h_ans: the mean state over the answer span [|A|, D] -> [D]."""
    return h_answer.mean(0)


def stated_mu(digit_probs: torch.Tensor | None) -> float | None:
    """μ(C) of one readout; None when the response stated no confidence cue."""
    if digit_probs is None:
        return None
    return float(mu_from_digit_probs(digit_probs))


def answer_span_logprobs(token_logprobs: torch.Tensor, answer_index: torch.Tensor
                         ) -> torch.Tensor:
    """Log-probs of the answer tokens, in the order of `answer_index`."""
    return token_logprobs[answer_index]


def mu_from_digit_probs(probs: torch.Tensor) -> torch.Tensor:
    """Expected verbalized confidence from P(C=0..10) (renormalised here too), in float64:
    in float32 a stated 9 is 0.8999999, below HCE@0.9 and one ECE-10 bin down."""
    probs = probs.double()
    p = probs / probs.sum(-1, keepdim=True)
    return (p * torch.arange(11, dtype=p.dtype, device=p.device) / 10).sum(-1)


@dataclass
class Response:
    text: str                    # response text, template/EOS tokens removed
    parsed: Parsed
    canonical: str
    token_ids: list[int]         # generated ids, EOS included when produced
    finished: bool               # stopped on EOS (not truncated)
    readout: Readout | None

    @property
    def answer(self) -> str:
        return self.parsed.answer


# token id -> its text decoded alone, per byte-level backend: a token decodes alone to the
# same text every time, and decoding token by token was most of `token_spans`' cost
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _piece_texts(backend, ids: list[int]) -> list[str]:
    try:
        known = _PIECES.setdefault(backend, {})
    except TypeError:                      # not weak-referenceable: decode without a cache
        known = {}
    out = []
    for t in ids:
        p = known.get(t)
        if p is None:
            p = known[t] = backend.decode([t], skip_special_tokens=False)
        out.append(p)
    return out


def token_spans(tokenizer, ids: list[int], text: str | None = None
                ) -> list[tuple[int, int]]:
    """Character span of each token in `tokenizer.decode(ids)` (prefix decoding).

    Generated ids need not equal a re-tokenisation of their text, so offsets come from
    the ids themselves. Decoding every prefix was the largest part of the readout's cost;
    with a byte-level decoder the prefix text is the UTF-8 decoding of the concatenated
    token bytes, so when every token decodes alone to valid text (no U+FFFD) and the
    pieces join to the full decode, the spans are the pieces' running lengths. Anything
    else (a character split across tokens, another decoder) takes the exact prefix loop.
    `text`, when the caller has it, is that full decode (skip_special_tokens=False,
    clean_up_tokenization_spaces=False), so it is not decoded twice.
    """
    ids = list(ids)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if ids and backend is not None and isinstance(backend.decoder, ByteLevelDecoder):
        pieces = _piece_texts(backend, ids)
        full = text if text is not None else tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "".join(pieces) == full and not any("\ufffd" in p for p in pieces):
            ends = list(accumulate(len(p) for p in pieces))
            return list(zip([0] + ends[:-1], ends))
    spans, prev = [], 0
    for k in range(len(ids)):
        cur = len(tokenizer.decode(ids[: k + 1], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False))
        spans.append((prev, cur))
        prev = cur
    return spans


def overlapping(spans: list[tuple[int, int]], start: int, end: int,
                skip: set[int] | None = None) -> list[int]:
    """Indices of tokens whose character span overlaps [start, end)."""
    skip = skip or set()
    return [k for k, (a, b) in enumerate(spans) if a < end and b > start and b > a
            and k not in skip]


def locate(parsed: Parsed, spans: list[tuple[int, int]], special: set[int]
           ) -> tuple[list[int], int]:
    """Answer token indices A and the closing index t_close (docs/method.md §1), response-relative.

    Returns t_close = -1 when the response has no usable token (state at t_prompt is used).
    """
    answer = overlapping(spans, *parsed.answer_span, skip=special)
    if parsed.tagged and parsed.close_span[0] < parsed.close_span[1] and \
            parsed.close_span != parsed.answer_span:
        close = overlapping(spans, *parsed.close_span)
        t_close = close[-1] if close else (answer[-1] if answer else -1)
    else:
        t_close = answer[-1] if answer else -1
    if t_close < 0:
        usable = [k for k in range(len(spans)) if k not in special]
        t_close = usable[-1] if usable else -1
    if not answer and t_close >= 0:
        answer = [t_close]
    return answer, t_close
