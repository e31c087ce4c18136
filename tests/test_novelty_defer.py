"""The novelty detector as part of the defer rule (docs/method.md §8): fitting stage, artefact,
decision, and `/answer`'s `novelty` field."""

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from scipy.stats import binom
from sklearn.linear_model import LogisticRegression
from typer.testing import CliRunner

from app.main import create_app
from app.service import Service
from app.settings import Settings
from heads.collect import Collector
from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.features import extract
from heads.fit import fit_heads, fit_novelty, novelty_items, splits_of
from heads.novelty import Novelty, features, p_values
from heads.pixel_novelty import with_pixels
from models.data import Item, load
from models.shift import FAMILIES
from tests.conftest import random_image
from tests.helpers import b64, png_bytes, random_heads, stub_answers

Q = "what color is the shape?"
TRAJ = "<think>I see a red circle.</think><answer>red</answer><confidence>9</confidence>"
# the rule and reason as the brief states them, typed out here rather than imported
RULE_NOVELTY = ("defer if DualRead < tau or novelty p-value < alpha or the response does "
                "not parse")
RULE_OLD = "defer if DualRead < tau or the response does not parse"
REASON = "image unlike the fitting data (novelty p < 0.01)"


def feats(n: int, d: int, seed: int, shift: float = 0.0) -> dict[str, torch.Tensor]:
    """Feature dicts with `extract`'s novelty keys; `shift` moves the image-state mean."""
    g = torch.Generator().manual_seed(seed)
    f = {k: torch.randn(n, d, generator=g) for k in ("h_pre", "img_mean", "img_std")}
    f["img_mean"] = f["img_mean"] + shift
    return f


# ------------------------------------------------------------------ fitting stage
def test_corrupted_copies_cover_every_family_with_severities_in_turn():
    items = [Item(id=f"i{k}", question=Q, answer="red", image_path="x.png",
                  image_id=f"img{k}") for k in range(7)]
    few = novelty_items(items, per_family=5)
    assert len(few) == 8 * 5
    by_family = {f: [it for it in few if it.family == f] for f in FAMILIES}
    for fam, got in by_family.items():
        assert [it.severity for it in got] == [1, 2, 3, 4, 5], fam
        assert all(it.id == f"{it.source_id}~{fam}:{it.severity}" for it in got)
    every = novelty_items(items, per_family=10)           # fewer items than asked: all
    assert len(every) == 8 * 7
    assert [it.severity for it in every if it.family == "blur"] == [1, 2, 3, 4, 5, 1, 2]
    assert {it.image_id for it in every} == {it.image_id for it in items}


def test_fitted_detector_flags_a_shifted_input_and_not_a_clean_one():
    d = 4
    nov = fit_novelty(feats(300, d, 0), feats(300, d, 1, shift=3.0), feats(199, d, 2))
    # independent fit: sklearn on the same standardised [h_pre; img_mean; img_std]
    x = np.concatenate([torch.cat([f["h_pre"], f["img_mean"], f["img_std"]], 1).double()
                        .numpy() for f in (feats(300, d, 0), feats(300, d, 1, shift=3.0))])
    clean = x[:300]
    z = (x - clean.mean(0)) / clean.std(0, ddof=1)
    lr = LogisticRegression(C=0.1, max_iter=5000).fit(z, np.r_[np.zeros(300), np.ones(300)])
    assert np.allclose(nov.t["coef"].numpy(), lr.coef_[0], rtol=1e-3, atol=1e-4)
    far = feats(5, d, 3, shift=8.0)
    centre = {k: torch.zeros(1, d) for k in ("h_pre", "img_mean")}
    centre["img_std"] = torch.zeros(1, d)
    got_far = nov.read(far)
    assert all(r.novel and r.p_value == pytest.approx(1 / 200) for r in got_far)
    [got_centre] = nov.read(centre)
    assert not got_centre.novel and got_centre.p_value > 0.2


@pytest.mark.parametrize(("alpha", "exact"), [(0.01, 1 / 200), (0.05, 9 / 200)])
def test_clean_flag_rate_is_at_most_alpha(alpha, exact):
    """Simulated, no actor: R independent (calibration of 199, one fresh clean input) draws
    against one fitted detector. With n = 199, p < α happens exactly when the input's score
    beats all but ⌈α·200⌉ − 1 calibration scores: probability 1/200 (α = 0.01), 9/200
    (α = 0.05) for exchangeable inputs."""
    d, n, reps = 3, 199, 4000
    nov = fit_novelty(feats(200, d, 0), feats(200, d, 1, shift=2.0), feats(n, d, 2))
    pool = feats(reps * (n + 1), d, 5)
    s = nov.score(torch.cat([pool["h_pre"], pool["img_mean"], pool["img_std"]], 1))
    s = s.reshape(reps, n + 1)
    p = np.array([p_values(row[:n], row[n:])[0] for row in s])
    flagged = int((p < alpha).sum())
    assert flagged <= binom.ppf(0.999, reps, alpha), (flagged, reps)
    # and not vacuous (p-values that are always 1 would pass the line above)
    assert flagged >= binom.ppf(0.001, reps, exact), (flagged, reps)


def test_extract_gives_the_image_state_mean_and_std(qwen3):
    ro = qwen3.score([random_image(1)], [Q], [TRAJ], cue=False)[0].readout
    f = extract(ro)
    h = ro.h_image.double().numpy()
    assert np.allclose(f["img_mean"].numpy(), h.mean(0), atol=1e-5)
    assert np.allclose(f["img_std"].numpy(), h.std(0, ddof=1), atol=1e-5)


# ------------------------------------------------------------------ the decision
def _policy(tau: float) -> DeferPolicy:
    return DeferPolicy(tau=tau, target_risk=0.05, delta=0.1, coverage=0.5, empirical_risk=0.0,
                       risk_upper_bound=0.05, n_calibration=100, feasible=True)


def test_the_defer_rule():
    heads = Heads(dim=2, policy=_policy(0.5))
    heads.novelty = fit_novelty(feats(50, 2, 0), feats(50, 2, 1, shift=3.0), feats(99, 2, 2))
    assert heads.decide(0.9, 0.001) == (True, REASON)          # novelty alone defers
    assert heads.decide(0.9, 0.5) == (False, None)             # both fine
    assert heads.decide(0.9, 0.01) == (False, None)            # p = α is not below α
    assert heads.decide(0.3, 0.5) == (True, None)              # τ alone: no reason
    assert heads.decide(0.9, 0.5, "truncated") == (True, "truncated")
    assert heads.decide(0.3, 0.001, "truncated") == (True, "truncated; " + REASON)
    assert heads.defer_rule == RULE_NOVELTY
    plain = Heads(dim=2, policy=_policy(0.5))                  # no detector: the old rule
    assert plain.decide(0.9, 0.001) == (False, None) and plain.defer_rule == RULE_OLD


# ------------------------------------------------------------------ artefact and service
def _detector(dim: int, flag_everything: bool) -> Novelty:
    """A logistic detector on the actor's feature size whose calibration scores lie below
    (flag everything: p = 1/200) or above (p = 1) any score a real input can get."""
    nov = fit_novelty(feats(60, dim, 0), feats(60, dim, 1, shift=3.0), feats(199, dim, 2))
    nov.t["calibration"] = torch.full((199,), -1e9 if flag_everything else 1e9,
                                      dtype=torch.float64)
    return nov


@pytest.fixture(scope="module")
def qwen_heads(actors, tmp_path_factory):
    return random_heads(tmp_path_factory.mktemp("plain-heads"), actors["qwen3_vl"])


def _with_detector(folder: str, target, flag_everything: bool) -> Heads:
    heads = Heads.load(folder)
    heads.novelty = _detector(heads.dim, flag_everything)
    heads.policy = _policy(0.0)            # DualRead is never below τ: novelty alone decides
    heads.save(target, {k: v for k, v in heads.card.items() if k != "novelty"})
    return heads


def _scripted(service: Service, monkeypatch) -> Service:
    """The service's actor answers TRAJ, finished: the parse check cannot be why it defers."""
    stub_answers(monkeypatch, service, TRAJ)
    return service


def _served(actor_dir: str, heads_dir, monkeypatch, image=None) -> dict:
    service = _scripted(Service(actor_dir, str(heads_dir)), monkeypatch)
    monkeypatch.setattr(service, "needs_tag", True)
    with TestClient(create_app(Settings(max_new_tokens=8, batch_wait_ms=1), service)) as c:
        im = random_image(0) if image is None else image
        r = c.post("/answer", json={"image": b64(png_bytes(im)), "question": Q})
    assert r.status_code == 200, r.text
    return r.json()


def test_answer_reads_the_pixels_when_the_detector_has_a_pixel_part(actor_dirs, qwen_heads,
                                                                    tmp_path, monkeypatch):
    """/answer hands each item's decoded image to the detector's pixel part: fitted on flat
    pale images, it flags a noise image and keeps one of the fitted colours."""
    from PIL import Image

    from heads.novelty import CompositeNovelty
    from heads.pixel_novelty import PixelNovelty, pixel_descriptors

    heads = Heads.load(qwen_heads)
    flat = [Image.new("RGB", (40, 32), (200 + k, 200, 200)) for k in range(10)]
    px = PixelNovelty(max_bank=500).fit(pixel_descriptors(flat))
    # flat images score 0 but for float rounding
    px.t["calibration"] = torch.full((399,), 0.01, dtype=torch.float64)
    heads.novelty = CompositeNovelty({"question": _detector(heads.dim, False), "pixels": px})
    heads.novelty_alpha, heads.policy = 0.02, _policy(0.0)      # novelty alone decides
    heads.save(tmp_path / "h", {k: v for k, v in heads.card.items() if k != "novelty"})
    noisy = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch)
    assert noisy["novelty"]["novel"] is True and noisy["defer"] is True
    assert noisy["novelty"]["p_value"] == pytest.approx(2 / 400)
    calm = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch,
                   Image.new("RGB", (40, 32), (205, 200, 200)))
    assert calm["novelty"]["novel"] is False and calm["defer"] is False


def test_a_batch_reads_each_item_with_its_own_image(actor_dirs, qwen_heads, tmp_path,
                                                   monkeypatch):
    """In one batch the pixel part reads item k's image for item k: a noise image and a
    fitted flat one, in both orders, are flagged where the noise image sits."""
    import time

    from PIL import Image

    from app.serving import AnswerItem
    from heads.novelty import CompositeNovelty
    from heads.pixel_novelty import PixelNovelty, pixel_descriptors

    heads = Heads.load(qwen_heads)
    flat = [Image.new("RGB", (40, 32), (200 + k, 200, 200)) for k in range(10)]
    px = PixelNovelty(max_bank=500).fit(pixel_descriptors(flat))
    px.t["calibration"] = torch.full((399,), 0.01, dtype=torch.float64)
    heads.novelty = CompositeNovelty({"question": _detector(heads.dim, False), "pixels": px})
    heads.novelty_alpha, heads.policy = 0.02, _policy(0.0)
    heads.save(tmp_path / "h", {k: v for k, v in heads.card.items() if k != "novelty"})
    service = _scripted(Service(actor_dirs["qwen3_vl"], str(tmp_path / "h")), monkeypatch)
    noisy, calm = random_image(0), Image.new("RGB", (40, 32), (205, 200, 200))
    for images, want in (([noisy, calm], [True, False]), ([calm, noisy], [False, True])):
        items = [AnswerItem(im, Q, 8) for im in images]
        out = service.answer_batch(items, [time.monotonic() + 60] * 2)
        assert [r.novelty.novel for r in out] == want
        assert [r.defer for r in out] == want


def test_answer_reads_the_layout_when_the_detector_has_a_layout_part(actor_dirs, qwen_heads,
                                                                     tmp_path, monkeypatch):
    """/answer hands the decoded image to the layout part (heads/layout_novelty.py) and
    defers by `Heads.defer_reasons`, the rule `evaluate` applies: fitted on one-object
    scenes, the part flags a two-object scene (p = 1/400, Bonferroni over two parts: 2/400)
    and keeps a one-object one (p = 1)."""
    from heads.layout_novelty import LayoutNovelty, layout_descriptors
    from heads.novelty import CompositeNovelty
    from models.render import Obj, Scene, render

    def scene(*objs):
        return render(Scene(tuple(objs), (240, 240, 240)))

    one = [scene(Obj(s, c, (20 + 4 * k, 30, 70 + 4 * k, 80))) for k, (s, c) in
           enumerate([("circle", "red"), ("rectangle", "blue"), ("triangle", "teal")] * 3)]
    part = LayoutNovelty().fit(layout_descriptors(one))
    # calibration scores above any one-object scene's, below a second object's distance
    part.t["calibration"] = torch.full((399,), 0.5, dtype=torch.float64)
    heads = Heads.load(qwen_heads)
    heads.novelty = CompositeNovelty({"question": _detector(heads.dim, False), "layout": part})
    heads.novelty_alpha, heads.policy = 0.02, _policy(0.0)      # novelty alone decides
    heads.save(tmp_path / "h", {k: v for k, v in heads.card.items() if k != "novelty"})
    two = scene(Obj("circle", "red", (10, 10, 50, 50)), Obj("rectangle", "blue",
                                                            (70, 70, 110, 100)))
    body = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch, two)
    assert body["novelty"]["novel"] is True and body["defer"] is True
    assert body["novelty"]["p_value"] == pytest.approx(2 / 400)
    calm = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch,
                   scene(Obj("circle", "red", (30, 34, 80, 84))))
    assert calm["novelty"]["novel"] is False and calm["defer"] is False
    assert calm["novelty"]["p_value"] == pytest.approx(1.0)


@pytest.mark.parametrize("flag_everything", [True, False])
def test_answer_defers_on_novelty_alone(actor_dirs, qwen_heads, tmp_path, monkeypatch,
                                        flag_everything):
    _with_detector(qwen_heads, tmp_path / "h", flag_everything)
    body = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch)
    assert body["defer_threshold"] == 0.0
    assert set(body["novelty"]) == {"score", "p_value", "novel"}
    if flag_everything:
        assert body["novelty"]["p_value"] == pytest.approx(1 / 200)
        assert body["novelty"]["novel"] is True
        assert body["defer"] is True and body["defer_reason"] == REASON
    else:
        assert body["novelty"]["p_value"] == pytest.approx(1.0)
        assert body["novelty"]["novel"] is False
        assert body["defer"] is False and body["defer_reason"] is None


def test_save_load_gives_the_same_p_values(actors, qwen_heads, tmp_path):
    actor = actors["qwen3_vl"]
    heads = _with_detector(qwen_heads, tmp_path / "h", flag_everything=False)
    # a real calibration again: clean draws of the fitting distribution
    heads.novelty.calibrate(features("pre_img_mean_std", feats(99, heads.dim, 7)))
    heads.save(tmp_path / "h", {k: v for k, v in heads.card.items() if k != "novelty"})
    back = Heads.load(tmp_path / "h", actor.fingerprint)
    assert back.novelty is not None and back.card["defer_rule"] == RULE_NOVELTY
    assert back.card["novelty"]["n_calibration"] == 99 and back.card["novelty"]["alpha"] == 0.01
    imgs = [random_image(k) for k in range(3)]
    res = actor.score(imgs, [Q] * 3, [TRAJ] * 3, cue=False)
    cal = np.sort(heads.novelty.t["calibration"].numpy())
    batched = back.assess([r.readout for r in res])      # the service's one batched call
    for r, got in zip(res, batched):
        a, b = heads.novelty_of(r.readout), back.novelty_of(r.readout)
        assert (a.score, a.p_value) == (b.score, b.p_value)
        assert got.novelty.score == pytest.approx(b.score, rel=1e-6, abs=1e-9)
        assert (got.novelty.p_value, got.novelty.novel) == (b.p_value, b.novel)
        alone = back.confidence(r.readout)
        assert got.confidence == pytest.approx(alone, abs=1e-6)
        # independently: standardised [h_pre; mean; std of image states] · coef + intercept
        ro = r.readout
        v = torch.cat([ro.h_pre, ro.h_image.mean(0), ro.h_image.std(0)]).double().numpy()
        t = {k: x.numpy() for k, x in back.novelty.t.items()}
        s = ((v - t["mean"]) / t["scale"]) @ t["coef"] + t["intercept"][0]
        assert b.score == pytest.approx(s, rel=1e-6, abs=1e-9)
        assert b.p_value == pytest.approx((1 + (cal >= b.score).sum()) / 100)


def test_an_artefact_without_novelty_loads_and_serves_null(actor_dirs, qwen_heads, tmp_path,
                                                           monkeypatch):
    card_path = tmp_path / "h" / "heads_card.json"
    Heads.load(qwen_heads).save(tmp_path / "h", {"command": "older artefact"})
    card = json.loads(card_path.read_text())
    assert card["novelty"] is None and card["defer_rule"] == RULE_OLD
    # written before the detector existed: neither key at all
    for key in ("novelty", "defer_rule"):
        card.pop(key)
    card_path.write_text(json.dumps(card))
    loaded = Heads.load(tmp_path / "h")
    assert loaded.novelty is None
    assert loaded.decide(0.99, 0.0) == (loaded.defer(0.99), None)   # p ignored without one
    body = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch)
    assert body["novelty"] is None
    assert body["defer_reason"] is None


def test_the_shipped_heads_carry_a_detector_in_their_rule():
    heads = Heads.load()
    assert heads.novelty is not None
    assert heads.card["novelty"]["alpha"] == heads.novelty_alpha
    assert "novelty p-value < alpha" in heads.card["defer_rule"]
    assert heads.defer_rule == heads.card["defer_rule"]


# ------------------------------------------------------------------ end to end
def test_fit_with_novelty_writes_the_detector_and_the_card(actors, own_or_wrong_data, tmp_path):
    """`fit-heads` fits the composite detector (heads.detectors): image tokens of reader
    images and benign re-encodings, prompt states of reader questions, each calibrated on
    the temperature and defer splits."""
    from heads.detectors import AUGMENT_FAMILIES, first_per_image

    actor, per_family = actors["gemma3"], 3
    items = load(own_or_wrong_data)
    heads, info = fit_heads(actor, items, cache_dir=tmp_path / "cache", max_new_tokens=4,
                            target_risk=0.3, novelty_per_family=per_family)
    assert not hasattr(heads, "image_check")               # retired (issue 27)
    heads.save(tmp_path / "heads", {"command": "test", **info})
    folder = tmp_path / "heads"
    for part in ("image", "question", "pixels", "layout"):
        assert (folder / f"novelty.{part}.safetensors").exists()
    card = json.loads((folder / "heads_card.json").read_text())
    nov = card["novelty"]
    assert card["defer_rule"] == RULE_NOVELTY and "image_check" not in card
    assert (nov["kind"], nov["alpha"]) == ("composite", 0.02)
    col = Collector(actor, tmp_path / "cache", 4)
    clean, meta = col.run(items)
    sp = splits_of(meta)
    ids = meta["image_ids"]
    reader_img = first_per_image(sp["reader"], ids)
    cal = torch.cat([sp["temperature"], sp["defer"]])
    parts = nov["parts"]
    assert parts["image"]["n_images"] == len(reader_img)
    assert parts["image"]["n_augmented"] == len(AUGMENT_FAMILIES) * min(per_family,
                                                                         len(reader_img))
    assert parts["image"]["n_calibration"] == len(first_per_image(cal, ids))
    assert parts["question"]["n_calibration"] == len(cal)
    back = Heads.load(folder, actor.fingerprint)
    q = back.novelty.parts["question"]
    # the question part: 1-NN distance to the standardised reader prompt states
    x = clean["h_pre"][sp["reader"]].double()
    z = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    assert torch.allclose(q.t["bank"], z, atol=1e-6)
    s_cal = torch.cdist((clean["h_pre"][cal].double() - x.mean(0)) /
                        x.std(0).clamp_min(1e-6), z).min(1).values.numpy()
    assert np.allclose(q.t["calibration"].numpy(), np.sort(s_cal), atol=1e-4)
    # the pixel part: the reader images and their re-encodings, calibrated on the
    # temperature and defer images
    px = back.novelty.parts["pixels"]
    assert parts["pixels"]["n_images"] == len(reader_img)
    assert len(px.t["calibration"]) == len(first_per_image(cal, ids))
    # the layout part: the reader images, each re-encoded once by every augment family
    lay = back.novelty.parts["layout"]
    assert parts["layout"]["n_images"] == len(reader_img)
    assert parts["layout"]["n_augmented"] == len(AUGMENT_FAMILIES) * len(reader_img)
    assert lay.t["bank"].shape[0] == (1 + len(AUGMENT_FAMILIES)) * len(reader_img)
    assert len(lay.t["calibration"]) == len(first_per_image(cal, ids))
    # the combined p-value of a row is Bonferroni over the four parts, read as /answer
    # reads it (`Heads.with_images`: the pixel and layout parts get the decoded image)
    images = [it.image() for it in items[:3]]
    row = back.with_images({k: v[:3] for k, v in clean.items()}, images)
    assert torch.equal(row["pixel_patches"], with_pixels({}, images)["pixel_patches"])
    each = back.novelty.part_p_values(row)
    assert np.allclose(back.novelty.p_values(row), np.minimum(
        1, 4 * np.min(np.stack([each[k] for k in ("image", "question", "pixels", "layout")]),
                      0)))


def test_the_novelty_stage_logs_its_flag_rates_out_of_sample(actors, own_or_wrong_data,
                                                              tmp_path):
    """At α = 0.01 the small fixture can never flag, so the logged rates would be 0 however
    they were computed; at α = 0.6 each is worked out here from the detector's scores."""
    from heads.fit import novelty_stage

    actor, alpha = actors["gemma3"], 0.6      # the fixture's scores take two values
    items = load(own_or_wrong_data)
    col = Collector(actor, tmp_path / "cache", 4)
    feats, meta = col.run(items)
    sp = splits_of(meta)
    nov, log = novelty_stage(col, items, feats, sp, 2, alpha=alpha)
    s = {k: nov.score(features(nov.feature, {n: v[sp[k]] for n, v in feats.items()}))
         for k in ("temperature", "defer")}

    def flagged(ref, read):
        return float((p_values(ref, read) < alpha).mean())

    cross = (flagged(s["temperature"], s["defer"]) + flagged(s["defer"], s["temperature"])) / 2
    both = np.r_[s["temperature"], s["defer"]]
    assert log["cross_flag_rate"] == pytest.approx(cross, abs=1e-4)
    assert log["calibration_flag_rate"] == pytest.approx(flagged(both, both), abs=1e-4)
    assert np.allclose(nov.t["calibration"].numpy(), np.sort(both))
    assert log["cross_flag_rate"] != log["calibration_flag_rate"]      # out of sample


def test_fit_heads_flags_reach_the_fit(actor_dirs, own_or_wrong_data, tmp_path, monkeypatch):
    from app.cli import app

    seen = []

    class Stop(Exception):
        pass

    def fake(actor, items, **kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr("heads.fit.fit_heads", fake)
    base = ["fit-heads", "--actor", actor_dirs["gemma3"], "--data", own_or_wrong_data, "--out",
            str(tmp_path / "h"), "--allow-dirty"]
    for extra in ([], ["--no-novelty"], ["--novelty-per-family", "7"]):
        res = CliRunner().invoke(app, base + extra)
        assert isinstance(res.exception, Stop), res.output
    assert [(k["novelty"], k["novelty_per_family"]) for k in seen] == \
        [(True, 250), (False, 250), (True, 7)]
    assert all("image_check" not in k and "image_items" not in k for k in seen)


def test_fit_without_novelty_keeps_the_old_rule(tmp_path):
    heads = Heads(dim=2, policy=_policy(0.5))
    heads.save(tmp_path, {"novelty": None})
    assert not (tmp_path / "novelty.json").exists()
    assert Heads.load(tmp_path).novelty is None


# ------------------------------------------------------------------ card versions
@pytest.mark.parametrize("delta", [1, 5])
def test_a_card_newer_than_the_code_is_refused(tmp_path, delta):
    from heads.dualread import CARD_VERSION, CardTooNew

    h = Heads.new(4)
    h.actor_fingerprint = "fp"
    h.save(tmp_path / "h", {"command": "test"})
    card_path = tmp_path / "h" / "heads_card.json"
    card = json.loads(card_path.read_text())
    assert card["card_version"] == CARD_VERSION == 5
    assert Heads.load(tmp_path / "h").card["card_version"] == 5    # its own version loads
    for older in (4, 3, 2, None):   # cards before the bump, and before versions were written
        if older is None:
            card.pop("card_version")
        else:
            card["card_version"] = older
        card_path.write_text(json.dumps(card))
        assert Heads.load(tmp_path / "h").actor_fingerprint == "fp"
    card["card_version"] = 5 + delta
    card_path.write_text(json.dumps(card))
    with pytest.raises(CardTooNew, match=f"card version {5 + delta}, newer"):
        Heads.load(tmp_path / "h")
