"""A large image scored under many trajectories is prepared once, with the same pixels the
processor computes itself (`models.actor.prepared_images`)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from PIL import Image
from transformers.image_utils import SizeDict

from models.actor import prepared_images, processor_size


def _rand(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _pixels(ip, images: list[Image.Image]) -> dict:
    return ip(images=images, return_tensors="pt")


def _wide_range(qwen3):
    """The tiny test processor with a range of sizes (its own min = max), like a real one."""
    ip = copy.deepcopy(qwen3.processor.image_processor)
    ip.size = SizeDict(shortest_edge=256, longest_edge=4096)
    return ip


def test_shrunk_once_with_the_processors_own_pixels(qwen3):
    ip = _wide_range(qwen3)
    big = _rand(700, 900)
    hw = processor_size(ip, 700, 900)
    assert hw is not None and hw[0] * hw[1] < 700 * 900          # the processor shrinks it
    ready = prepared_images([big, big, big], ip)
    assert ready[0] is ready[1] is ready[2]                        # made once
    assert ready[0].size == (hw[1], hw[0])
    direct, mine = _pixels(ip, [big.convert("RGB")]), _pixels(ip, ready[:1])
    assert direct.keys() == mine.keys()
    for k in direct:
        assert torch.equal(direct[k], mine[k]), k


def test_the_embedded_actors_processor_gets_the_same_pixels():
    from models.loading import load_actor

    ip = load_actor().processor.image_processor
    for h, w in ((1024, 1024), (300, 700), (4000, 20)):
        im = _rand(h, w, seed=h)
        direct = _pixels(ip, [im])
        mine = _pixels(ip, prepared_images([im], ip))
        assert all(torch.equal(direct[k], mine[k]) for k in direct), (h, w)


def test_images_the_processor_would_not_shrink_or_would_resize_again_are_left_as_they_are(
        qwen3):
    ip = _wide_range(qwen3)
    small = _rand(8, 8)                                            # grown, never shrunk here
    assert prepared_images([small], ip)[0].size == (8, 8)
    same = qwen3.processor.image_processor      # min = max: its size rule is not idempotent
    hw = processor_size(same, 700, 900)
    assert hw is not None and processor_size(same, *hw) != hw
    assert prepared_images([_rand(700, 900)], same)[0].size == (900, 700)
    for im, p in ((small, ip), (_rand(700, 900), same)):
        direct = _pixels(p, [im.convert("RGB")])
        mine = _pixels(p, prepared_images([im], p))
        assert all(torch.equal(direct[k], mine[k]) for k in direct)


def test_without_a_smart_resize_processor_images_are_only_made_rgb():
    grey = Image.new("L", (300, 200), 7)
    out = prepared_images([grey, grey], object())
    assert out[0] is out[1] and out[0].mode == "RGB" and out[0].size == (300, 200)
    assert processor_size(object(), 300, 200) is None


def test_a_size_the_processors_rule_refuses_after_rounding_is_left_to_the_processor(qwen3):
    ip = copy.deepcopy(qwen3.processor.image_processor)
    ip.size = SizeDict(shortest_edge=3136, longest_edge=1003520)   # a stock Qwen budget
    thin = _rand(80, 12800)                                         # aspect 160 < 200
    ready = prepared_images([thin], ip)                             # no ValueError
    direct, mine = _pixels(ip, [thin]), _pixels(ip, ready)
    assert all(torch.equal(direct[k], mine[k]) for k in direct)


def test_only_the_pil_processors_are_shrunk_ahead(qwen3):
    ip = _wide_range(qwen3)
    assert processor_size(ip, 700, 900) is not None
    fast = copy.copy(ip)
    fast.__class__ = type("Qwen2VLImageProcessorFast", (type(ip),),
                          {"__module__": type(ip).__module__})     # resamples otherwise
    assert processor_size(fast, 700, 900) is None
    assert prepared_images([_rand(700, 900)], fast)[0].size == (900, 700)
