"""The defer rule's novelty detectors (SPEC §8): fitted on clean training data and benign
re-encodings of it, calibrated on a disjoint clean split, nothing else.

One-class parts, read as one conformal detector (`CompositeNovelty`, Bonferroni):
- `image`: patch-level (PatchCore-style). Each image token's state (the actor's final
  layer, which the readout captures anyway) is compared with a bank of image-token states
  of the fitting images and of benign re-encodings of them (JPEG, resampling, mild noise,
  small crops); the score is the largest distance of any token to its nearest bank
  token, so one region showing something the actor never saw is enough.
- `question`: the prompt state's distance to the nearest prompt state of the fitting
  questions: a question of a kind never asked lands far from all of them.
- `pixels` (`heads.pixel_novelty`): patch-level kNN on the decoded image.
- `layout` (`heads.layout_novelty`): the decoded image's objects (how many, their
  outlines, sizes and colours), the distance to the nearest fitting scene.
No corrupted or novel input is used for fitting: what the detectors flag is whatever is
far from the training data, not a list of named shifts.
"""

from __future__ import annotations

import numpy as np
import torch
from rich.console import Console

from heads.collect import Collector
from heads.layout_novelty import NearLayoutNovelty, layout_descriptors
from heads.novelty import (
    ALPHA,
    IMAGE_FEATURES,
    CompositeNovelty,
    ImagePart,
    Novelty,
    features,
)
from heads.pixel_novelty import PIXEL_BANK, PIXEL_FEATURE, PixelNovelty, pixel_descriptors
from heads.splits import splits_of
from models.data import Item
from models.shift import per_family as per_family_items

console = Console(stderr=True)
# benign re-encodings whose image tokens join the bank (models.benign's development
# families: the held-out benign families stay out of every fit)
AUGMENT_FAMILIES = ("jpeg-q", "upscale", "noise-mild", "crop")
AUGMENT_PER_FAMILY = 250
# image tokens kept in the bank (a deterministic subsample): the cost of one item's
# score is M tokens × BANK distances; at 8000 it is a small share of a readout
IMAGE_BANK = 8000
IMAGE_FEATURE, QUESTION_FEATURE = "img_token_slots", "h_pre"
# the layout part fitted: with the outline score (docs/defer/near-shapes-dev.md, chosen on
# development suites), so a shape near the training outlines is scored by its own outline
LAYOUT_PART = NearLayoutNovelty
LAYOUT_FEATURE = LAYOUT_PART.FEATURE
DETECTOR_ALPHA = 2 * ALPHA     # the combined flag rate on clean input; α/2 a part


def first_per_image(idx: torch.Tensor, image_ids: list[str]) -> torch.Tensor:
    """The first row of each image among rows `idx` (an image's tokens do not depend on
    the question: one row per image in the bank and in the conformal reference)."""
    seen: set[str] = set()
    keep = []
    for i in idx.tolist():
        if image_ids[i] not in seen:
            seen.add(image_ids[i])
            keep.append(i)
    return torch.tensor(keep, dtype=torch.long)


def augment_items(items: list[Item], per_family: int = AUGMENT_PER_FAMILY, seed: int = 0
                  ) -> list[Item]:
    """Benign re-encodings of `items`: for each family of AUGMENT_FAMILIES a deterministic
    sample of `per_family` of them, severities 1..5 in turn."""
    return per_family_items(items, AUGMENT_FAMILIES, per_family, seed + 200)


def fit_detectors(fit: dict, augmented: dict | None, calibration_images: dict,
                  calibration_questions: dict, bank: int = IMAGE_BANK,
                  pixels: tuple[torch.Tensor, torch.Tensor] | None = None,
                  pixel_bank: int = PIXEL_BANK,
                  layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> CompositeNovelty:
    """The composite detector from feature dicts (`extract`'s keys): image tokens of the
    fitting images (+ `augmented`), prompt states of the fitting questions; each part
    calibrated on its own clean split. `pixels`: the pixel part's descriptors
    (`heads.pixel_novelty.pixel_descriptors`) of the fitting images with their benign
    re-encodings, and of the calibration images; without it, no pixel part. `layout`: the
    layout part's vectors (`layout_vectors`) of the same images;
    without it, no layout part."""
    img = Novelty("token_knn", IMAGE_FEATURE, max_bank=bank)
    x = features(IMAGE_FEATURE, fit)
    if augmented is not None:
        x = torch.cat([x, features(IMAGE_FEATURE, augmented)])
    img.fit(x).calibrate(features(IMAGE_FEATURE, calibration_images))
    q = Novelty("knn", QUESTION_FEATURE, k=1)
    q.fit(features(QUESTION_FEATURE, fit)).calibrate(
        features(QUESTION_FEATURE, calibration_questions))
    parts = {"image": img, "question": q}
    if pixels is not None:
        parts["pixels"] = PixelNovelty(max_bank=pixel_bank).fit(pixels[0]).calibrate(pixels[1])
    if layout is not None:
        parts["layout"] = LAYOUT_PART().fit(layout[0]).calibrate(layout[1])
    return CompositeNovelty(parts)


def _rows(feats: dict, idx) -> dict:
    idx = torch.as_tensor(idx, dtype=torch.long)
    return {k: v[idx] for k, v in feats.items()}


def _descriptors(items: list[Item], rows: torch.Tensor, cache: dict) -> torch.Tensor:
    """Pixel descriptors of the image of each row (each image described once)."""
    todo = [i for i in dict.fromkeys(rows.tolist()) if items[i].image_id not in cache]
    if todo:
        d = pixel_descriptors([items[i].image() for i in todo])
        cache.update({items[i].image_id: d[j] for j, i in enumerate(todo)})
    return torch.stack([cache[items[i].image_id] for i in rows.tolist()])


def layout_vectors(images: list) -> torch.Tensor:
    """The fitted layout part's vectors (`LAYOUT_PART`) of decoded images."""
    return layout_descriptors(images, outline=LAYOUT_PART.OUTLINE)


def _layouts(items: list[Item], rows: torch.Tensor) -> torch.Tensor:
    """Layout vectors of the image of each row (cheap: no cache needed)."""
    return layout_vectors([items[i].image() for i in rows.tolist()])


def _clean_rows(det: CompositeNovelty, items: list[Item], feats: dict, rows: torch.Tensor,
                described: dict | None = None) -> dict:
    """Feature rows of `rows`, with what each part reads from the rows' images (the clean
    sample and its checks read every part)."""
    out = _rows(feats, rows)
    for f in det.image_features:    # each part by its own feature (older heads' too)
        if f == PIXEL_FEATURE:      # cached: the pixel descriptors are the costly ones
            out[f] = _descriptors(items, rows, {} if described is None else described)
        else:
            out[f] = IMAGE_FEATURES[f]([items[i].image() for i in rows.tolist()])
    return out


def detector_stage(col: Collector, items: list[Item], feats: dict, splits: dict,
                   per_family: int = AUGMENT_PER_FAMILY, seed: int = 0,
                   alpha: float = DETECTOR_ALPHA, pixels: bool = True, layout: bool = True
                   ) -> tuple[CompositeNovelty, dict]:
    """Readouts of benign re-encodings of reader-split images, the composite detector
    fitted on the reader split and calibrated on the temperature and defer splits, and
    what the card logs (clean flag rates out of sample, per part and combined).
    `pixels`: with the pixel part (`heads.pixel_novelty`), fitted on the same images and
    re-encodings. `layout`: with the layout part (`heads.layout_novelty`), likewise."""
    reader = splits["reader"]
    ids = [it.image_id for it in items]
    reader_img = first_per_image(reader, ids)
    aug_items = augment_items([items[i] for i in reader_img.tolist()], per_family, seed)
    augmented = None
    if aug_items:
        augmented, _ = col.run(aug_items, label="readouts (benign re-encodings, reader images)")
    cal = torch.cat([splits["temperature"], splits["defer"]])
    cal_img = first_per_image(cal, ids)
    fit_rows = _rows(feats, reader)
    described: dict = {}
    pix = None
    if pixels:
        fit_px = _descriptors(items, reader_img, described)
        if aug_items:
            fit_px = torch.cat([fit_px, pixel_descriptors([it.image() for it in aug_items])])
        pix = (fit_px, _descriptors(items, cal_img, described))
    lay, lay_aug = None, []
    if layout:
        # the layout part is cheap (no readout): every reader image re-encoded once by
        # each development family joins its bank, where the readout parts take a sample
        lay_aug = augment_items([items[i] for i in reader_img.tolist()], len(reader_img), seed)
        fit_lay = torch.cat([_layouts(items, reader_img),
                             layout_vectors([it.image() for it in lay_aug])])
        lay = (fit_lay, _layouts(items, cal_img))
    det = fit_detectors(fit_rows, augmented, _rows(feats, cal_img), _rows(feats, cal),
                        pixels=pix, layout=lay)
    # drift's reference: the combined score of the clean calibration items
    det.keep_clean_sample(_clean_rows(det, items, feats, cal, described))
    m = len(det.parts)
    log: dict = {
        "parts": {
            "image": {"kind": "token_knn", "feature": "final-layer image-token states",
                      "fitted_on": "reader-split images, one row per image, and benign "
                                   "re-encodings of them",
                      "augment_families": list(AUGMENT_FAMILIES), "augment_per_family":
                      per_family, "n_images": len(reader_img), "n_augmented": len(aug_items),
                      "bank_tokens": int(det.parts["image"].t["bank"].shape[0]),
                      "calibrated_on": "temperature and defer split images, one row per image",
                      "n_calibration": len(cal_img)},
            "question": {"kind": "knn (k = 1)", "feature": "prompt state h_pre",
                         "fitted_on": "reader-split questions", "n_fit": len(reader),
                         "calibrated_on": "temperature and defer split questions",
                         "n_calibration": len(cal)}},
        "combined": f"p = min(1, {m} min(p_{', p_'.join(det.parts)})); flag when p < alpha",
        "alpha": alpha,
        "smallest_p_value": round(m / (min(len(cal_img), len(cal)) + 1), 6),
        "clean_sample": {"n": len(det.clean), "of": "the combined score of the temperature "
                         "and defer split items, each part's p-value leave-one-out "
                         "(drift's reference, novelty.safetensors)"}}
    calibration = {"calibrated_on": "temperature and defer split images, one row per image",
                   "n_calibration": len(cal_img)}
    if pix is not None:
        log["parts"]["pixels"] = _image_part_log(
            det.parts["pixels"], "pixel_knn (patch kNN on the decoded image, coreset bank)",
            "reader-split images, one row per image, and the same benign re-encodings of them",
            len(reader_img), len(aug_items), "bank_descriptors", calibration)
    if lay is not None:
        log["parts"]["layout"] = _image_part_log(
            det.parts["layout"],
            "layout_knn_outline (scene layout of the decoded image with its objects' outlines, "
            "nearest fitting scene; also 2 x the nearest fitting outline)",
            "reader-split images, one row per image, and each of them re-encoded once by "
            "every augment family (severities 1..5 in turn)",
            len(reader_img), len(lay_aug), "bank_scenes", calibration,
            augment_families=list(AUGMENT_FAMILIES))
    if log["smallest_p_value"] >= alpha:
        console.log(f"[yellow]novelty detector: too few calibration items for a p-value "
                    f"below alpha {alpha}; it will never flag[/yellow]")
    # out of sample: calibrate on one of the two clean splits, read the other
    rates = []
    for a, b in (("temperature", "defer"), ("defer", "temperature")):
        ia, ib = splits[a], splits[b]
        if len(ia) == 0 or len(ib) == 0:
            continue
        ia_img = first_per_image(ia, ids)
        parts = {
            "image": det.parts["image"].recalibrated(
                features(IMAGE_FEATURE, _rows(feats, ia_img))),
            "question": det.parts["question"].recalibrated(
                features(QUESTION_FEATURE, _rows(feats, ia)))}
        read = _rows(feats, ib)
        if pix is not None:
            parts["pixels"] = det.parts["pixels"].recalibrated(
                _descriptors(items, ia_img, described))
            read[PIXEL_FEATURE] = _descriptors(items, ib, described)
        if lay is not None:
            parts["layout"] = det.parts["layout"].recalibrated(_layouts(items, ia_img))
            read[LAYOUT_FEATURE] = _layouts(items, ib)
        rates.append(float((CompositeNovelty(parts).p_values(read) < alpha).mean()))
    if rates:
        log["cross_flag_rate"] = round(float(np.mean(rates)), 4)
    console.log(f"novelty detector: bank {log['parts']['image']['bank_tokens']} image tokens, "
                f"clean flag rate (cross-calibrated) {log.get('cross_flag_rate')} at alpha "
                f"{alpha}")
    return det, log


def refit_detectors(actor, heads, items: list[Item], cache_dir=None,
                    per_family: int = AUGMENT_PER_FAMILY, seed: int = 0,
                    max_new_tokens: int = 64) -> dict:
    """Fit the defer rule's detector onto heads already fitted on `items` (same image-hash
    splits as `fit-heads`), replacing their novelty detector; the readers and τ stay.
    Returns the detector's card log."""
    col = Collector(actor, cache_dir, max_new_tokens, kappa=heads.kappa)
    feats, meta = col.run(items, label="readouts (fit)")
    det, log = detector_stage(col, items, feats, splits_of(meta), per_family, seed)
    heads.novelty, heads.novelty_alpha = det, DETECTOR_ALPHA
    return log


def add_clean_sample(actor, heads, items: list[Item], cache_dir=None,
                     max_new_tokens: int = 64) -> int:
    """Give fitted heads' composite detector its clean sample of the combined score without
    refitting anything: the fit's readouts (the same items; a readout cache makes this
    cheap), the same image-hash splits, and the combined score of the temperature and defer
    split items against the stored calibration. Refused when those items do not read as
    they did at calibration (other items, another actor). Writes only novelty.safetensors
    and novelty.json. Returns the sample's size."""
    det = heads.novelty
    if not isinstance(det, CompositeNovelty):
        raise ValueError("these heads have no composite novelty detector (a single detector "
                         "keeps its clean calibration scores already)")
    col = Collector(actor, cache_dir, max_new_tokens, kappa=heads.kappa)
    feats, meta = col.run(items, label="readouts (fit)")
    splits = splits_of(meta)
    rows = _clean_rows(det, items, feats, torch.cat([splits["temperature"], splits["defer"]]))
    share = det.calibration_share(rows)
    if min(share.values()) < 1.0:
        raise ValueError("the calibration items do not read as they did when the detector "
                         f"was calibrated (share found, by part: {share}); refit with "
                         "`dualread fit-detectors`")
    det.keep_clean_sample(rows)
    return len(det.clean)


def _image_part_log(part: ImagePart, kind: str, fitted_on: str, n_images: int, n_augmented: int,
                    bank_key: str, calibration: dict, **extra: object) -> dict:
    """The card entry of a pixel-level part (`heads.novelty.ImagePart`)."""
    d = part.to_dict()
    return {"kind": kind, "feature": d["descriptor"], "side": d["side"], "fitted_on": fitted_on,
            **extra, "n_images": n_images, "n_augmented": n_augmented,
            bank_key: int(part.t["bank"].shape[0]), **calibration}
