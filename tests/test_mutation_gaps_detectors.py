"""Fast tests of heads/detectors.py's fitting helpers (mutation gaps: before these, only the
actor tests of test_novelty_defer reached them): one row per image, the composite
detector built from feature dicts, and the detector stage with a stand-in collector, all
without an actor.
"""

from __future__ import annotations

import numpy as np
import torch

from heads.detectors import (
    AUGMENT_FAMILIES,
    IMAGE_FEATURE,
    LAYOUT_FEATURE,
    QUESTION_FEATURE,
    _clean_rows,
    augment_items,
    detector_stage,
    first_per_image,
    fit_detectors,
    layout_vectors,
)
from heads.layout_novelty import NearLayoutNovelty
from heads.novelty import CompositeNovelty, Novelty, features
from heads.pixel_novelty import PIXEL_FEATURE, PixelNovelty, pixel_descriptors
from models.data import load
from models.shift import per_family


def test_first_per_image_keeps_the_first_row_of_each_image_in_row_order():
    ids = ["a", "b", "a", "c", "b", "d"]
    got = first_per_image(torch.tensor([4, 2, 0, 3, 1]), ids)
    assert got.dtype == torch.long and got.tolist() == [4, 2, 3]
    none = first_per_image(torch.tensor([], dtype=torch.long), ids)
    assert none.tolist() == [] and none.dtype == torch.long      # an index, even empty


def _feats(rng: np.random.Generator, n: int, shift: float = 0.0) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(rng.normal(shift, 1, size=(n, 3, 4)))
    tokens[0, 2] = float("nan")                            # an empty token slot
    # the keys `extract_many` gives: IMAGE_FEATURE reads "img_tokens", QUESTION_FEATURE "h_pre"
    return {"img_tokens": tokens, "h_pre": torch.from_numpy(rng.normal(size=(n, 5)))}


def test_fit_detectors_builds_the_image_and_question_parts_from_feature_dicts():
    rng = np.random.default_rng(0)
    fit, aug = _feats(rng, 12), _feats(rng, 6)
    cal_img, cal_q = _feats(rng, 7), _feats(rng, 9)
    det = fit_detectors(fit, aug, cal_img, cal_q, bank=40)
    assert isinstance(det, CompositeNovelty) and list(det.parts) == ["image", "question"]
    img, q = det.parts["image"], det.parts["question"]
    assert (img.kind, img.feature, img.max_bank) == ("token_knn", IMAGE_FEATURE, 40)
    assert (q.kind, q.feature, q.k) == ("knn", QUESTION_FEATURE, 1)
    # the bank: real tokens of the fitting and augmented images, capped at `bank`
    assert img.n_fit == 18 and img.t["bank"].shape == (40, 4)
    assert len(img.t["calibration"]) == 7 and len(q.t["calibration"]) == 9
    assert q.n_fit == 12 and q.t["bank"].shape == (12, 5)
    # each part is the detector one would fit by hand on the same rows
    want_q = Novelty("knn", QUESTION_FEATURE, k=1).fit(fit["h_pre"]).calibrate(
        cal_q["h_pre"])
    assert torch.equal(q.t["calibration"], want_q.t["calibration"])
    without = fit_detectors(fit, None, cal_img, cal_q, bank=1000)
    assert without.parts["image"].n_fit == 12
    assert without.parts["image"].t["bank"].shape == (12 * 3 - 1, 4)    # NaN slot left out


# ---------------------------------------------------------------- detector_stage, no actor
# `detector_stage` reads the benign re-encodings through a collector; this one gives random
# feature rows instead of an actor's readouts, so the stage's bookkeeping (which rows fit,
# which calibrate, what the card logs) can be checked by hand.

class _Readouts:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.asked: list[list[str]] = []

    def run(self, items, label: str = ""):
        self.asked.append([it.id for it in items])
        return _feats(self.rng, len(items)), {}


def _stage_inputs():
    items = load("render:plain:16")          # 16 images, 3 questions each, in image order
    feats = _feats(np.random.default_rng(1), len(items))
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    splits = {"reader": order, "temperature": torch.arange(24, 36),
              "defer": torch.arange(36, 48)}
    return items, feats, splits


ALPHA = 0.5     # the stage's α here: a cross-calibrated flag rate strictly between 0 and 1


def _images(items, rows) -> list:
    return [items[i].image() for i in torch.as_tensor(rows).tolist()]


def test_augment_items_samples_each_family_with_the_seed_plus_200():
    items = load("render:plain:6")
    got = augment_items(items, 3, seed=5)
    want = per_family(items, AUGMENT_FAMILIES, 3, 205)
    assert [it.id for it in got] == [it.id for it in want] and len(got) == 12
    assert [it.family for it in got] == [f for f in AUGMENT_FAMILIES for _ in range(3)]
    assert [it.id for it in augment_items(items, 3)] == \
        [it.id for it in per_family(items, AUGMENT_FAMILIES, 3, 200)]
    assert len(augment_items(items)) == 4 * len(items)       # fewer items than per family


def test_detector_stage_fits_reader_images_and_calibrates_on_the_other_splits():
    items, feats, splits = _stage_inputs()
    col = _Readouts(2)
    det, log = detector_stage(col, items, feats, splits, per_family=2, seed=3, alpha=ALPHA,
                              pixels=False)
    ids = [it.image_id for it in items]
    reader_img = first_per_image(splits["reader"], ids)
    cal = torch.arange(24, 48)
    cal_img = first_per_image(cal, ids)
    assert len(reader_img) == 8 and len(cal_img) == 8
    # the readout parts' re-encodings: per_family of the reader images, with the seed
    aug = augment_items([items[i] for i in reader_img.tolist()], 2, 3)
    assert col.asked == [[it.id for it in aug]]
    assert list(det.parts) == ["image", "question", "layout"]
    img, q, lay = det.parts["image"], det.parts["question"], det.parts["layout"]
    # the image bank: every reader row (an image's rows carry the same tokens), then the
    # re-encodings; its reference: one row per calibration image
    assert img.n_fit == 24 + 8 and len(img.t["calibration"]) == 8
    assert q.n_fit == 24 and len(q.t["calibration"]) == 24
    # the layout bank: each reader image, then each re-encoded once by every family
    lay_aug = augment_items([items[i] for i in reader_img.tolist()], 8, 3)
    want_bank = torch.cat([layout_vectors(_images(items, reader_img)),
                           layout_vectors([it.image() for it in lay_aug])]).double()
    assert type(lay) is NearLayoutNovelty and torch.equal(lay.t["bank"], want_bank)
    want_lay = NearLayoutNovelty().fit(want_bank).calibrate(
        layout_vectors(_images(items, cal_img)))
    assert torch.equal(lay.t["calibration"], want_lay.t["calibration"])
    want_q = Novelty("knn", QUESTION_FEATURE, k=1).fit(feats["h_pre"][splits["reader"]])
    assert torch.equal(q.t["calibration"],
                       want_q.calibrate(feats["h_pre"][cal]).t["calibration"])
    # drift's reference: every calibration row, its images' layouts read again
    rows = {k: v[cal] for k, v in feats.items()}
    rows[LAYOUT_FEATURE] = layout_vectors(_images(items, cal))
    assert np.array_equal(det.clean, np.sort(det.clean_sample(rows)))
    # the card: its fields (their prose is not checked) and the parts' kinds
    parts = log["parts"]
    assert list(parts) == ["image", "question", "layout"]
    assert list(log) == ["parts", "combined", "alpha", "smallest_p_value", "clean_sample",
                         "cross_flag_rate"] and list(log["clean_sample"]) == ["n", "of"]
    assert list(parts["image"]) == ["kind", "feature", "fitted_on", "augment_families",
                                    "augment_per_family", "n_images", "n_augmented",
                                    "bank_tokens", "calibrated_on", "n_calibration"]
    assert list(parts["question"]) == ["kind", "feature", "fitted_on", "n_fit",
                                       "calibrated_on", "n_calibration"]
    assert list(parts["layout"]) == ["kind", "feature", "side", "fitted_on",
                                     "augment_families", "n_images", "n_augmented",
                                     "bank_scenes", "calibrated_on", "n_calibration"]
    assert (parts["image"]["kind"], parts["question"]["kind"]) == ("token_knn", "knn (k = 1)")
    assert parts["layout"]["kind"].startswith("layout_knn_outline (")
    assert (parts["layout"]["feature"], parts["layout"]["side"]) == (
        NearLayoutNovelty.DESCRIBED["descriptor"], 64)
    assert (parts["image"]["n_images"], parts["image"]["n_augmented"],
            parts["image"]["augment_per_family"], parts["image"]["n_calibration"],
            parts["image"]["bank_tokens"]) == (8, 8, 2, 8, img.t["bank"].shape[0])
    assert parts["image"]["augment_families"] == list(AUGMENT_FAMILIES)
    assert (parts["question"]["n_fit"], parts["question"]["n_calibration"]) == (24, 24)
    assert (parts["layout"]["n_images"], parts["layout"]["n_augmented"],
            parts["layout"]["bank_scenes"], parts["layout"]["n_calibration"]) == (8, 32, 40, 8)
    assert parts["layout"]["augment_families"] == list(AUGMENT_FAMILIES)
    assert log["combined"] == "p = min(1, 3 min(p_image, p_question, p_layout)); flag when " \
                              "p < alpha"
    assert log["alpha"] == ALPHA and log["smallest_p_value"] == round(3 / 9, 6)
    for part in parts.values():                  # prose, but there
        assert all(isinstance(part[k], str) and part[k]
                   for k in ("kind", "feature", "fitted_on", "calibrated_on"))
    assert log["clean_sample"]["n"] == 24
    # out of sample: each clean split calibrates, the other is read, the rates averaged
    rates = []
    for a, b in (("temperature", "defer"), ("defer", "temperature")):
        a_img = first_per_image(splits[a], ids)
        by_hand = {"image": img.recalibrated(features(IMAGE_FEATURE,
                                                      {k: v[a_img] for k, v in feats.items()})),
                   "question": q.recalibrated(feats["h_pre"][splits[a]]),
                   "layout": lay.recalibrated(layout_vectors(_images(items, a_img)))}
        read = {k: v[splits[b]] for k, v in feats.items()}
        read[LAYOUT_FEATURE] = layout_vectors(_images(items, splits[b]))
        rates.append((CompositeNovelty(by_hand).p_values(read) < ALPHA).mean())
    assert log["cross_flag_rate"] == round(float(np.mean(rates)), 4)
    assert round(float(np.mean(rates)), 5) != log["cross_flag_rate"]    # a fifth decimal
    assert 0 < log["cross_flag_rate"] < 1 and rates[0] != rates[1]


def test_detector_stage_with_the_pixel_part(capsys):
    items, feats, splits = _stage_inputs()
    # three reader images, one re-encoding a family, two rows of two images a clean split
    splits = {"reader": torch.tensor([7, 1, 0, 5, 2, 8]), "temperature": torch.tensor([24, 27]),
              "defer": torch.tensor([36, 40])}
    col = _Readouts(2)
    det, log = detector_stage(col, items, feats, splits, per_family=1, alpha=0.6,
                              layout=False)
    ids = [it.image_id for it in items]
    described: dict = {}

    def pixels_of(rows) -> torch.Tensor:           # each image described once in this test
        for i in rows.tolist():
            if ids[i] not in described:
                described[ids[i]] = pixel_descriptors([items[i].image()])[0]
        return torch.stack([described[ids[i]] for i in rows.tolist()])

    reader_img = first_per_image(splits["reader"], ids)
    assert reader_img.tolist() == [7, 1, 5]
    aug = augment_items([items[i] for i in reader_img.tolist()], 1)
    assert col.asked == [[it.id for it in aug]] and list(det.parts) == [
        "image", "question", "pixels"]
    cal = torch.cat([splits["temperature"], splits["defer"]])
    cal_img = first_per_image(cal, ids)
    px = det.parts["pixels"]
    fit_px = torch.cat([pixels_of(reader_img),
                        pixel_descriptors([it.image() for it in aug])])
    want = PixelNovelty().fit(fit_px).calibrate(pixels_of(cal_img))
    assert torch.equal(px.t["bank"], want.t["bank"])
    assert torch.equal(px.t["calibration"], want.t["calibration"])
    assert det.parts["image"].n_fit == 6 + 4 and len(det.parts["image"].t["calibration"]) == 4
    assert len(det.parts["question"].t["calibration"]) == 4
    pixels = log["parts"]["pixels"]
    assert (pixels["n_images"], pixels["n_augmented"], pixels["bank_descriptors"]) == (
        3, 4, len(want.t["bank"])) and "layout" not in log["parts"]
    assert list(pixels) == ["kind", "feature", "side", "fitted_on", "n_images",
                            "n_augmented", "bank_descriptors", "calibrated_on",
                            "n_calibration"]
    assert pixels["kind"].startswith("pixel_knn (") and pixels["fitted_on"]
    assert log["smallest_p_value"] == round(3 / 5, 6) == log["alpha"]     # 4 rows, 4 images
    assert "too few calibration items" in capsys.readouterr().err    # p < α never holds
    rows = {k: v[cal] for k, v in feats.items()}
    rows[PIXEL_FEATURE] = pixels_of(cal)
    assert np.array_equal(det.clean, np.sort(det.clean_sample(rows)))
    rates = []
    for a, b in (("temperature", "defer"), ("defer", "temperature")):
        a_img = first_per_image(splits[a], ids)
        by_hand = {"image": det.parts["image"].recalibrated(
                       features(IMAGE_FEATURE, {k: v[a_img] for k, v in feats.items()})),
                   "question": det.parts["question"].recalibrated(feats["h_pre"][splits[a]]),
                   "pixels": px.recalibrated(pixels_of(a_img))}
        read = {k: v[splits[b]] for k, v in feats.items()}
        read[PIXEL_FEATURE] = pixels_of(splits[b])
        rates.append((CompositeNovelty(by_hand).p_values(read) < 0.6).mean())
    assert log["cross_flag_rate"] == round(float(np.mean(rates)), 4)


def test_detector_stage_with_one_clean_split_reads_nothing_out_of_sample():
    items, feats, splits = _stage_inputs()
    splits["defer"] = torch.tensor([], dtype=torch.long)
    det, log = detector_stage(_Readouts(2), items, feats, splits, per_family=0,
                              pixels=False, layout=False)
    assert list(det.parts) == ["image", "question"] and "cross_flag_rate" not in log
    assert len(det.parts["image"].t["calibration"]) == 4 and len(det.clean) == 12


def test_the_cross_calibrated_rate_flags_below_alpha_only():
    items, feats, splits = _stage_inputs()
    _, log = detector_stage(_Readouts(2), items, feats, splits, per_family=0, alpha=1.0,
                            pixels=False, layout=False)
    assert log["cross_flag_rate"] < 1.0      # rows at p = 1 are not flagged at alpha 1


def test_fit_detectors_caps_the_pixel_bank():
    items = load("render:plain:2")
    px = pixel_descriptors([items[0].image(), items[3].image()])
    rng = np.random.default_rng(0)
    f = _feats(rng, 4)
    det = fit_detectors(f, None, f, f, pixels=(px, px), pixel_bank=100)
    assert det.parts["pixels"].t["bank"].shape[0] == 100


def test_clean_rows_add_what_the_image_parts_read_and_reuse_described_images():
    items, feats, _ = _stage_inputs()
    rows = torch.tensor([5, 0, 1, 40])
    bank = torch.zeros(3, 4, dtype=torch.float64)
    plain = CompositeNovelty({"question": Novelty("knn", QUESTION_FEATURE, k=1).fit(bank)})
    out = _clean_rows(plain, items, feats, rows)
    assert set(out) == set(feats) and torch.equal(out["h_pre"], feats["h_pre"][rows])
    px = pixel_descriptors(_images(items, torch.tensor([0, 3])))
    lay = layout_vectors(_images(items, rows))
    both = CompositeNovelty({"pixels": PixelNovelty().fit(px),
                             "layout": NearLayoutNovelty().fit(lay)})
    described: dict = {}
    out = _clean_rows(both, items, feats, rows, described)
    assert torch.equal(out[LAYOUT_FEATURE], lay)
    assert torch.equal(out[PIXEL_FEATURE], pixel_descriptors(_images(items, rows)))
    assert set(described) == {items[i].image_id for i in rows.tolist()}
    assert torch.equal(_clean_rows(both, items, feats, rows)[PIXEL_FEATURE],
                       out[PIXEL_FEATURE])                     # no cache given
    described[items[5].image_id] = torch.zeros_like(px[0])   # read from the cache
    again = _clean_rows(both, items, feats, rows, described)
    assert not again[PIXEL_FEATURE][0].any() and torch.equal(again[PIXEL_FEATURE][1:],
                                                              out[PIXEL_FEATURE][1:])


def test_clean_rows_read_a_layout_part_of_heads_fitted_before_by_its_own_feature():
    from heads.layout_novelty import LAYOUT_FEATURE as OLD_FEATURE
    from heads.layout_novelty import LayoutNovelty, layout_descriptors

    items, feats, _ = _stage_inputs()
    rows = torch.tensor([5, 0, 1])
    old = CompositeNovelty({"layout": LayoutNovelty().fit(
        layout_descriptors(_images(items, rows)))})
    assert OLD_FEATURE != LAYOUT_FEATURE           # the fitted part reads another vector
    out = _clean_rows(old, items, feats, rows)
    assert torch.equal(out[OLD_FEATURE], layout_descriptors(_images(items, rows)))
