"""The fresh held-out render families (docs/defer/suites.md): unseen shapes and four-object
scenes, drawn as they say, with gold answers."""

import numpy as np

from models.data import COLOURS, SHAPES, load
from models.render import SUITES, UNSEEN_SHAPES, Obj, Scene, multi_questions, render


def test_fresh_families_are_held_out_novel_and_new():
    for kind in ("shape-fresh", "four"):
        assert SUITES[kind]["split"] == "heldout" and SUITES[kind]["kind"] == "novel"
    fresh = set(UNSEEN_SHAPES["fresh"])
    assert not fresh & (set(SHAPES) | set(UNSEEN_SHAPES["dev"]) | set(UNSEEN_SHAPES["heldout"]))


def test_fresh_shapes_are_drawn_and_asked_about():
    items = load("render:shape-fresh:12")
    assert len(items) == 36
    seen = set()
    for it in items:
        obj = it.scene.objects[0]
        assert obj.shape in UNSEEN_SHAPES["fresh"] and obj.colour in COLOURS
        seen.add(obj.shape)
        if it.question in ("what shape is in the image?", "what shape is present?"):
            assert it.answer == obj.shape
        if it.question == f"is there a {obj.shape}?":
            assert it.answer == "yes"
    assert seen == set(UNSEEN_SHAPES["fresh"])


def test_each_fresh_shape_covers_what_its_outline_says():
    bg = (240, 240, 240)

    def fg(shape):
        im = np.asarray(render(Scene((Obj(shape, "black", (24, 24, 104, 104)),), bg)))
        return im.max(-1) < 120                       # black pixels

    ring, diamond, hexagon = fg("ring"), fg("diamond"), fg("hexagon")
    assert not ring[32, 32] and ring[32, 13]          # a hole in the middle, a rim around
    assert diamond[32, 32] and not diamond[14, 14]    # corners of its box are empty
    assert hexagon[32, 32] and hexagon[32, 14] and not hexagon[13, 20]
    # areas of the same radius r: hexagon 3√3/2·r² ≈ 2.6 r², diamond 2 r²
    assert 1.2 * diamond.sum() < hexagon.sum() < 1.4 * diamond.sum()


def test_four_object_scenes_ask_only_questions_with_one_answer():
    items = load("render:four:20")
    for it in items:
        objs = it.scene.objects
        assert len(objs) == 4 and len({o.colour for o in objs}) == 4
        assert {o.shape for o in objs} <= set(SHAPES)
        for q, a in multi_questions(objs):
            if q.startswith("what color is the "):
                shape = q.removeprefix("what color is the ").rstrip("?")
                assert [o.shape for o in objs].count(shape) == 1
                assert a == next(o.colour for o in objs if o.shape == shape)
    assert any(len({o.shape for o in it.scene.objects}) < 4 for it in items)


def test_existing_multi_object_suites_are_unchanged_by_the_fresh_kinds():
    # distinct shapes: one colour question and one shape question per object, as before
    objs = load("render:two:1")[0].scene.objects
    qs = multi_questions(objs)
    assert qs[:4] == [(f"what color is the {objs[0].shape}?", objs[0].colour),
                      (f"what is the {objs[0].colour} shape?", objs[0].shape),
                      (f"what color is the {objs[1].shape}?", objs[1].colour),
                      (f"what is the {objs[1].colour} shape?", objs[1].shape)]
