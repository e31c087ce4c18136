"""The shift suite: every corruption family, severity order, determinism, the spec suffix."""

import json

import numpy as np
import pytest
from PIL import Image, ImageDraw

from models.data import load
from models.shift import FAMILIES, PARAMS, SEVERITIES, corrupt, grid, shift_items, split_spec


def shape_image(colour=(200, 30, 30), bg=(235, 240, 250), size=64) -> Image.Image:
    """easy-VQA-like: one saturated shape on a pale flat background."""
    im = Image.new("RGB", (size, size), bg)
    ImageDraw.Draw(im).ellipse((14, 18, 44, 48), fill=colour)
    return im


def arr(im: Image.Image) -> np.ndarray:
    return np.asarray(im, np.float64)


def mad(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(arr(a) - arr(b)).mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_changes_the_image_and_grows_with_severity(family):
    clean = shape_image()
    diffs = [mad(corrupt(clean, family, s, seed="q1"), clean) for s in SEVERITIES]
    assert diffs[0] > 0, f"{family} at severity 1 left the image unchanged"
    assert all(a < b for a, b in zip(diffs, diffs[1:])), (family, diffs)


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_and_keeps_size(family):
    clean = shape_image()
    a = corrupt(clean, family, 3, seed="item-7")
    b = corrupt(shape_image(), family, 3, seed="item-7")
    assert a.size == clean.size and a.mode == "RGB"
    assert np.array_equal(arr(a), arr(b))


def test_seed_changes_the_random_draw():
    clean = shape_image()
    for family in ("noise", "background", "occlusion"):
        a, b = corrupt(clean, family, 4, seed="a"), corrupt(clean, family, 4, seed="b")
        assert not np.array_equal(arr(a), arr(b)), family


def test_contrast_and_brightness_match_hand_formulas():
    clean = shape_image()
    x = arr(clean) / 255
    want = np.clip(((x - x.mean()) * 0.05 + x.mean()) * 255 + 0.5, 0, 255).astype(np.uint8)
    assert np.abs(arr(corrupt(clean, "contrast", 5)) - want).max() <= 1
    want = (x * 0.22 * 255 + 0.5).astype(np.uint8)
    assert np.abs(arr(corrupt(clean, "brightness", 5)) - want).max() <= 1


def test_noise_level_is_the_stated_sigma():
    gray = Image.new("RGB", (64, 64), (128, 128, 128))   # mid-gray: no clipping at σ = .08
    d = (arr(corrupt(gray, "noise", 1, seed=3)) - 128) / 255
    assert abs(d.std() - 0.08) < 0.004 and abs(d.mean()) < 0.004


def test_resolution_leaves_at_most_the_downsampled_grid():
    clean = shape_image()
    out = arr(corrupt(clean, "resolution", 5))
    side = round(64 * 0.12)
    assert np.unique(out, axis=0).shape[0] <= side and np.unique(out, axis=1).shape[1] <= side


def test_background_keeps_the_shape_and_occlusion_covers_its_share():
    clean = shape_image()
    out = arr(corrupt(clean, "background", 5, seed=1))
    shape = np.all(arr(clean) == (200, 30, 30), -1)
    assert np.array_equal(out[shape], arr(clean)[shape])
    assert (np.abs(out - arr(clean)).sum(-1) > 0)[~shape].mean() > 0.9
    changed = [np.abs(arr(corrupt(clean, "occlusion", s, seed=2)) - arr(clean)).sum(-1) > 0
               for s in (3, 5)]
    # share reached (a patch may match the image somewhere: allow a little slack)
    assert changed[1].mean() >= PARAMS["occlusion"][4] - 0.02
    # nested draws: what severity 3 covers, severity 5 covers too
    assert not (changed[0] & ~changed[1]).any()


def _jsonl(tmp_path, n=3):
    for k in range(n):
        shape_image(colour=(30 * k, 90, 200)).save(tmp_path / f"{k}.png")
    rows = [{"id": f"q{k}", "image": f"{k}.png", "question": "what colour?", "answer": "blue"}
            for k in range(n)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f"jsonl:{tmp_path / 'd.jsonl'}"


def test_spec_suffix_loads_corrupted_items(tmp_path):
    spec = _jsonl(tmp_path)
    clean = load(spec)
    shifted = load(spec + "~blur:3")
    assert [s.id for s in shifted] == [f"q{k}~blur:3" for k in range(3)]
    assert [s.image_id for s in shifted] == [c.image_id for c in clean]
    assert [s.answer for s in shifted] == [c.answer for c in clean]
    assert mad(shifted[0].image(), clean[0].image()) > 0
    assert np.array_equal(arr(shifted[0].image()),
                          arr(corrupt(clean[0].image(), "blur", 3, seed="q0")))
    every = load(spec + "~all:2")
    assert len(every) == len(FAMILIES) * 3
    assert {s.id.split("~")[1] for s in every} == {f"{f}:2" for f in FAMILIES}


def test_rotate_is_addressable_but_outside_the_suite(tmp_path):
    """A geometry shift: a spec suffix like the others, never in `~all` (nor in the
    novelty detector's pool, which walks FAMILIES)."""
    assert "rotate" not in FAMILIES and "rotate" in PARAMS
    spec = _jsonl(tmp_path)
    clean = load(spec)[0].image()
    turned = load(spec + "~rotate:4")[0].image()                  # 90°
    a = np.asarray(clean.convert("RGB"))
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]]).astype(float) / 255
    fill = tuple(int(v) for v in np.clip(np.median(border, 0) * 255 + 0.5, 0, 255))
    want = clean.convert("RGB").rotate(90, resample=Image.BILINEAR, fillcolor=fill)
    assert np.array_equal(arr(turned), arr(want))
    assert {s.id.split("~")[1] for s in load(spec + "~all:4")} == {f"{f}:4" for f in FAMILIES}


@pytest.mark.parametrize("suffix, message", [
    ("~blurr:3", "unknown family 'blurr'"), ("~blur", "severity must be 1-5"),
    ("~blur:0", "severity must be 1-5"), ("~blur:6", "severity must be 1-5"),
    ("~blur:x", "severity must be 1-5"), ("~blur:2~noise:1", "one shift suffix per spec"),
])
def test_bad_suffix_is_a_clear_error(tmp_path, suffix, message):
    with pytest.raises(ValueError, match=message):
        load(_jsonl(tmp_path, 1) + suffix)


def test_split_spec_and_grid():
    assert split_spec("easyvqa:test~jpeg:5") == ("easyvqa:test", ("jpeg", 5))
    assert split_spec("easyvqa:test") == ("easyvqa:test", None)
    assert split_spec("jsonl:~/data/d.jsonl") == ("jsonl:~/data/d.jsonl", None)
    specs = grid("easyvqa:test", ("noise", "blur"), (1, 5))
    assert specs == ["easyvqa:test", "easyvqa:test~noise:1", "easyvqa:test~noise:5",
                     "easyvqa:test~blur:1", "easyvqa:test~blur:5"]
    with pytest.raises(ValueError, match="unknown corruption family"):
        grid("easyvqa:test", ("fog",))


def test_a_shifted_item_is_not_shifted_twice(tmp_path):
    (item,) = shift_items(load(_jsonl(tmp_path, 1)), "noise", 1)
    with pytest.raises(ValueError, match="one corruption per item"):
        shift_items([item], "blur", 1)
