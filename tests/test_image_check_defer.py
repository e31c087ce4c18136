"""The image check as part of the defer rule (docs/method.md §8): decision, artefact, fitting stage,
`/answer`'s `image_check` field and `evaluate`'s defer shares."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.evaluate import evaluate
from heads.fit import fit_heads, fit_image_check, image_split, novelty_items
from heads.image_check import PIXEL_FEATURES, SCALE_FLOOR, pixel_features, pixel_features_many
from heads.novelty import Novelty
from models.data import load
from tests.conftest import random_image

FLOOR = torch.tensor(SCALE_FLOOR, dtype=torch.float64)

# the rule and reasons as the card and the service state them, typed out here
RULE_BOTH = ("defer if DualRead < tau or novelty p-value < alpha or image-check p-value < "
             "alpha or the response does not parse")
RULE_IMAGE = ("defer if DualRead < tau or image-check p-value < alpha or the response does "
              "not parse")
IMAGE_REASON = "image quality unlike the fitting images (image-check p < 0.01)"
NOVELTY_REASON = "image unlike the fitting data (novelty p < 0.01)"


def _policy(tau: float) -> DeferPolicy:
    return DeferPolicy(tau=tau, target_risk=0.05, delta=0.1, coverage=0.5, empirical_risk=0.0,
                       risk_upper_bound=0.05, n_calibration=100, feasible=True)


def _pixels(images) -> torch.Tensor:
    return torch.from_numpy(np.stack([pixel_features(im) for im in images]))


def _blocks(rng: np.random.Generator) -> Image.Image:
    """A flat-coloured synthetic image: 8×8 tiles of random colours, 64×64."""
    tiles = rng.integers(0, 256, (8, 8, 3)).astype(np.uint8)
    return Image.fromarray(np.kron(tiles, np.ones((8, 8, 1), np.uint8)))


@pytest.fixture(scope="module")
def check() -> Novelty:
    rng = np.random.default_rng(0)
    return fit_image_check(_pixels([_blocks(rng) for _ in range(150)]),
                           _pixels([_blocks(rng) for _ in range(199)]))


def test_the_defer_rule_with_an_image_check(check):
    heads = Heads(dim=2, policy=_policy(0.5))
    heads.image_check = check
    assert heads.defer_rule == RULE_IMAGE
    assert heads.decide(0.9, None, None, 0.001) == (True, IMAGE_REASON)
    assert heads.decide(0.9, None, None, 0.01) == (False, None)     # p = α is not below α
    assert heads.decide(0.9, None, None, None) == (False, None)     # no reading: no flag
    assert heads.decide(0.3, None, None, 0.5) == (True, None)       # τ alone: no reason
    assert heads.decide(0.9, None, "truncated", 0.001) == (True, "truncated; " + IMAGE_REASON)
    heads.novelty = Novelty("mahalanobis", "img_mean")              # both detectors
    assert heads.defer_rule == RULE_BOTH
    assert heads.decide(0.9, 0.001, None, 0.001) == (True, NOVELTY_REASON + "; " + IMAGE_REASON)
    why = heads.defer_reasons([0.9, 0.9, 0.3], [0.5, 0.001, 0.5], None, [0.001, 0.5, None])
    assert {k: v.tolist() for k, v in why.items()} == {
        "tau": [False, False, True], "novelty": [False, True, False],
        "image": [True, False, False], "problem": [False, False, False]}
    assert heads.defer_mask([0.9, 0.9, 0.9], None, None, [0.5, 0.001, None]).tolist() == \
        [False, True, False]
    plain = Heads(dim=2, policy=_policy(0.5))                        # no check: p ignored
    assert plain.decide(0.9, None, None, 0.0) == (False, None)
    assert plain.image_reading(random_image(0)) is None


def test_image_reading_is_the_conformal_p_value_of_the_knn_distance(check):
    heads = Heads(dim=2, image_check=check)
    fit = _pixels([_blocks(rng) for rng in [np.random.default_rng(0)] for _ in range(150)]
                  ).numpy()                     # the fixture's fitting images, redrawn
    mean, sd = fit.mean(0), np.maximum(fit.std(0, ddof=1), SCALE_FLOOR)   # floored scales
    rng = np.random.default_rng(9)
    clean, blurred = _blocks(rng), _blocks(rng).filter(ImageFilter.GaussianBlur(2))
    cal = np.sort(check.t["calibration"].numpy())
    for im in (clean, blurred):
        r = heads.image_reading(im)
        # independently: standardise with the fitting images' mean and sd, then the
        # distance to the 5th nearest fitting image
        z, bank = (pixel_features(im) - mean) / sd, (fit - mean) / sd
        assert r.score == pytest.approx(float(np.sort(np.linalg.norm(bank - z, axis=1))[4]))
        assert r.p_value == pytest.approx((1 + (cal >= r.score).sum()) / (len(cal) + 1))
        assert r.novel == (r.p_value < 0.01)
    assert heads.image_reading(blurred).novel and not heads.image_reading(clean).novel


def test_save_and_load_keep_the_check_and_its_card(check, tmp_path):
    heads = Heads(dim=2, policy=_policy(0.5), image_check=check)
    heads.save(tmp_path, {"image_check": {"kind": "knn", "calibration_flag_rate": 0.0}})
    assert (tmp_path / "image_check.safetensors").exists()
    card = json.loads((tmp_path / "heads_card.json").read_text())
    assert card["card_version"] == 5 and card["defer_rule"] == RULE_IMAGE
    c = card["image_check"]
    assert (c["kind"], c["feature"], c["alpha"], c["n_fit"], c["n_calibration"]) == \
        ("knn", "pixels", 0.01, 150, 199)
    assert c["calibration_flag_rate"] == 0.0            # what fitting logged is kept
    assert c["files"] == ["image_check.safetensors", "image_check.json"]
    back = Heads.load(tmp_path)
    im = _blocks(np.random.default_rng(3))
    assert back.image_reading(im) == heads.image_reading(im)
    assert back.defer_rule == RULE_IMAGE and back.novelty is None
    # an artefact without one loads with no check and says so in its rule
    Heads(dim=2, policy=_policy(0.5)).save(tmp_path / "plain", {})
    plain = Heads.load(tmp_path / "plain")
    assert plain.image_check is None and "image-check" not in plain.defer_rule
    assert json.loads((tmp_path / "plain" / "heads_card.json").read_text())["image_check"] is None


# ------------------------------------------------------------------ end to end
def test_fit_writes_a_check_fitted_on_clean_reader_images_only(actors, own_or_wrong_data, tmp_path):
    actor, per_family = actors["gemma3"], 2
    items = load(own_or_wrong_data)
    heads, info = fit_heads(actor, items, cache_dir=tmp_path / "cache", max_new_tokens=4,
                            target_risk=0.3, novelty=False, novelty_per_family=per_family,
                            image_check=True)
    assert heads.novelty is None and heads.image_check is not None
    reader = [it for it in items if image_split(it.image_id) == "reader"]
    # calibrated on every image it was not fitted on
    calib = [it for it in items if image_split(it.image_id) in ("temperature", "defer")]

    def first_per_image(its):
        return list({it.image_id: it for it in reversed(its)}.values())[::-1]

    x = _pixels([it.image() for it in first_per_image(reader)])
    assert info["image_check"]["n_images"]["reader"] == len(x) < len(reader)
    assert torch.allclose(heads.image_check.t["mean"], x.mean(0))
    assert info["image_check"]["kind"] == "knn"
    want = np.sort(Novelty("knn", "pixels").fit(x, min_scale=FLOOR).score(
        _pixels([it.image() for it in first_per_image(calib)])))
    assert np.allclose(heads.image_check.t["calibration"].numpy(), want)
    log = info["image_check"]
    assert log["statistics"][0] == "luminance_mean" and len(log["statistics"]) == 16
    # the clean flag rate out of sample: calibrated on one split, read on the other
    tmp, dfr = ([it.image() for it in first_per_image(items)
                 if image_split(it.image_id) == s] for s in ("temperature", "defer"))
    cross = [float((Novelty("knn", "pixels").fit(x, min_scale=FLOOR).calibrate(_pixels(a)).p_value(
        _pixels(b)) < 0.01).mean()) for a, b in ((tmp, dfr), (dfr, tmp))]
    assert log["cross_flag_rate"] == pytest.approx(np.mean(cross), abs=1e-4)
    # corrupted copies of the calibration images (temperature split, then defer split)
    calib_first = [it for s in ("temperature", "defer") for it in first_per_image(items)
                   if image_split(it.image_id) == s]
    shifted = novelty_items(calib_first, per_family)
    assert set(log["corrupted_flag_rate"]) == {it.family for it in shifted}
    # the flag rates are what the shipped check says of those images
    for fam in ("blur", "noise"):
        imgs = [it.image() for it in shifted if it.family == fam]
        assert log["corrupted_flag_rate"][fam] == pytest.approx(
            float((heads.image_check.p_value(_pixels(imgs)) < 0.01).mean()), abs=1e-4)
    # evaluate applies the check: its share among the defer reasons is the image rows'
    heads.save(tmp_path / "h", {"command": "test", **info})
    loaded = Heads.load(tmp_path / "h", actor.fingerprint)
    report = evaluate(actor, loaded, [own_or_wrong_data], tmp_path / "eval", None, bootstrap=10,
                      cache_dir=tmp_path / "cache", max_new_tokens=4, grounding_on=False)
    d = report["datasets"][own_or_wrong_data]
    p = loaded.image_check.p_value(_pixels([it.image() for it in items]))
    assert d["defer"]["deferred_share"]["image"] == pytest.approx(float((p < 0.01).mean()))
    # the full table holds what the heads hold: no answer here has a flip rule, so the
    # answer-consistency reader was skipped, and only naming it is an error
    assert "skipped" in info["fit_log"]["answer_consistency"]
    assert "answer_consistency" not in d["methods"] and "dualread" in d["methods"]
    with pytest.raises(ValueError, match="fitted without answer_consistency"):
        evaluate(actor, loaded, [own_or_wrong_data], tmp_path / "eval2", ("answer_consistency",),
                 bootstrap=10, cache_dir=tmp_path / "cache", max_new_tokens=4,
                 grounding_on=False)


@pytest.mark.parametrize("flag_everything", [True, False])
def test_answer_reports_the_check_and_defers_on_it_alone(actors, actor_dirs, tmp_path,
                                                        monkeypatch, check, flag_everything):
    from tests.helpers import random_heads
    from tests.test_novelty_defer import _served

    heads = Heads.load(random_heads(tmp_path / "plain", actors["qwen3_vl"]))
    heads.policy = _policy(0.0)            # DualRead is never below τ: the check decides
    heads.image_check = check = copy.deepcopy(check)     # the fixture is shared
    # calibration scores below (everything flagged: p = 1/200) or above any distance
    check.t["calibration"] = torch.full((199,), -1.0 if flag_everything else 1e9,
                                        dtype=torch.float64)
    heads.save(tmp_path / "h", {k: v for k, v in heads.card.items() if k != "image_check"})
    body = _served(actor_dirs["qwen3_vl"], tmp_path / "h", monkeypatch)
    assert set(body["image_check"]) == {"score", "p_value", "flagged"}
    assert body["image_check"]["score"] >= 0          # a distance
    if flag_everything:
        assert body["image_check"]["p_value"] == pytest.approx(1 / 200)
        assert body["image_check"]["flagged"] is True
        assert body["defer"] is True and body["defer_reason"] == IMAGE_REASON
    else:
        assert body["image_check"]["p_value"] == pytest.approx(1.0)
        assert body["defer"] is False and body["defer_reason"] is None


def test_image_check_stage_takes_every_image_it_is_given(actors, own_or_wrong_data, tmp_path):
    """One row per distinct image of what it is given, split by the image hash: the CLI
    gives it every image of --data, more than the readers' --limit sample holds."""
    from heads.fit import image_check_stage

    items = load(own_or_wrong_data)
    half = items[: len(items) // 2]
    logs = {len(its): image_check_stage(its, 1)[1] for its in (half, items)}

    def distinct(its, split):
        return len({it.image_id for it in its if image_split(it.image_id) == split})

    for its in (half, items):
        assert logs[len(its)]["n_images"] == {s: distinct(its, s)
                                              for s in ("reader", "temperature", "defer")}
    assert sum(logs[len(items)]["n_images"].values()) > sum(logs[len(half)]["n_images"].values())
    assert logs[len(items)]["questions_given"] == len(items)
    assert logs[len(items)]["distinct_images"] == len({it.image_id for it in items})


def test_batched_image_readings_equal_one_at_a_time(check):
    """Same-size images are measured as one stack: the statistics, scores and p-values
    equal those of each image alone (sizes mixed, tiny and grayscale included)."""
    heads = Heads(dim=2, policy=_policy(0.5))
    heads.image_check = check
    ims = [random_image(k) for k in range(5)] + [
        Image.new("L", (3, 1), 7), random_image(9).resize((40, 30)),
        _blocks(np.random.default_rng(1))]
    many = pixel_features_many(ims)
    one = np.stack([pixel_features(im) for im in ims])
    assert np.allclose(many, one, rtol=0, atol=1e-12)
    got = heads.image_readings(ims)
    want = [heads.image_reading(im) for im in ims]
    assert [g.p_value for g in got] == [w.p_value for w in want]
    assert np.allclose([g.score for g in got], [w.score for w in want], atol=1e-9)
    assert heads.image_readings([]) == []
    assert Heads(dim=2, policy=_policy(0.5)).image_readings(ims) is None


def test_the_logged_flag_rates_are_what_the_check_says_at_a_testable_alpha(own_or_wrong_data):
    """At α = 0.01 a small fixture can never flag (p ≥ 1/(n + 1)), so every logged rate
    would be 0 whatever the code did; at α = 0.5 each is worked out independently here."""
    from heads.fit import image_check_stage

    items, alpha = load(own_or_wrong_data), 0.5
    chk, log = image_check_stage(items, 3, alpha=alpha)
    first = list({it.image_id: it for it in reversed(items)}.values())[::-1]
    by = {s: [it for it in first if image_split(it.image_id) == s]
          for s in ("reader", "temperature", "defer")}
    x = {s: _pixels([it.image() for it in v]) for s, v in by.items()}

    def flagged(cal, read):
        ref = Novelty("knn", "pixels").fit(x["reader"], min_scale=FLOOR).calibrate(cal)
        return float((ref.p_value(read) < alpha).mean())

    cross = (flagged(x["temperature"], x["defer"]) + flagged(x["defer"], x["temperature"])) / 2
    assert log["cross_flag_rate"] == pytest.approx(cross, abs=1e-4)
    cal = torch.cat([x["temperature"], x["defer"]])
    assert log["calibration_flag_rate"] == pytest.approx(flagged(cal, cal), abs=1e-4)
    shifted = novelty_items(by["temperature"] + by["defer"], 3)
    for fam in ("noise", "blur", "contrast"):
        imgs = [it.image() for it in shifted if it.family == fam]
        assert log["corrupted_flag_rate"][fam] == pytest.approx(
            float((chk.p_value(_pixels(imgs)) < alpha).mean()), abs=1e-4)
    # not all zero: the rates can tell a right computation from a wrong one here
    assert log["corrupted_flag_rate"]["noise"] > 0 and log["cross_flag_rate"] > 0
    assert log["cross_flag_rate"] != log["calibration_flag_rate"]      # out of sample


def test_an_image_check_fitted_on_other_statistics_is_refused_at_load(check, tmp_path):
    """An older artefact (ten statistics) loaded fine and then failed on every image (a
    500 on every /answer); it is refused when the heads load, with the fix in the message."""
    from heads.dualread import StaleImageCheck

    heads = Heads(dim=2, policy=_policy(0.5), image_check=copy.deepcopy(check))
    for k in ("mean", "scale"):
        heads.image_check.t[k] = heads.image_check.t[k][:10]
    heads.save(tmp_path / "old", {"image_check": {"statistics": list(PIXEL_FEATURES[:10])}})
    with pytest.raises(StaleImageCheck, match="refit"):
        Heads.load(tmp_path / "old")
    renamed = list(PIXEL_FEATURES[::-1])              # right width, other statistics
    Heads(dim=2, policy=_policy(0.5), image_check=check).save(
        tmp_path / "renamed", {"image_check": {"statistics": renamed}})
    with pytest.raises(StaleImageCheck):
        Heads.load(tmp_path / "renamed")


def test_the_shipped_heads_retire_the_image_check():
    """Issue 27: the shipped rule has no pixel check (it deferred benign re-encodings);
    its detector is the composite one on the actor's states."""
    root = Path(__file__).resolve().parents[1]
    heads = Heads.load(root / "heads" / "embedded")
    assert heads.image_check is None and heads.card["image_check"] is None
    assert set(heads.novelty.parts) == {"image", "question"}
    assert not (root / "heads" / "embedded" / "image_check.json").exists()


