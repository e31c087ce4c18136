"""Readout pieces mutation testing found untested: the state tap (on a hand-built decoder,
no transformer) and the plain functions behind `Readout`'s properties."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from models.readout import (
    StateTap,
    answer_span_logprobs,
    mean_answer_state,
    stated_mu,
)


class _Layer(nn.Module):
    """A decoder layer that returns a tuple, as the real ones do."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return (x + self.k, "cache")


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(1.0), _Layer(10.0), _Layer(100.0)])
        self.norm = nn.Identity()                 # returns a tensor, not a tuple

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return self.norm(x * 2)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = _Decoder()

    def get_decoder(self):
        return self.decoder

    def forward(self, x):
        return self.decoder(x)


def test_state_tap_keeps_the_final_norm_and_layer_mid_minus_one():
    model, x = _Model(), torch.zeros(2)
    with StateTap(model, mid_layer=2) as tap:
        model(x)
        model(x + 1)
    # layer index mid_layer − 1 = 1 outputs x + 1 + 10; the norm sees 2·(x + 111)
    assert [t.tolist() for t in tap.states["mid"]] == [[11.0, 11.0], [12.0, 12.0]]
    assert [t.tolist() for t in tap.states["last"]] == [[222.0, 222.0], [224.0, 224.0]]
    # outside the block nothing more is kept; entering again appends
    model(x)
    assert len(tap.states["last"]) == 2
    with tap:
        model(x)
    assert len(tap.states["mid"]) == 3 and tap.states["mid"][-1].tolist() == [11.0, 11.0]


def test_state_tap_ignores_other_threads():
    model = _Model()
    with StateTap(model, mid_layer=1) as tap:
        t = threading.Thread(target=model, args=(torch.zeros(1),))
        t.start()
        t.join()
        assert tap.states == {"last": [], "mid": []}
        model(torch.zeros(1))
    assert tap.states["mid"][0].tolist() == [1.0]


def test_readout_view_functions_by_hand():
    h = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert mean_answer_state(h).tolist() == [2.0, 4.0]
    lp = torch.tensor([-1.0, -2.0, -3.0])
    assert answer_span_logprobs(lp, torch.tensor([2, 0])).tolist() == [-3.0, -1.0]
    assert stated_mu(None) is None
    probs = torch.zeros(11)
    probs[3], probs[8] = 1.0, 3.0                 # renormalised: .25 at .3, .75 at .8
    mu = stated_mu(probs)
    assert type(mu) is float and mu == pytest.approx(0.25 * 0.3 + 0.75 * 0.8)



def test_extract_without_answer_tokens_uses_the_whole_response():
    """No answer token (a response of special tokens only): the span statistics fall back
    to 0 for the log-prob scores and to the mean entropy over every response token."""
    from heads.features import extract
    from models.readout import Readout

    ro = Readout(h_pre=torch.zeros(2), h_close=torch.zeros(2), h_answer=torch.ones(1, 2),
                 h_image=torch.ones(3, 2), h_mid=torch.zeros(2),
                 token_logprobs=torch.tensor([-1.0, -3.0]),
                 token_entropy=torch.tensor([0.5, 1.5]),
                 answer_index=torch.tensor([], dtype=torch.long), digit_probs=None)
    f = extract(ro)
    assert f["msp"].tolist() == [0.0] and f["mean_logprob"].tolist() == [0.0]
    assert f["entropy"].tolist() == [1.0]
    for k in ("msp", "mean_logprob", "entropy", "mu"):
        assert f[k].shape == (1,), k


def test_locate_a_cut_empty_answer_falls_back_to_the_last_token():
    """An empty tagged answer whose closing tag was cut off: no answer and no closing
    token, so t_close is the last usable token and A = [t_close]."""
    from models.parse import parse_response
    from models.readout import locate

    parsed = parse_response("<answer></answer>")
    assert parsed.tagged and parsed.answer_span == (8, 8)
    assert locate(parsed, [(0, 3), (3, 8)], set()) == ([1], 1)     # "<ans", "wer>"
    assert locate(parsed, [(0, 3), (3, 8)], {1}) == ([0], 0)       # the last one is special


class _Backend:
    """A byte-level tokenizer backend that counts its single-token decodes."""

    def __init__(self, pieces: list[str]) -> None:
        from tokenizers.decoders import ByteLevel

        self.decoder = ByteLevel()
        self.pieces = pieces
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        assert skip_special_tokens is False
        self.calls += 1
        return "".join(self.pieces[i] for i in ids)


class _Tokenizer:
    """`decode` as a Hugging Face tokenizer's, refusing any other reading of the flags
    than the one the spans are defined by; `full` replaces the whole text's decode."""

    def __init__(self, pieces: list[str], full: str | None = None) -> None:
        self.backend_tokenizer = _Backend(pieces)
        self.full = full

    def decode(self, ids, skip_special_tokens=None, clean_up_tokenization_spaces=None) -> str:
        assert skip_special_tokens is False and clean_up_tokenization_spaces is False
        text = "".join(self.backend_tokenizer.pieces[i] for i in ids)
        whole = len(ids) == len(self.backend_tokenizer.pieces)
        return self.full if whole and self.full is not None else text


def test_piece_texts_are_decoded_once_per_backend_and_token():
    from models.readout import _piece_texts

    a, b = _Backend(["x", "yy", "z"]), _Backend(["p", "q", "r"])
    assert _piece_texts(a, [0, 1, 1, 2]) == ["x", "yy", "yy", "z"] and a.calls == 3
    assert _piece_texts(a, [2, 0]) == ["z", "x"] and a.calls == 3            # cached
    assert _piece_texts(b, [0, 1]) == ["p", "q"] and b.calls == 2            # not a's cache

    class Slotted:
        """A backend no weak reference can point at: decoded without a cache."""
        __slots__ = ("pieces",)

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return "".join(self.pieces[i] for i in ids)

    s = Slotted()
    s.pieces = ["u", "v"]
    assert _piece_texts(s, [1, 0, 1]) == ["v", "u", "v"]


def test_token_spans_read_the_pieces_only_when_they_join_to_the_decoded_text():
    from models.readout import token_spans

    assert token_spans(_Tokenizer(["ab", "c", "de"]), [0, 1, 2]) == [(0, 2), (2, 3), (3, 5)]
    # a whole decode that differs from the joined pieces: the prefix loop's spans
    tok = _Tokenizer(["ab", "c", "de"], full="abcdeX")
    assert token_spans(tok, [0, 1, 2]) == [(0, 2), (2, 3), (3, 6)]


def test_token_spans_take_the_prefix_loop_for_a_piece_holding_a_replacement_character():
    """A token that decodes alone to U+FFFD may be part of a character split across tokens:
    the spans come from decoding every prefix even when the pieces join to the text."""
    from models.readout import token_spans

    class Counting(_Tokenizer):
        decodes = 0

        def decode(self, ids, **kw) -> str:
            self.decodes += 1
            return super().decode(ids, **kw)

    tok = Counting(["a", "\ufffd", "b"])
    assert token_spans(tok, [0, 1, 2]) == [(0, 1), (1, 2), (2, 3)]
    assert tok.decodes == 1 + 3                  # the whole text, then each prefix
    plain = Counting(["a", "c", "b"])
    assert token_spans(plain, [0, 1, 2]) == [(0, 1), (1, 2), (2, 3)]
    assert plain.decodes == 1
