"""Collection: P(True), agreement, semantic entropy, and the on-disk feature cache.

A small stand-in actor (no transformer) makes readouts from the image content, counts its
calls and can be told to fail, so a cache hit is visible as "no call at all".
"""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from heads.collect import Collector, agreement, ptrue_probs, semantic_entropy
from models.data import Item
from models.parse import parse_response
from models.readout import Readout, Response

DIM = 8


# ------------------------------------------------------------------ P(True)
class _Tok:
    """First token of each yes/no variant; ' yes' shares its first id with 'yes'."""

    table = {"yes": [5], "Yes": [6], " yes": [5, 9], " Yes": [7],
             "no": [8], "No": [8], " no": [], " No": [10]}

    def encode(self, word, add_special_tokens=False):
        return list(self.table[word])


class _ProbActor:
    tokenizer = _Tok()

    def __init__(self, probs: torch.Tensor) -> None:
        self.probs = probs
        self.seen: list[str] = []

    def next_token_probs(self, images, questions):
        self.seen = list(questions)
        return self.probs


def test_ptrue_normalises_yes_against_no():
    probs = torch.zeros(2, 12)
    probs[0, [5, 6, 7, 8, 10, 9]] = torch.tensor([0.10, 0.05, 0.05, 0.15, 0.05, 0.6])
    probs[1, [5, 8]] = torch.tensor([0.02, 0.18])
    act = _ProbActor(probs)
    p = ptrue_probs(act, [None, None], ["q1", "q2"], ["red", "no"])
    # row 0: yes ids {5, 6, 7} = .20, no ids {8, 10} = .20 -> .5; id 9 (2nd token) ignored
    # row 1: .02 / (.02 + .18)
    np.testing.assert_allclose(p, [0.5, 0.1], rtol=1e-6)
    assert act.seen[0] == ("q1\nProposed answer: red\n"
                           "Is the proposed answer correct? Answer yes or no.")
    assert act.seen[1].startswith("q2\nProposed answer: no\n")


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
class _StandIn:
    """Answers "red" for a red image; every readout is a function of (image, question)."""

    def __init__(self, fingerprint: str = "fp-1") -> None:
        self.fingerprint = fingerprint
        self.calls = 0
        self.fail = False

    def _tick(self):
        if self.fail:
            raise AssertionError("the actor ran although every chunk was cached")
        self.calls += 1

    def _response(self, img, question, text):
        parsed = parse_response(text)
        seed = int(np.asarray(img).sum()) * 31 + sum(map(ord, question + text))
        g = torch.Generator().manual_seed(seed % (2 ** 31))
        ro = Readout(h_pre=torch.randn(DIM, generator=g), h_close=torch.randn(DIM, generator=g),
                     h_answer=torch.randn(2, DIM, generator=g),
                     h_image=torch.randn(3, DIM, generator=g), h_mid=torch.randn(DIM, generator=g),
                     token_logprobs=-torch.rand(4, generator=g),
                     token_entropy=torch.rand(4, generator=g),
                     answer_index=torch.tensor([1, 2]), digit_probs=None)
        return Response(text=text, parsed=parsed, canonical=parsed.answer, token_ids=[1, 2, 3],
                        finished=True, readout=ro)

    @staticmethod
    def _text(img) -> str:
        return "<answer>red</answer>" if np.asarray(img)[..., 0].mean() > 127 else "<answer>blue</answer>"

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
    actor = _StandIn()
    cache = tmp_path / "cache"
    first, meta1 = Collector(actor, cache, max_new_tokens=6, batch=4).run(items, EXTRAS)
    assert actor.calls == 3 * 3                     # 3 chunks x (base, bicr, samples)
    assert len(list(cache.glob("base-*.safetensors"))) == 3
    actor.fail = True
    second, meta2 = Collector(actor, cache, max_new_tokens=6, batch=4).run(items, EXTRAS)
    assert meta2 == meta1
    assert set(second) == set(first)
    for k in first:
        torch.testing.assert_close(second[k], first[k], rtol=0, atol=0, msg=k)
    # and the cached values are the right ones: z from the answers, in item order
    assert first["z"].tolist() == [0.0 if k % 3 == 0 else 1.0 for k in range(10)]
    assert meta1["ids"] == [it.id for it in items]
    assert first["sc8"].tolist() == [pytest.approx(5 / 8) if k % 3 else 0.25 for k in range(10)]


def test_cache_is_keyed_by_actor_and_generation_length(items, tmp_path):
    cache = tmp_path / "cache"
    Collector(_StandIn("fp-1"), cache, max_new_tokens=6, batch=4).run(items)
    other = _StandIn("fp-2")
    Collector(other, cache, max_new_tokens=6, batch=4).run(items)
    assert other.calls == 3                          # another actor never reads fp-1's shards
    longer = _StandIn("fp-1")
    Collector(longer, cache, max_new_tokens=7, batch=4).run(items)
    assert longer.calls == 3


def test_no_cache_dir_always_computes(items):
    actor = _StandIn()
    a, _ = Collector(actor, None, batch=4).run(items)
    b, _ = Collector(actor, None, batch=4).run(items)
    assert actor.calls == 6
    torch.testing.assert_close(a["phi"], b["phi"])
