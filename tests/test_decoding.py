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
from tests.conftest import QUESTIONS, random_image


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
    # the cache `Actor._captured` decodes one more step on: same keys and values
    assert ours.cache.get_seq_length() == theirs.cache.get_seq_length()
    assert len(ours.cache.layers) == len(theirs.cache.layers)
    for a, b in zip(ours.cache.layers, theirs.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 5])     # one item: `generate` drops the all-ones mask
def test_same_tokens_and_logits_as_the_library_loop(actors, images, family, n):
    actor = actors[family]
    ours = _generate(actor, images[:n], QUESTIONS[:n], decode_loop)
    theirs = _generate(actor, images[:n], QUESTIONS[:n], None)
    _assert_same(ours, theirs)


def test_sliding_window_layers_decode_alike(actor_dirs, tmp_path):
    """Gemma3 with a sliding-window layer whose window the prompt outgrows."""
    import json
    import shutil

    folder = tmp_path / "gemma3-sliding"
    shutil.copytree(actor_dirs["gemma3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    config["text_config"]["sliding_window"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    actor = load_actor(str(folder))
    imgs = [random_image(i) for i in range(3)]
    assert actor.encode(imgs, QUESTIONS[:3]).input_ids.shape[1] > 8
    _assert_same(_generate(actor, imgs, QUESTIONS[:3], decode_loop),
                 _generate(actor, imgs, QUESTIONS[:3], None))


def test_a_checkpoint_saved_without_cache_still_decodes_with_one(actor_dirs, tmp_path, images):
    """`use_cache: false` (saved after training with gradient checkpointing): the loop
    refuses to decode without a cache, and the actor asks for one."""
    import json
    import shutil

    folder = tmp_path / "no-cache"
    shutil.copytree(actor_dirs["qwen3_vl"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["use_cache"] = config["text_config"]["use_cache"] = False
    (folder / "config.json").write_text(json.dumps(config))
    generation = folder / "generation_config.json"
    saved = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**saved, "use_cache": False}))
    actor = load_actor(str(folder))
    with pytest.raises(ValueError, match="use_cache"):
        _generate(actor, images[:2], QUESTIONS[:2], decode_loop, use_cache=False)
    want = load_actor(actor_dirs["qwen3_vl"]).answer(images[:2], QUESTIONS[:2], 8)
    got = actor.answer(images[:2], QUESTIONS[:2], 8)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


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


class Counting(StoppingCriteria):
    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.lengths.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_other_criteria_see_every_step_the_last_included(qwen3, images):
    calls = []
    for loop in (decode_loop, None):
        counting = Counting()
        _generate(qwen3, images[:2], QUESTIONS[:2], loop, max_new_tokens=6,
                  stopping_criteria=StoppingCriteriaList([counting]))
        calls.append(counting.lengths)
    assert calls[0] == calls[1] and len(calls[0]) == 6


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


def test_sampled_rows_that_finish_early_are_padded_alike(embedded_actor):
    """SC@K's case: the embedded actor sampling at temperature 1, rows ending with EOS at
    different steps; the same seed draws the same tokens in both loops."""
    items = sample(load("easyvqa:test"), 6, seed=4)
    images, questions = [it.image() for it in items], [it.question for it in items]
    runs = []
    for loop in (decode_loop, None):
        torch.manual_seed(11)
        runs.append(_generate(embedded_actor, images, questions, loop, max_new_tokens=64,
                              do_sample=True, temperature=1.0, top_p=1.0))
    _assert_same(*runs)
    gen = runs[0].sequences[:, -len(runs[0].logits):]
    ended = [len(embedded_actor._trim(row)) for row in gen.tolist()]
    assert len(set(ended)) > 1 and min(ended) < gen.shape[1]


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
