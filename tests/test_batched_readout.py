"""What the service computes once per batch equals what each item gives alone: image-token
positions under left padding, features of readouts with different image sizes, and μ(C)'s
digit distribution when a level is not one token."""

import pytest
import torch

from heads.features import extract, extract_many
from models.readout import token_spans
from tests.conftest import random_image

SHORT, LONG = "what shape?", "what colour is the shape in the middle of this picture, please?"


def test_image_positions_follow_each_rows_left_padding(actors):
    """Prompts of different lengths are left padded differently, so the image tokens sit
    at other positions in each row; each item reads its own, as it does alone."""
    actor = actors["qwen3_vl"]
    imgs = [random_image(1), random_image(2)]
    both = actor.answer(imgs, [SHORT, LONG], max_new_tokens=3)
    v = [r.readout.positions["V"] for r in both]
    assert v[0] != v[1] and len(v[0]) == len(v[1])
    for img, q, r in zip(imgs, [SHORT, LONG], both):
        alone = actor.answer([img], [q], max_new_tokens=3)[0]
        assert len(alone.readout.positions["V"]) == len(r.readout.positions["V"])
        torch.testing.assert_close(r.readout.h_image, alone.readout.h_image, atol=1e-4,
                                   rtol=1e-4)


def test_features_of_readouts_with_different_image_sizes(actors):
    actor = actors["qwen3_vl"]
    imgs = [random_image(1, 32, 32), random_image(2, 64, 48), random_image(3, 32, 32)]
    res = actor.answer(imgs, ["what shape?"] * 3, max_new_tokens=3)
    counts = {r.readout.h_image.shape[0] for r in res}
    assert len(counts) == 2                                   # the batch mixes sizes
    got = extract_many([r.readout for r in res])
    for b, r in enumerate(res):
        one = extract(r.readout)
        assert got.keys() == one.keys()
        for key, value in one.items():
            row = got[key][b]
            if key == "img_tokens":   # padded to the batch's widest image with NaN rows
                assert row[len(value):].isnan().all(), key
                row = row[:len(value)]
            torch.testing.assert_close(row, value, rtol=0, atol=0, equal_nan=True, msg=key)


def test_digit_distribution_when_a_level_is_not_one_token(actors, monkeypatch):
    """A level whose digit string is several tokens keeps probability 0 and the others are
    renormalised; with every level one token, all eleven are read."""
    actor = actors["qwen3_vl"]
    text = "<answer>red</answer><confidence>"
    ids = actor.tokenizer.encode(text + "7", add_special_tokens=False)
    spans = token_spans(actor.tokenizer, ids)
    lp = torch.log_softmax(torch.randn(len(ids) + 1, len(actor.digit_ids)), -1)
    full = actor._digit_probs(text + "7", spans, None, 0, lp)
    assert full is not None and full.shape == (11,)
    assert full.sum().item() == pytest.approx(1.0)
    monkeypatch.setattr(actor, "digit_ids", [*actor.digit_ids[:10], None])
    monkeypatch.setattr(actor, "known_digits", list(range(10)))
    part = actor._digit_probs(text + "7", spans, None, 0, lp[:, :10])
    assert part.shape == (11,) and part[10].item() == 0.0
    torch.testing.assert_close(part[:10], full[:10] / full[:10].sum())
