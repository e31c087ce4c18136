"""Fast tests of heads/detectors.py's fitting helpers (mutation gaps: before these, only the
actor tests of test_novelty_defer reached them): one row per image, and the composite
detector built from feature dicts without an actor.
"""

from __future__ import annotations

import numpy as np
import torch

from heads.detectors import IMAGE_FEATURE, QUESTION_FEATURE, first_per_image, fit_detectors
from heads.novelty import CompositeNovelty, Novelty


def test_first_per_image_keeps_the_first_row_of_each_image_in_row_order():
    ids = ["a", "b", "a", "c", "b", "d"]
    got = first_per_image(torch.tensor([4, 2, 0, 3, 1]), ids)
    assert got.dtype == torch.long and got.tolist() == [4, 2, 3]
    assert first_per_image(torch.tensor([], dtype=torch.long), ids).tolist() == []


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
