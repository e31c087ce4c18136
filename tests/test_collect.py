"""Collection: P(True), agreement, semantic entropy, and the on-disk feature cache.

A small stand-in actor (no transformer) makes readouts from the image content, counts its
calls and can be told to fail, so a cache hit is visible as "no call at all".
"""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from heads.collect import Collector
from heads.passes import (
    agreement,
    answer_token_sets,
    ptrue_from_probs,
    ptrue_text,
    semantic_entropy,
)
from models.data import Item
from tests.helpers import red_or_blue, seeded_response

DIM = 8
SHIFT = 1.2


# ------------------------------------------------------------------ P(True)
class _Tok:
    """First tokens of the True/False spellings; " A" and " B" both start with a bare
    space (id 9), which therefore tells nothing."""

    table = {"A": [5], " A": [9, 5], "True": [6], " True": [7],
             "B": [8], " B": [9, 8], "False": [10], " False": []}

    def encode(self, word, add_special_tokens=False):
        return list(self.table[word])


def test_ptrue_token_sets_and_normalisation():
    yes, no = answer_token_sets(_Tok())
    assert (yes, no) == ([5, 6, 7], [8, 10])
    probs = torch.zeros(2, 12)
    probs[0, [5, 6, 7, 8, 10, 9]] = torch.tensor([0.10, 0.05, 0.05, 0.15, 0.05, 0.6])
    probs[1, [5, 8]] = torch.tensor([0.02, 0.18])
    # row 0: True ids {5, 6, 7} = .20, False ids {8, 10} = .20 -> .5; the space (9) ignored
    # row 1: .02 / (.02 + .18)
    np.testing.assert_allclose(ptrue_from_probs(probs, yes, no), [0.5, 0.1], rtol=1e-6)


def test_ptrue_text_follows_the_response():
    assert ptrue_text("<answer>red</answer>", "what color?", "red") == (
        "<answer>red</answer>\n\nQuestion: what color?\nProposed Answer: red\n"
        "Is the proposed answer:\n (A) True\n (B) False\nThe proposed answer is: (")


# ------------------------------------------------------------------ SC@K and semantic entropy
def test_agreement_counts_invalid_samples_as_disagreeing():
    assert agreement("red", ["red", "blue", "", "red"]) == 0.5
    assert agreement("red", ["red"] * 3) == 1.0
    assert agreement("", ["", ""]) == 0.0            # an invalid greedy answer agrees with none
    assert agreement("red", []) == 0.0


def test_semantic_entropy_on_constructed_clusters():
    assert semantic_entropy(["a"] * 8) == 0.0
    assert semantic_entropy(["a", "a", "b", "b"]) == pytest.approx(math.log(2) / math.log(4))
    assert semantic_entropy(list("abcdefgh")) == pytest.approx(1.0)
    # two invalid samples are two clusters of one, not one cluster of two
    h = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)) / math.log(4)
    assert semantic_entropy(["", "", "a", "a"]) == pytest.approx(h)
    assert semantic_entropy(["a"]) == 0.0


# ------------------------------------------------------------------ the cache
class StandIn:
    """Answers "red" for a red image; every readout is a function of (image, question).

    The states of a red image are shifted by SHIFT on their first three coordinates, so
    they carry the label as a real readout would.
    """

    def __init__(self, fingerprint: str = "fp-1") -> None:
        self.fingerprint = fingerprint
        self.calls = 0
        self.fail = False

    def _tick(self):
        if self.fail:
            raise AssertionError("the actor ran although every chunk was cached")
        self.calls += 1

    def _response(self, img, question, text):
        shift = torch.zeros(DIM)
        shift[:3] = SHIFT * float(np.asarray(img)[..., 0].mean() > 127)
        return seeded_response(img, question, text, DIM, shift)

    @staticmethod
    def _text(img) -> str:
        return red_or_blue(img)

    def answer(self, images, questions, max_new_tokens=64, readout="capture"):
        self._tick()
        return [self._response(i, q, self._text(i)) for i, q in zip(images, questions)]

    def score(self, images, questions, responses, cue=True):
        self._tick()
        return [self._response(i, q, r) for i, q, r in zip(images, questions, responses)]

    def sample(self, images, questions, k, temperature=1.0, max_new_tokens=64, seed=None):
        self._tick()
        words = ["red", "blue", "red", "green", "red", "red", "blue", "red"]
        return [[self._response(i, q, f"<answer>{w}</answer>") for w in words[:k]]
                for i, q in zip(images, questions)]


@pytest.fixture
def items(tmp_path):
    out = []
    for k in range(10):
        path = tmp_path / f"{k}.png"
        Image.new("RGB", (8, 8), (200, 40, 40) if k % 3 else (20, 20, 200)).save(path)
        out.append(Item(id=f"i{k}", image_path=str(path), question=f"what color {k}?",
                        answer="red", image_id=f"img{k}"))
    return out


EXTRAS = ("bicr", "samples")


def test_cache_hit_returns_identical_features_without_running_the_actor(items, tmp_path):
    actor = StandIn()
    cache = tmp_path / "cache"
    first, meta1 = Collector(actor, cache, max_new_tokens=6, batch=4).run(items, EXTRAS)
    assert actor.calls == 3 * 3                     # 3 chunks x (base, bicr, samples)
    assert len(list(cache.glob("base-*.safetensors"))) == 3
    actor.fail = True
    second, meta2 = Collector(actor, cache, max_new_tokens=6, batch=4).run(items, EXTRAS)
    assert meta2 == meta1
    assert set(second) == set(first)
    for k in first:
        torch.testing.assert_close(second[k], first[k], rtol=0, atol=0, equal_nan=True,
                                   msg=k)
    # and the cached values are the right ones: z from the answers, in item order
    assert first["z"].tolist() == [0.0 if k % 3 == 0 else 1.0 for k in range(10)]
    assert meta1["ids"] == [it.id for it in items]
    assert first["sc8"].tolist() == [pytest.approx(5 / 8) if k % 3 else 0.25 for k in range(10)]


def test_cache_is_keyed_by_actor_and_generation_length(items, tmp_path):
    cache = tmp_path / "cache"
    Collector(StandIn("fp-1"), cache, max_new_tokens=6, batch=4).run(items)
    other = StandIn("fp-2")
    Collector(other, cache, max_new_tokens=6, batch=4).run(items)
    assert other.calls == 3                          # another actor never reads fp-1's shards
    longer = StandIn("fp-1")
    Collector(longer, cache, max_new_tokens=7, batch=4).run(items)
    assert longer.calls == 3


def test_no_cache_dir_always_computes(items):
    actor = StandIn()
    a, _ = Collector(actor, None, batch=4).run(items)
    b, _ = Collector(actor, None, batch=4).run(items)
    assert actor.calls == 6
    torch.testing.assert_close(a["phi"], b["phi"])
