"""The defer rule of issue 27: stress suites, the composite detector, honest confidence."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from heads.defer import DeferPolicy, clopper_pearson_upper
from heads.dualread import Heads
from heads.features import TOKEN_SLOTS, token_slots
from heads.novelty import CompositeNovelty, Novelty, load_detector
from heads.suites import kind_of, suite_row, suite_specs
from models.benign import BENIGN_FAMILIES, BENIGN_SPLIT
from models.data import COLOURS, SHAPES, load
from models.render import SUITES, UNSEEN_COLOURS, UNSEEN_SHAPES, render
from models.shift import FAMILIES, corrupt


# ------------------------------------------------------------------ suites as data specs
def test_rendered_items_are_deterministic_and_carry_gold_answers():
    a, b = load("render:colour-dev:6"), load("render:colour-dev:6")
    assert [i.id for i in a] == [i.id for i in b] and len(a) == 18
    assert np.array_equal(np.asarray(a[0].image()), np.asarray(b[0].image()))
    assert a[0].image().size == (64, 64)
    for it in a:
        obj = it.scene.objects[0]
        assert obj.colour in UNSEEN_COLOURS["dev"] and obj.shape in SHAPES
        if it.question in ("what color is the shape?", "what is the color of the shape?"):
            assert it.answer == obj.colour
        if it.question == f"is there a {obj.colour} shape?":
            assert it.answer == "yes"
    other = load("render:colour-dev:6:1")
    assert [i.id for i in other] != [i.id for i in a]


def test_renderer_follows_the_recipe_background_and_size():
    it = load("render:plain:1")[0]
    im = np.asarray(it.image())
    assert im.shape == (64, 64, 3)
    assert (im[0, 0] >= 229).all()                    # pale flat background, 230..255
    assert load("render:size128:1")[0].image().size == (128, 128)
    assert load("render:nosuper:1")[0].image().size == (64, 64)


def test_unseen_shapes_colours_and_multi_object_suites_draw_what_they_say():
    for it in load("render:shape-dev:5"):
        assert it.scene.objects[0].shape in UNSEEN_SHAPES["dev"]
    for it in load("render:three:5"):
        assert len(it.scene.objects) == 3
        assert len({o.shape for o in it.scene.objects}) == 3
    counts = {it.answer for it in load("render:count:30") if it.question.startswith("how many")}
    assert counts <= {"1", "2", "3"} and len(counts) > 1
    assert not set(UNSEEN_COLOURS["dev"]) & set(UNSEEN_COLOURS["heldout"])
    assert not (set(UNSEEN_COLOURS["dev"]) | set(UNSEEN_COLOURS["heldout"])) & set(COLOURS)


def test_position_answers_follow_the_drawing():
    for it in load("render:position:10"):
        a, b = it.scene.objects[:2]
        left = a if a.box[0] + a.box[2] < b.box[0] + b.box[2] else b
        if it.question.startswith(f"is the {left.colour} shape"):
            assert it.answer == "left"


@pytest.mark.parametrize("family", BENIGN_FAMILIES)
def test_benign_families_change_the_picture_and_keep_the_answer(family):
    clean = load("render:plain:1")[0]
    shifted = load(f"render:plain:1~{family}:3")[0]
    assert shifted.answer == clean.answer and shifted.question == clean.question
    assert shifted.id == f"{clean.id}~{family}:3"
    a, b = np.asarray(clean.image(), float), np.asarray(shifted.image(), float)
    assert a.shape != b.shape or np.abs(a - b).mean() > 0
    again = corrupt(clean.image(), family, 3, seed=clean.id)
    assert np.array_equal(np.asarray(again), np.asarray(shifted.image()))


def test_a_white_balance_cast_and_a_bed_edge_are_what_they_say():
    """tint: red up and blue down by the severity's share, green kept (a few percent: the
    colours stay nameable); bed-edge: the picture unchanged, a grey strip on one side."""
    x = np.full((8, 8, 3), 100, np.uint8)
    warm = np.asarray(corrupt(Image.fromarray(x), "tint", 5), float)
    assert warm[0, 0].tolist() == [108.0, 100.0, 92.0]
    im = load("render:plain:1")[0].image()
    edged = np.asarray(corrupt(im, "bed-edge", 1, seed="a"), float)
    w, h = im.size
    assert sorted(edged.shape[:2]) == sorted([h, h + 2]) and edged.shape[:2] != (h, w)
    grey = np.all(edged == 190, axis=-1)
    strip = [grey[:2].all(), grey[-2:].all(), grey[:, :2].all(), grey[:, -2:].all()]
    assert sum(strip) == 1


def test_a_preamble_changes_the_question_only():
    clean, asked = load("render:plain:2"), load("render:plain:2~preamble:1")
    for a, b in zip(clean, asked):
        assert b.question == "Question: " + a.question and b.answer == a.answer
        assert np.array_equal(np.asarray(a.image()), np.asarray(b.image()))


def test_the_split_is_disjoint_and_complete():
    dev, held = suite_specs("dev"), suite_specs("heldout")
    assert dev[0] == held[0] == "easyvqa:test"
    assert not set(dev[1:]) & set(held[1:])
    assert set(BENIGN_SPLIT["dev"]).isdisjoint(BENIGN_SPLIT["heldout"])
    harmful = [s.split("~")[1].split(":")[0] for s in dev + held if kind_of(s) == "harmful"]
    assert set(harmful) == set(FAMILIES)
    kinds = {v["split"] for v in SUITES.values() if v["kind"] == "novel"}
    assert kinds == {"dev", "heldout"}
    assert kind_of("render:colour-heldout:50") == "novel"
    assert kind_of("easyvqa:test~webp:3") == "benign"


def test_suite_row_matches_hand_counts():
    z = np.array([1, 1, 0, 1, 0, 1, 1, 0])
    conf = np.array([.9, .95, .9, .2, .1, .99, .97, .96])
    deferred = np.array([0, 0, 0, 1, 1, 0, 1, 1], bool)
    tau = np.array([0, 0, 0, 1, 1, 0, 0, 0], bool)
    r = suite_row(z, conf, deferred, tau)
    assert r["released"] == 4 / 8 and r["risk_released"] == 1 / 4
    assert r["risk_released_ub95"] == pytest.approx(clopper_pearson_upper(1, 4, 0.05))
    assert r["correct_released"] == 3 / 5 and r["released_tau_only"] == 6 / 8
    assert r["accuracy"] == 5 / 8


# ------------------------------------------------------------------ detectors
def test_token_slots_pad_with_nan_and_subsample_evenly():
    v = torch.arange(10 * 2, dtype=torch.float32).reshape(10, 2)
    s = token_slots(v, 16)
    assert s.shape == (16, 2) and torch.equal(s[:10], v) and s[10:].isnan().all()
    big = torch.arange(200 * 2, dtype=torch.float32).reshape(200, 2)
    t = token_slots(big, TOKEN_SLOTS)
    assert t.shape == (TOKEN_SLOTS, 2) and torch.equal(t[0], big[0]) and torch.equal(t[-1],
                                                                                     big[-1])


def _tokens(n, m, d, seed, shift=0.0, odd=0.0, slots=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, d, generator=g)
    x[:, 0] += odd                       # one unusual token per item
    x += shift
    out = torch.full((n, slots, d), float("nan"))
    out[:, :m] = x
    return out


def test_patch_score_reads_only_real_tokens_and_one_odd_token_is_enough():
    det = Novelty("token_knn", "img_token_slots").fit(_tokens(200, 4, 3, 0))
    det.calibrate(_tokens(199, 4, 3, 1))
    clean = det.p_value(_tokens(300, 4, 3, 2))
    odd = det.p_value(_tokens(50, 4, 3, 3, odd=8.0))
    assert (clean < 0.05).mean() <= 0.1
    assert (odd < 0.05).all()
    # NaN slots change nothing: the same tokens in wider padding score the same
    x = _tokens(5, 4, 3, 4)
    assert np.allclose(det.score(x), det.score(x[:, :4]))


def _composite() -> CompositeNovelty:
    """An image-token part and a question part, each fitted and calibrated."""
    img = Novelty("token_knn", "img_token_slots").fit(_tokens(100, 4, 3, 0))
    img.calibrate(_tokens(99, 4, 3, 1))
    q = Novelty("knn", "h_pre", k=1).fit(torch.randn(100, 5, generator=torch.Generator()
                                                        .manual_seed(5)))
    q.calibrate(torch.randn(99, 5, generator=torch.Generator().manual_seed(6)))
    return CompositeNovelty({"image": img, "question": q})


def test_composite_is_bonferroni_and_extends_its_bank():
    det = _composite()
    feats = {"img_tokens": _tokens(20, 4, 3, 7, shift=6.0),
             "h_pre": torch.randn(20, 5, generator=torch.Generator().manual_seed(8))}
    parts = det.part_p_values(feats)
    want = np.minimum(1, 2 * np.minimum(parts["image"], parts["question"]))
    assert np.allclose(det.p_values(feats), want)
    assert all(r.novel for r in det.read(feats, 0.05))
    # re-certification adds a window's images to the reference: then they are familiar
    det.extend_bank(feats, parts=("image",))
    assert not any(r.novel for r in det.read(feats, 0.05))


def test_composite_takes_a_recertified_streams_reference():
    """Re-certification (heads.recert) wraps the served detector with a second conformal
    reference of its scores: for the composite, p = max(its own combined p, p against the
    stream's scores); its readings' scores map back to the combined p; drift has no clean
    sample of the combined score, so it takes none rather than a part's."""
    from app.recertify import drift_reference
    from heads.recert import SHIPPED, DeferRule

    det = _composite()
    feats = {"img_tokens": _tokens(40, 4, 3, 7, shift=6.0),
             "h_pre": torch.randn(40, 5, generator=torch.Generator().manual_seed(8))}
    read = det.read(feats, 0.05)
    scores = np.array([r.score for r in read])
    assert np.allclose(det.p_values_of(scores), [r.p_value for r in read])
    assert all(r.novel for r in read)
    ext = det.extend_reference(scores[:20])          # the certified window's scores
    later = ext.read({k: v[20:] for k, v in feats.items()}, 0.05)
    assert np.mean([r.novel for r in later]) <= 0.1  # the stream now passes
    assert all(a.p_value >= b.p_value for a, b in zip(later, read[20:]))
    heads = SimpleNamespace(novelty=det, novelty_alpha=0.02)
    assert drift_reference(DeferRule(SHIPPED, {}, None), heads) == {}


def test_composite_saves_and_loads(tmp_path):
    img = Novelty("token_knn", "img_token_slots").fit(_tokens(50, 4, 3, 0))
    img.calibrate(_tokens(49, 4, 3, 1))
    q = Novelty("knn", "h_pre", k=1).fit(torch.randn(50, 5)).calibrate(torch.randn(49, 5))
    det = CompositeNovelty({"image": img, "question": q})
    det.save(tmp_path)
    back = load_detector(tmp_path)
    feats = {"img_tokens": _tokens(6, 4, 3, 9, shift=2.0), "h_pre": torch.randn(6, 5)}
    assert isinstance(back, CompositeNovelty)
    assert np.allclose(back.p_values(feats), det.p_values(feats))


# ------------------------------------------------------------------ honest confidence
def _heads_with(det, alpha=0.05) -> Heads:
    h = Heads.new(4)
    h.policy = DeferPolicy(0.5, 0.05, 0.1, 0.8, 0.02, 0.04, 100, True)
    h.novelty, h.novelty_alpha = det, alpha
    return h


def test_calibrated_is_false_exactly_when_a_detector_flags():
    q = Novelty("knn", "h_pre", k=1).fit(torch.randn(50, 3)).calibrate(torch.randn(49, 3))
    h = _heads_with(q)
    assert h.calibrated(0.5) and not h.calibrated(0.01)
    assert h.calibrated(None)                  # no reading: nothing flags
    assert Heads.new(4).calibrated(0.0)        # no detector at all


def test_answer_response_carries_calibrated(monkeypatch):
    from app.main import create_app
    from app.serving import AnswerResult, NoveltyResult
    from app.settings import Settings
    from tests.test_app import FakeBackend, solid

    class Flagging(FakeBackend):
        def answer_batch(self, items, deadlines):
            out = []
            for r in super().answer_batch(items, deadlines):
                flag = r.answer == "red"
                out.append(AnswerResult(r.answer, r.canonical, r.response, r.confidence,
                                        r.defer or flag, None, r.timings,
                                        novelty=NoveltyResult(3.0, 0.001 if flag else 0.6,
                                                              flag),
                                        calibrated=not flag))
            return out

    with TestClient(create_app(Settings(), Flagging())) as c:
        red = c.post("/answer", json={"question": "what color?", "image": solid((255, 0, 0))})
        blue = c.post("/answer", json={"question": "what color?", "image": solid((0, 0, 255))})
    assert red.status_code == 200 and blue.status_code == 200
    assert red.json()["calibrated"] is False and red.json()["novelty"]["novel"] is True
    assert isinstance(red.json()["confidence"]["dualread"], float)
    assert blue.json()["calibrated"] is True


# ------------------------------------------------------------------ fitting is generic
@pytest.fixture(scope="module")
def embedded():
    from models.loading import load_actor

    return load_actor(None)


def test_detectors_refit_without_two_colours_and_a_shape_flag_them(embedded):
    """Fitted on scenes without red, green and triangles (the recipe's renderer), the
    composite detector (image, question, pixel and layout parts) flags scenes showing them
    far more often than held-out scenes of the colours and shapes it was fitted on."""
    from heads.detectors import fit_detectors
    from heads.features import extract_many
    from heads.layout_novelty import layout_descriptors
    from heads.pixel_novelty import pixel_descriptors
    from models.render import Scene, _background, _place

    actor = embedded
    kept_c = tuple(c for c in COLOURS if c not in ("red", "green"))
    kept_s = tuple(s for s in SHAPES if s != "triangle")

    def scenes(n, seed, colours, shapes):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            c, s = colours[rng.integers(len(colours))], shapes[rng.integers(len(shapes))]
            out.append(render(Scene(_place(rng, [s], [c]), _background(rng))))
        return out

    def feats(images: list[Image.Image]):
        res = actor.answer(images, ["what color is the shape?"] * len(images), 2)
        return extract_many([r.readout for r in res])

    fit_im, cal_im = scenes(120, 0, kept_c, kept_s), scenes(99, 1, kept_c, kept_s)
    fit, cal = feats(fit_im), feats(cal_im)
    det = fit_detectors(fit, None, cal, cal, pixels=(pixel_descriptors(fit_im),
                                                     pixel_descriptors(cal_im)),
                        pixel_bank=2000,
                        layout=(layout_descriptors(fit_im), layout_descriptors(cal_im)))
    seen_im = scenes(40, 2, kept_c, kept_s)
    unseen_im = scenes(40, 3, ("red", "green"), ("triangle",))
    seen = det.parts["image"].p_value(feats(seen_im)["img_tokens"])
    unseen = det.parts["image"].p_value(feats(unseen_im)["img_tokens"])
    assert (unseen < 0.05).mean() >= (seen < 0.05).mean() + 0.3
    # the pixel part, on the same refit: each held-out colour and the held-out shape alone
    px = det.parts["pixels"]
    seen_px = px.p_value(pixel_descriptors(seen_im))
    for colours, shapes in ((("red",), kept_s), (("green",), kept_s), (kept_c, ("triangle",))):
        novel = px.p_value(pixel_descriptors(scenes(30, 4, colours, shapes)))
        assert (novel < 0.05).mean() >= (seen_px < 0.05).mean() + 0.3, (colours, shapes)
    # the layout part, likewise (heads.layout_novelty)
    lay = det.parts["layout"]
    seen_lay = lay.p_value(layout_descriptors(seen_im))
    for colours, shapes in ((("red",), kept_s), (("green",), kept_s), (kept_c, ("triangle",))):
        novel = lay.p_value(layout_descriptors(scenes(30, 4, colours, shapes)))
        assert (novel < 0.05).mean() >= (seen_lay < 0.05).mean() + 0.5, (colours, shapes)


def test_pooled_rows_add_up_counts():
    from heads.suites import pool_by_kind

    a = suite_row(np.array([1, 0, 1, 1]), np.ones(4), np.array([0, 0, 1, 1], bool),
                  np.zeros(4, bool))
    b = suite_row(np.array([1, 1]), np.ones(2), np.array([0, 0], bool), np.zeros(2, bool))
    pooled = pool_by_kind({"easyvqa:test~webp:1": a, "easyvqa:test~gamma:3": b})["benign"]
    assert pooled["n"] == 6 and pooled["released"] == 4 / 6
    assert pooled["risk_released"] == 1 / 4
    assert pooled["risk_released_ub95"] == pytest.approx(clopper_pearson_upper(1, 4, 0.05))
