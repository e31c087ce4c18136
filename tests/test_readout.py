"""Readout assembly without a model: token spans, answer/close positions, Readout views.

Fast on purpose (a tokenizer, no transformer), so mutation testing can run it per mutant.
"""

import pytest
import torch

from models.parse import parse_response
from models.readout import (
    Readout,
    locate,
    mu_from_digit_probs,
    overlapping,
    token_spans,
)
from models.tiny import build_tokenizer


class _Pieces:
    """A tokenizer whose ids decode to fixed text pieces (no byte-level decoder)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids)


def _prefix_spans(tok, ids) -> list[tuple[int, int]]:
    """Reference: the span of token k is [len(decode(ids[:k])), len(decode(ids[:k+1])))."""
    lens = [0] + [len(tok.decode(ids[: k + 1], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)) for k in range(len(ids))]
    return list(zip(lens[:-1], lens[1:]))


def test_spans_of_plain_pieces():
    tok = _Pieces(["<answer>", "re", "d", "</answer>", "", "!"])
    assert token_spans(tok, [0, 1, 2, 3]) == [(0, 8), (8, 10), (10, 11), (11, 20)]
    assert token_spans(tok, [1, 4, 5]) == [(0, 2), (2, 2), (2, 3)]   # an empty piece
    assert token_spans(tok, []) == []


@pytest.mark.parametrize("text", [
    "<think>I see a red circle.</think><answer>red</answer><confidence>9</confidence>",
    "<think>I see é a red circle.</think><answer>red</answer>",   # é is split over 2 tokens
    "  red  ",
])
def test_byte_level_spans_equal_prefix_decoding(text):
    tok = build_tokenizer("qwen3_vl")
    ids = tok.encode(text, add_special_tokens=False)
    spans = token_spans(tok, ids)
    assert spans == _prefix_spans(tok, ids)
    assert spans[-1][1] == len(tok.decode(ids, skip_special_tokens=False))


def test_overlapping_hand_cases():
    spans = [(0, 3), (3, 5), (5, 5), (5, 9), (9, 12)]
    assert overlapping(spans, 3, 9) == [1, 3]          # the empty token never overlaps
    assert overlapping(spans, 4, 6) == [1, 3]
    assert overlapping(spans, 3, 9, skip={3}) == [1]
    assert overlapping(spans, 12, 15) == []
    assert overlapping(spans, 0, 1) == [0]
    assert overlapping(spans, 2, 3) == [0]             # [2, 3) touches token 0 only


def _locate(pieces: list[str], special: set[int] = frozenset()):
    tok = _Pieces(pieces)
    text = "".join(p for k, p in enumerate(pieces) if k not in special)
    return locate(parse_response(text), token_spans(tok, list(range(len(pieces)))),
                  set(special))


def test_locate_tagged_answer_closes_on_the_tag():
    pieces = ["<think>", "x", "</think>", "<answer>", "re", "d", "</answer>", "<confidence>",
              "9", "</confidence>"]
    assert _locate(pieces) == ([4, 5], 6)


def test_locate_untagged_answer_closes_on_its_last_token():
    assert _locate(["re", "d", " "]) == ([0, 1], 1)
    assert _locate(["red", " "]) == ([0], 0)            # t_close 0 is a real position
    assert _locate([" ", "blue", " ", "circle"]) == ([1, 2, 3], 3)


def test_locate_unclosed_tag_closes_on_the_last_answer_token():
    assert _locate(["<answer>", "re", "d"]) == ([1, 2], 2)


def test_locate_empty_answer_falls_back_to_the_last_usable_token():
    # empty answer tag: A = [t_close]; t_close is the closing tag
    assert _locate(["<answer>", "</answer>"]) == ([1], 1)
    # an untagged blank response: the last token that is not special
    assert _locate([" ", "\n", "<eos>"], special={2}) == ([1], 1)
    assert _locate([" ", "\n", "\t"]) == ([2], 2)
    assert _locate([" "]) == ([0], 0)
    # only special tokens: nothing usable
    assert _locate(["<eos>"], special={0}) == ([], -1)


def test_locate_skips_special_tokens_in_the_answer():
    # an end-of-turn token inside the answer's character range is not an answer token
    parsed = parse_response("red")
    spans = [(0, 2), (2, 3), (2, 3)]          # token 1 is special and overlaps the answer
    assert locate(parsed, spans, {1}) == ([0, 2], 2)


def _ro(digits=None) -> Readout:
    g = torch.Generator().manual_seed(0)
    return Readout(h_pre=torch.zeros(4), h_close=torch.zeros(4),
                   h_answer=torch.randn(3, 4, generator=g), h_image=torch.zeros(2, 4),
                   h_mid=torch.zeros(4), token_logprobs=torch.tensor([-1.0, -2.0, -3.0, -4.0]),
                   token_entropy=torch.zeros(4), answer_index=torch.tensor([3, 1]),
                   digit_probs=digits)


def test_readout_views():
    ro = _ro()
    torch.testing.assert_close(ro.h_ans, (ro.h_answer[0] + ro.h_answer[1] + ro.h_answer[2]) / 3)
    assert ro.answer_logprobs.tolist() == [-4.0, -2.0]
    assert ro.verbalized_mu is None
    assert ro.shapes() == {"h_pre": [4], "h_close": [4], "h_answer": [3, 4], "h_image": [2, 4],
                           "h_mid": [4], "token_logprobs": [4], "token_entropy": [4],
                           "answer_index": [2]}
    digits = torch.zeros(11)
    digits[10], digits[4] = 3.0, 1.0          # renormalised: .75 at 1.0, .25 at .4
    ro = _ro(digits)
    assert ro.verbalized_mu == pytest.approx(0.75 + 0.1)
    assert ro.shapes()["digit_probs"] == [11]
    batch = torch.stack([digits, torch.ones(11)])
    torch.testing.assert_close(mu_from_digit_probs(batch).double(),
                               torch.tensor([0.85, 0.5], dtype=torch.float64), atol=1e-6, rtol=0)


class _Counting:
    """Wraps a tokenizer and counts full decodes (the prefix loop makes one per token)."""

    def __init__(self, tok) -> None:
        self.tok, self.decodes = tok, 0
        self.backend_tokenizer = tok.backend_tokenizer

    def decode(self, ids, **kw):
        self.decodes += 1
        return self.tok.decode(ids, **kw)


def test_byte_level_spans_take_one_full_decode():
    """Plain text: spans from the pieces' lengths, one decode; a split character: the loop."""
    tok = build_tokenizer("qwen3_vl")
    plain = tok.encode("<answer>red</answer><|im_end|>", add_special_tokens=False)
    counting = _Counting(tok)
    assert token_spans(counting, plain) == _prefix_spans(tok, plain)
    assert counting.decodes == 1
    text = tok.decode(plain, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    counting = _Counting(tok)                 # the caller's decode is reused, not redone
    assert token_spans(counting, plain, text) == _prefix_spans(tok, plain)
    assert counting.decodes == 0
    split = tok.encode("é red", add_special_tokens=False)
    counting = _Counting(tok)
    assert token_spans(counting, split) == _prefix_spans(tok, split)
    assert counting.decodes == 1 + len(split)


def test_locate_close_tag_beyond_the_tokens_closes_on_the_answer():
    # the tokens stop before "</answer>" (a cut response): t_close is the last answer token
    parsed = parse_response("<answer>blue</answer>")
    spans = [(0, 8), (8, 9), (9, 10), (10, 12)]          # "<answer>", "b", "l", "ue"
    assert locate(parsed, spans, set()) == ([1, 2, 3], 3)
