"""Self-calibration of the verbalized confidence: the loss terms on hand-computed cases,
and the teacher-forced batch layout (the stage end to end: tests/test_train.py)."""

import math

import torch
from PIL import Image

from models.data import Item, load
from models.loading import load_actor
from models.readout import mu_from_digit_probs
from models.self_calibrate import Batches, Example, digit_terms, validation_auroc


def test_digit_terms_by_hand():
    """μ(C) is the expected level under the renormalised digit distribution at the cue
    (the readout the service reports), log_mass the log-probability of any digit there."""
    vocab, digits = 14, torch.arange(3, 14)               # ids 3..13 are the levels 0..10
    logits = torch.full((2, 4, vocab), -30.0)
    # row 0, cue at 1: P(level 10) = P(level 5) within the digits; non-digits hold 1/2
    logits[0, 1, 13] = 0.0
    logits[0, 1, 8] = 0.0
    logits[0, 1, 0] = math.log(2.0)
    logits[1, 2, 12] = 0.0                                # row 1 has no cue: dropped
    mu, log_mass, keep = digit_terms(logits, torch.tensor([1, -1]), digits)
    assert keep.tolist() == [True, False]
    assert torch.allclose(mu, torch.tensor([0.75]), atol=1e-6)
    assert torch.allclose(log_mass, torch.tensor([math.log(0.5)]), atol=1e-5)
    probs = torch.softmax(logits[0, 1, digits], -1)
    assert math.isclose(float(mu_from_digit_probs(probs)), float(mu[0]), abs_tol=1e-6)


def _item(k: int, question: str = "What color is the shape?") -> Item:
    items = load("easyvqa:actor")
    it = items[k]
    return Item(id=f"t{k}", image_path=it.image_path, question=question, answer="red",
                image_id=it.image_id, domain="easyvqa", answer_type="color")


def test_batches_point_at_the_digit_and_leave_it_to_the_brier_term():
    actor = load_actor()
    tok = actor.tokenizer
    text = "<think>I see a red circle. so</think><answer>red</answer><confidence>7</confidence>"
    resp = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    rows = [Example(_item(0), resp, True), Example(_item(1, "Is there a circle?"),
                                                   resp[:5] + [tok.eos_token_id], False)]
    inputs, labels, cue_at, z = Batches(actor)(rows)
    ids = inputs["input_ids"]
    k = int(cue_at[0])
    assert tok.convert_ids_to_tokens(int(ids[0, k])) == "<confidence>"
    assert tok.decode([int(ids[0, k + 1])]) == "7"
    assert labels[0, k + 1] == -100                       # no CE on the digit
    # every other response token is a CE target, no prompt token is
    at = resp.index(tok.convert_tokens_to_ids("<confidence>"))
    n_prompt = k - at
    assert labels[0][labels[0] != -100].tolist() == resp[: at + 1] + resp[at + 2:]
    assert (labels[0, :n_prompt] == -100).all()
    assert ids[0, n_prompt: n_prompt + len(resp)].tolist() == resp
    assert cue_at[1] == -1 and z.tolist() == [1.0, 0.0]
    # an answer on a flat image: self-distilled only (no Brier), shown the flat image
    b_in, b_lab, b_cue, _ = Batches(actor)([Example(_item(0), resp, False, blank=128)])
    assert b_cue.tolist() == [-1] and b_lab[0, k + 1] == -100
    flat = actor.processor.image_processor(images=[Image.new("RGB", (224, 224), (128,) * 3)],
                                           return_tensors="pt")["pixel_values"]
    assert torch.equal(b_in["pixel_values"], flat)
    # the image's placeholder tokens match the pixels: the model accepts the batch
    with torch.no_grad():
        out = actor.model(**inputs).logits
    assert out.shape[:2] == ids.shape


def test_validation_auroc_reads_mu_at_the_cue():
    """A model whose μ(C) is higher on the right answers gets AUROC 1 on them."""
    actor = load_actor()
    tok = actor.tokenizer
    cue = "<think>I see a red circle. so</think><answer>red</answer><confidence>"
    rows = []
    for k, ok in enumerate([True, False, True, False]):
        r = tok.encode(cue + ("9" if ok else "2") + "</confidence>",
                       add_special_tokens=False) + [tok.eos_token_id]
        rows.append(Example(_item(k), r, ok))
    batches = Batches(actor)

    class Peek(torch.nn.Module):
        """Puts all the digit mass on the level each row's response states."""

        def forward(self, input_ids, **_):
            logits = torch.zeros(*input_ids.shape, len(tok))
            logits[:, :-1].scatter_(-1, input_ids[:, 1:, None], 50.0)
            return type("Out", (), {"logits": logits})()

    got = validation_auroc(Peek(), batches, rows)
    assert got["val_mu_auroc"] == 1.0
    assert math.isclose(got["val_mu_mean"], (0.9 + 0.2) / 2, abs_tol=1e-3)


def test_loss_terms_by_hand():
    """Brier of μ against correctness, log P(digit), CE on the rest of the response: with
    every row's mass on the level it states, μ is that level and log P(digit) ≈ 0."""
    from models.self_calibrate import SelfCalibration, loss_of

    actor = load_actor()
    tok = actor.tokenizer
    cue = "<think>I see a red circle. so</think><answer>red</answer><confidence>"
    rows = [Example(_item(k), tok.encode(cue + level + "</confidence>",
                                         add_special_tokens=False) + [tok.eos_token_id], ok)
            for k, (level, ok) in enumerate([("9", True), ("2", False), ("10", False)])]

    class Peek(torch.nn.Module):
        def forward(self, input_ids, **_):
            logits = torch.zeros(*input_ids.shape, len(tok))
            logits[:, :-1].scatter_(-1, input_ids[:, 1:, None], 50.0)
            return type("Out", (), {"logits": logits})()

    _, parts = loss_of(Peek(), Batches(actor), rows, SelfCalibration())
    assert math.isclose(parts["brier"], ((0.9 - 1) ** 2 + 0.2 ** 2 + 1.0 ** 2) / 3,
                        abs_tol=1e-6)
    assert abs(parts["log_digit_mass"]) < 1e-6 and parts["ce"] < 1e-6
