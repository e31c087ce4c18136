"""`decode_loop` decodes exactly as transformers' own loop: same tokens, same logits, same
cache, for every family, with padding, rows that finish early, logits processors and
sampling."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from models.data import load, sample
from models.decoding import decode_loop
from models.loading import load_actor
from models.tiny import FAMILIES
from tests.conftest import QUESTIONS


def _generate(actor, images, questions, loop, max_new_tokens=12, **extra):
    batch = actor.encode(images, questions)
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=actor.pad_id,
                  eos_token_id=sorted(actor.eos_ids), return_dict_in_generate=True,
                  output_logits=True, top_p=None, top_k=None, temperature=None)
    kwargs.update(extra)
    return actor.model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                custom_generate=loop, **kwargs, **actor._vision_kwargs(batch))


def _assert_same(ours, theirs):
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == len(theirs.logits)
    for a, b in zip(ours.logits, theirs.logits):
        assert torch.equal(a, b)
    assert ours.cache.get_seq_length() == theirs.cache.get_seq_length()


@pytest.mark.parametrize("family", FAMILIES)
def test_same_tokens_and_logits_as_the_library_loop(actors, images, family):
    actor = actors[family]
    ours = _generate(actor, images[:5], QUESTIONS[:5], decode_loop)
    theirs = _generate(actor, images[:5], QUESTIONS[:5], None)
    _assert_same(ours, theirs)


@pytest.fixture(scope="module")
def embedded_actor():
    return load_actor()


@pytest.mark.parametrize("pad_given", [True, False])
def test_rows_that_finish_early_are_padded_alike(embedded_actor, pad_given):
    """The embedded actor on easy-VQA: rows end with EOS at different steps (the random
    actors never emit theirs) and the finished ones are padded, with the pad id given or,
    as `generate` does without one, the first EOS id."""
    actor = embedded_actor
    items = sample(load("easyvqa:test"), 8, seed=3)
    images, questions = [it.image() for it in items], [it.question for it in items]
    pad = actor.pad_id if pad_given else None
    ours = _generate(actor, images, questions, decode_loop, max_new_tokens=64,
                     pad_token_id=pad)
    theirs = _generate(actor, images, questions, None, max_new_tokens=64, pad_token_id=pad)
    _assert_same(ours, theirs)
    gen = ours.sequences[:, -len(ours.logits):]
    ended = [len(actor._trim(row)) for row in gen.tolist()]
    assert len(set(ended)) > 1 and max(ended) < 64     # uneven, and every row ended
    filler = actor.pad_id if pad_given else min(actor.eos_ids)
    assert all((gen[b, n:] == filler).all() for b, n in enumerate(ended))


class StopRowAt(StoppingCriteria):
    """Stops one row once the sequence is `length` long (a deadline does the same)."""

    def __init__(self, row: int, length: int) -> None:
        self.row, self.length = row, length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] >= self.length
        return done


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_other_stopping_criteria_are_honoured(actors, images, family):
    actor = actors[family]
    lp = actor.encode(images[:3], QUESTIONS[:3]).input_ids.shape[1]
    stop = StoppingCriteriaList([StopRowAt(1, lp + 4)])
    ours = _generate(actor, images[:3], QUESTIONS[:3], decode_loop, stopping_criteria=stop)
    theirs = _generate(actor, images[:3], QUESTIONS[:3], None, stopping_criteria=stop)
    _assert_same(ours, theirs)
    assert (ours.sequences[1, lp + 4:] == actor.pad_id).all()
    assert not (ours.sequences[0, lp + 4:] == actor.pad_id).all()


def test_the_checkpoints_logits_processors_still_apply(qwen3, images):
    """A repetition penalty from the generation config changes the tokens; both loops apply
    it."""
    plain = _generate(qwen3, images[:3], QUESTIONS[:3], None, max_new_tokens=16)
    ours = _generate(qwen3, images[:3], QUESTIONS[:3], decode_loop, max_new_tokens=16,
                     repetition_penalty=5.0)
    theirs = _generate(qwen3, images[:3], QUESTIONS[:3], None, max_new_tokens=16,
                       repetition_penalty=5.0)
    _assert_same(ours, theirs)
    assert not torch.equal(ours.sequences, plain.sequences)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_draws_what_the_library_draws(actors, images, family):
    """Same seed, same warpers (temperature, top-p): the same samples and logits."""
    actor = actors[family]
    runs = []
    for loop in (decode_loop, None):
        torch.manual_seed(7)
        runs.append(_generate(actor, images[:4], QUESTIONS[:4], loop, do_sample=True,
                              temperature=1.3, top_p=0.9))
    _assert_same(*runs)
    torch.manual_seed(8)
    other = _generate(actor, images[:4], QUESTIONS[:4], decode_loop, do_sample=True,
                      temperature=1.3, top_p=0.9)
    assert not torch.equal(other.sequences, runs[0].sequences)     # it does sample


def test_actor_samples_through_the_loop(qwen3, images, monkeypatch):
    import models.actor as actor_module
    ours = qwen3.sample(images[:2], QUESTIONS[:2], k=3, max_new_tokens=6, seed=3)
    monkeypatch.setattr(actor_module, "decode_loop", None)       # the library's loop
    theirs = qwen3.sample(images[:2], QUESTIONS[:2], k=3, max_new_tokens=6, seed=3)
    assert [[r.token_ids for r in row] for row in ours] == \
        [[r.token_ids for r in row] for row in theirs]


@pytest.mark.parametrize("extra", [{"output_scores": True}, {"output_hidden_states": True},
                                   {"output_attentions": True}])
def test_what_it_does_not_do_is_refused(qwen3, images, extra):
    with pytest.raises(ValueError, match="decode_loop"):
        _generate(qwen3, images[:1], QUESTIONS[:1], decode_loop, max_new_tokens=3, **extra)


def test_without_return_dict_it_returns_the_sequences(qwen3, images):
    ids = _generate(qwen3, images[:2], QUESTIONS[:2], decode_loop, max_new_tokens=5,
                    return_dict_in_generate=False)
    assert torch.equal(ids, _generate(qwen3, images[:2], QUESTIONS[:2], None,
                                      max_new_tokens=5).sequences)
