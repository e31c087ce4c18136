"""Actor runtime: readout positions, capture-vs-replay parity, masking, μ(C), sampling."""

import pytest
import torch

from models.families import position_ids
from models.masking import MaskSpec, attention_mask_4d, nested_subset
from models.readout import mu_from_digit_probs
from tests.conftest import QUESTIONS, random_image

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"]
TRAJ = "<think>I see a red circle. so red</think><answer>red</answer>"


def test_readout_positions_hand_checked(qwen3):
    tok = qwen3.tokenizer
    r = qwen3.score([random_image(0)], ["what color is the shape?"], [TRAJ])[0]
    pos = r.readout.positions
    batch = qwen3.encode([random_image(0)], ["what color is the shape?"],
                         [tok.encode(TRAJ + "<confidence>", add_special_tokens=False)])
    ids = batch.input_ids[0].tolist()
    lp = batch.prompt_len
    # t_prompt is the last prompt token: the newline after "assistant".
    assert pos["t_prompt"] == lp - 1
    assert tok.decode(ids[:lp]).endswith("<|im_start|>assistant\n")
    assert tok.decode(ids[lp:lp + 1]) == "<think>"
    # A covers exactly the answer text; t_close is the closing tag.
    assert tok.decode([ids[p] for p in pos["A"]]) == "red"
    assert ids[pos["t_close"]] == tok.convert_tokens_to_ids("</answer>")
    # V: the 32x40 image -> 4x5 patches of 8 px -> rounded to the merge grid -> 4 tokens.
    assert all(ids[v] == qwen3.image_token_id for v in pos["V"])
    assert len(pos["V"]) == sum(t == qwen3.image_token_id for t in ids) > 0
    # The readout holds exactly those rows of the final-layer states.
    last, _ = qwen3.forward_states(batch)
    ro = r.readout
    torch.testing.assert_close(ro.h_pre, last[0, lp - 1])
    torch.testing.assert_close(ro.h_close, last[0, pos["t_close"]])
    torch.testing.assert_close(ro.h_ans, last[0, pos["A"]].mean(0))
    torch.testing.assert_close(ro.h_image, last[0, pos["V"]])
    # μ(C) is read where the next token is the level, and is a proper expectation.
    assert ro.digit_probs.shape == (11,) and abs(float(ro.digit_probs.sum()) - 1) < 1e-5
    assert 0.0 <= ro.verbalized_mu <= 1.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 8])
def test_capture_matches_replay(actors, images, family, batch):
    """States captured while generating equal a teacher-forced replay (fp32, ≤ 1e-4)."""
    actor = actors[family]
    imgs, qs = images[:batch], QUESTIONS[:batch]
    cap = actor.answer(imgs, qs, max_new_tokens=10, readout="capture")
    rep = actor.answer(imgs, qs, max_new_tokens=10, readout="replay")
    assert any(not r.finished for r in cap), "the extra cached step must be exercised"
    for c, r in zip(cap, rep):
        assert c.token_ids == r.token_ids
        assert c.readout.positions == r.readout.positions
        for name in ("h_pre", "h_close", "h_answer", "h_image", "h_mid", "token_logprobs",
                     "token_entropy"):
            diff = (getattr(c.readout, name) - getattr(r.readout, name)).abs().max()
            assert diff <= 1e-4, (family, name, float(diff))


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
@pytest.mark.parametrize("readout", ["capture", "replay"])
def test_rows_with_their_own_limits_equal_each_alone(actors, images, family, readout):
    """Requests with different `max_new_tokens` share a batch: each row stops at its own
    limit, and its response and readout are what it gets alone."""
    actor = actors[family]
    limits = [3, 8, 5]
    together = actor.answer(images[:3], QUESTIONS[:3], limits, readout=readout)
    assert [len(r.token_ids) for r in together] == limits     # random actors never stop
    for k, (n, r) in enumerate(zip(limits, together)):
        [alone] = actor.answer([images[k]], [QUESTIONS[k]], n, readout=readout)
        assert r.token_ids == alone.token_ids and r.finished == alone.finished
        assert r.readout.positions["A"] == alone.readout.positions["A"]
        for name in ("h_close", "h_mid", "token_logprobs", "token_entropy"):
            diff = (getattr(r.readout, name) - getattr(alone.readout, name)).abs().max()
            assert diff <= 1e-4, (name, float(diff))
    with pytest.raises(ValueError, match="limits"):
        actor.answer(images[:3], QUESTIONS[:3], [3, 8])


def test_a_batch_stops_when_every_row_is_at_its_limit_or_done():
    """The embedded actor (it ends answers with EOS): a row limited to 2 tokens next to a
    shorter finished answer does not keep the batch decoding to its own EOS, and each
    row's `finished` is what it is alone."""
    from models.data import load, sample
    from models.loading import load_actor

    actor = load_actor()
    items = sample(load("easyvqa:test"), 8, seed=3)
    alone = {k: actor.answer([it.image()], [it.question], 64, readout="none")[0]
             for k, it in enumerate(items)}
    long_k = max(alone, key=lambda k: len(alone[k].token_ids))
    short_k = min(alone, key=lambda k: len(alone[k].token_ids))
    assert len(alone[short_k].token_ids) < len(alone[long_k].token_ids)
    assert alone[short_k].finished
    calls = []
    hook = actor.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        together = actor.answer([items[long_k].image(), items[short_k].image()],
                                [items[long_k].question, items[short_k].question], [2, 64])
    finally:
        hook.remove()
    assert together[0].token_ids == alone[long_k].token_ids[:2] and not together[0].finished
    assert together[1].token_ids == alone[short_k].token_ids and together[1].finished
    # one call per generated token of the longer row still running, none after
    assert len(calls) == len(alone[short_k].token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_ratio_zero_equals_plain_pass(actors, family):
    """The explicit 4-D mask and position ids reproduce the model's own 2-D path."""
    actor = actors[family]
    imgs, qs = [random_image(1), random_image(2, 40, 32)], QUESTIONS[:2]
    plain = actor.score(imgs, qs, [TRAJ, TRAJ + " extra"])
    zero = actor.score(imgs, qs, [TRAJ, TRAJ + " extra"], mask=MaskSpec("think", 0.0))
    for a, b in zip(plain, zero):
        torch.testing.assert_close(a.readout.h_close, b.readout.h_close, atol=1e-4, rtol=0)
        torch.testing.assert_close(a.readout.h_image, b.readout.h_image, atol=1e-4, rtol=0)


def _equal_length_pair(tok) -> tuple[str, str]:
    """Two trajectories whose think spans differ but tokenise to the same length."""
    def traj(w: str) -> str:
        return f"<think>{w} {w} {w}</think><answer>red</answer>"
    words = ["red", "blue", "circle", "shape", "green", "left", "right", "yes", "no"]
    lengths = {w: len(tok.encode(traj(w), add_special_tokens=False)) for w in words}
    for w in words[1:]:
        if lengths[w] == lengths["red"]:
            return traj("red"), traj(w)
    raise AssertionError("no equal-length pair in the tiny vocabulary")


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_span_is_invisible_later(actors, family):
    actor = actors[family]
    tok = actor.tokenizer
    img, q = random_image(3), QUESTIONS[0]
    a, b = _equal_length_pair(tok)
    full = MaskSpec("think", 1.0)
    ra, rb = (actor.score([img], [q], [t], mask=full)[0] for t in (a, b))
    # Everything after the span is unchanged when only the masked content differs ...
    torch.testing.assert_close(ra.readout.h_close, rb.readout.h_close, atol=1e-5, rtol=0)
    torch.testing.assert_close(ra.readout.h_answer, rb.readout.h_answer, atol=1e-5, rtol=0)
    # ... while without the mask it does change (the test can fail).
    ua, ub = (actor.score([img], [q], [t])[0] for t in (a, b))
    assert (ua.readout.h_close - ub.readout.h_close).abs().max() > 1e-3

    # And it equals a pass with the span removed but positions kept.
    ids = tok.encode(a + "<confidence>", add_special_tokens=False)
    batch = actor.encode([img], [q], [ids])
    pos = position_ids(actor.model, actor.family, batch.input_ids, batch.attention_mask,
                       batch.type_ids, batch.vision.get("image_grid_thw"))
    lp = batch.prompt_len
    think_end = tok.convert_tokens_to_ids("</think>")
    start = lp + 1
    stop = lp + ids.index(think_end)
    keep = [i for i in range(batch.input_ids.shape[1]) if not start <= i < stop]
    batch.input_ids = batch.input_ids[:, keep]
    batch.attention_mask = batch.attention_mask[:, keep]
    batch.type_ids = batch.type_ids[:, keep]
    pos = pos[..., keep]
    last, _ = actor.forward_states(batch, attn=None, pos=pos)
    close = ra.readout.positions["t_close"]
    removed_close = keep.index(close)
    torch.testing.assert_close(last[0, removed_close], ra.readout.h_close, atol=1e-4, rtol=0)


def test_nested_subsets():
    for seed in range(3):
        subsets = [set(nested_subset(20, r, seed)) for r in (0, .25, .5, .75, 1)]
        assert [len(s) for s in subsets] == [0, 5, 10, 15, 20]
        assert all(a <= b for a, b in zip(subsets, subsets[1:]))
    assert nested_subset(20, .5, 0) != nested_subset(20, .5, 1)


def test_4d_mask_blocks_later_tokens_only(qwen3):
    mask2d = torch.ones(1, 5, dtype=torch.long)
    masked = torch.tensor([[False, False, True, False, False]])
    m = attention_mask_4d(mask2d, masked, torch.zeros(1, 5, dtype=torch.long), qwen3.family,
                          torch.float32, qwen3.model.config)[0, 0]
    allowed = m == 0
    assert allowed[2, 2] and allowed[2, 1]          # masked token still sees itself & past
    assert not allowed[3, 2] and not allowed[4, 2]  # later tokens cannot see it
    assert allowed[4, 3] and not allowed[1, 2]      # causal otherwise


def test_mu_on_constructed_distributions():
    one_hot = torch.zeros(11)
    one_hot[7] = 1
    assert float(mu_from_digit_probs(one_hot)) == pytest.approx(0.7)
    assert float(mu_from_digit_probs(torch.ones(11))) == pytest.approx(0.5)
    two = torch.zeros(11)
    two[2], two[10] = 3.0, 1.0        # unnormalised: renormalised to .75/.25
    assert float(mu_from_digit_probs(two)) == pytest.approx(0.75 * 0.2 + 0.25 * 1.0)


def test_digit_readout_matches_model_distribution(qwen3):
    r = qwen3.score([random_image(0)], [QUESTIONS[0]], [TRAJ])[0]
    tok = qwen3.tokenizer
    ids = tok.encode(TRAJ + "<confidence>", add_special_tokens=False)
    batch = qwen3.encode([random_image(0)], [QUESTIONS[0]], [ids])
    out = qwen3.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      mm_token_type_ids=batch.type_ids, **batch.vision)
    p = torch.softmax(out.logits[0, -1], -1)
    digits = torch.tensor([tok.convert_tokens_to_ids(str(c)) for c in range(11)])
    expected = p[digits] / p[digits].sum()
    torch.testing.assert_close(r.readout.digit_probs, expected, atol=1e-5, rtol=1e-4)


def test_sampling_returns_k_per_item(qwen3, images):
    out = qwen3.sample(images[:2], QUESTIONS[:2], k=4, max_new_tokens=6, seed=0)
    assert [len(o) for o in out] == [4, 4]
    again = qwen3.sample(images[:2], QUESTIONS[:2], k=4, max_new_tokens=6, seed=0)
    assert [r.token_ids for r in out[0]] == [r.token_ids for r in again[0]]
    assert len({tuple(r.token_ids) for r in out[0]}) > 1   # temperature 1 explores


def _model_logprobs(actor, img, question, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """log p and entropy of each response token from the model's own logits, one item."""
    batch = actor.encode([img], [question], [ids])
    out = actor.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      mm_token_type_ids=batch.type_ids, **batch.vision)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    lp = batch.prompt_len
    # response token k sits at lp + k and is predicted by the logits at lp + k - 1
    tok_lp = torch.stack([logp[lp + k - 1, t] for k, t in enumerate(ids)])
    ent = torch.stack([-(logp[lp + k - 1].exp() * logp[lp + k - 1]).sum()
                       for k in range(len(ids))])
    return tok_lp, ent


def test_teacher_forced_token_logprobs_match_the_model(qwen3):
    img, q = random_image(0), QUESTIONS[0]
    ids = qwen3.tokenizer.encode(TRAJ, add_special_tokens=False)
    r = qwen3.score([img], [q], [TRAJ], cue=False)[0]
    assert r.token_ids == ids
    want_lp, want_ent = _model_logprobs(qwen3, img, q, ids)
    torch.testing.assert_close(r.readout.token_logprobs, want_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r.readout.token_entropy, want_ent, atol=1e-4, rtol=1e-4)
    # the answer-span log-probs are those of the answer token(s), "red"
    a = r.readout.answer_index.tolist()
    assert qwen3.tokenizer.decode([ids[k] for k in a]) == "red"
    torch.testing.assert_close(r.readout.answer_logprobs, want_lp[a], atol=1e-4, rtol=1e-4)


def test_generated_token_logprobs_match_the_model(qwen3, images):
    """Batched generation with capture: each item's log-probs equal its own forward."""
    res = qwen3.answer(images[:2], QUESTIONS[:2], max_new_tokens=8, readout="capture")
    for img, q, r in zip(images[:2], QUESTIONS[:2], res):
        want_lp, want_ent = _model_logprobs(qwen3, img, q, r.token_ids)
        torch.testing.assert_close(r.readout.token_logprobs, want_lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(r.readout.token_entropy, want_ent, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_reads_the_logits_generate_kept(actors, images, monkeypatch, family):
    """Capture takes the token statistics from the logits `generate` computed (the LM head
    does not run again); they equal the LM head rerun on the captured states, which is what
    capture does when a batch's logits would not fit the memory bound."""
    import models.actor as actor_module
    actor = actors[family]
    kept = actor.answer(images[:3], QUESTIONS[:3], max_new_tokens=6)
    calls = []
    monkeypatch.setattr(actor, "_logits", lambda h: calls.append(h.shape) or
                        type(actor)._logits(actor, h))
    kept_again = actor.answer(images[:3], QUESTIONS[:3], max_new_tokens=6)
    assert all(len(shape) < 3 for shape in calls)   # at most the digit row, never a slice
    monkeypatch.setattr(actor_module, "TOKEN_STATS_ELEMENTS", 0)
    rerun = actor.answer(images[:3], QUESTIONS[:3], max_new_tokens=6)
    assert any(len(shape) == 3 for shape in calls)   # the bound forced the LM head again
    # kept only where they and their stacked copy fit the bound: 2·B·N·V
    need = 2 * 3 * 6 * actor.vocab_size
    for bound, reruns in ((need - 1, True), (need, False)):
        calls.clear()
        monkeypatch.setattr(actor_module, "TOKEN_STATS_ELEMENTS", bound)
        actor.answer(images[:3], QUESTIONS[:3], max_new_tokens=6)
        assert any(len(shape) == 3 for shape in calls) == reruns, bound
    calls.clear()
    monkeypatch.setattr(actor_module, "TOKEN_STATS_ELEMENTS", 2**30)
    monkeypatch.setattr(actor, "softcap", 30.0)     # some classes cap in forward, some not
    actor.answer(images[:3], QUESTIONS[:3], max_new_tokens=6)
    assert any(len(shape) == 3 for shape in calls)   # so the capped LM head reruns
    for a, b, c in zip(kept, kept_again, rerun):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.equal(a.readout.token_logprobs, b.readout.token_logprobs)
        for key in ("token_logprobs", "token_entropy"):
            torch.testing.assert_close(getattr(a.readout, key), getattr(c.readout, key),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slices", ["one", "two items", "one item"])
def test_token_stats_in_slices_are_bitwise_the_whole_batch(qwen3, images, slices):
    """The LM head runs on bounded slices of whole items; every limit (down to one item a
    slice) gives bitwise the statistics of the whole batch in one pass (the formula
    inline)."""
    ids = [qwen3.tokenizer.encode(t, add_special_tokens=False)
           for t in (TRAJ + "<confidence>7", "<answer>blue</answer>", TRAJ)]
    batch = qwen3.encode(images[:3], QUESTIONS[:3], ids)
    last, _ = qwen3.forward_states(batch)
    seq, lp = batch.input_ids, batch.prompt_len
    n = seq.shape[1] - lp
    vocab = qwen3.model.get_output_embeddings().weight.shape[0]
    limit = {"one": 10**12, "two items": 2 * n * vocab, "one item": 1}[slices]
    tok, ent, dlp = qwen3._token_stats(last, seq, lp, limit=limit)
    logp = torch.log_softmax(qwen3._logits(last[:, lp - 1: seq.shape[1] - 1]), -1)
    want_tok = logp.gather(-1, seq[:, lp:, None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    digits = [d for d in qwen3.digit_ids if d is not None]
    assert len(digits) == 11
    assert torch.equal(tok, want_tok) and torch.equal(ent, want_ent)
    assert torch.equal(dlp, logp[..., digits])
