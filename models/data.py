"""VQA data behind one interface, addressed by a spec string.

    easyvqa:train | easyvqa:test     (PyPI easy-vqa, ships its images; also easyvqa:actor
                                      and easyvqa:heldout, the image-disjoint parts of train,
                                      and heldout's parts easyvqa:dev and easyvqa:fit)
    jsonl:PATH                       (id, image, question, answer[, image_id, box, domain,
                                      answer_type]; image relative to the file)
    slake:DIR[:split]                (SLAKE: {split}.json + imgs/, English questions)
    vqarad:DIR                       (VQA-RAD: the public JSON + its image folder)
    pathvqa:DIR[:split]              (PathVQA: qas/{split}/{split}_qa.pkl + images/{split}/)
    pmcvqa:DIR[:split]               (PMC-VQA: {split}.csv + figures/ or images/)
    render:KIND[:N[:SEED]]           (scenes drawn with easy-VQA's recipe: models.render)
    SPEC~FAMILY:SEVERITY             (any of the above, images corrupted or changed
                                      benignly: models.shift, models.benign)
"""

from __future__ import annotations

import csv
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from models.canon import canon

# The item, the easy-VQA label sets and `sample` live in models.items, which the shift
# and render loaders import (they are loaders this module dispatches to).
from models.items import COLOURS, SHAPES, Item, sample  # noqa: F401


def normalise_question(q: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", q.lower()).split())


# ---------------------------------------------------------------- easy-VQA
def easyvqa_answer_type(question: str, answer: str) -> str:
    if answer in ("yes", "no"):
        return "yes/no"
    return "color" if answer in COLOURS else "shape"


@functools.cache    # easy-VQA's parts all read train's 4,000 images
def shape_box(path: str, tol: int = 40) -> tuple[int, int, int, int]:
    """Bounding box [x0, y0, x1, y1) of the one shape: pixels far from the background.

    easy-VQA draws one shape on a flat background; the corner pixels give the background.
    """
    a = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    corners = np.stack([a[0, 0], a[0, -1], a[-1, 0], a[-1, -1]])
    bg = np.median(corners, axis=0)
    fg = np.abs(a - bg).sum(-1) > tol
    if not fg.any():
        return (0, 0, a.shape[1], a.shape[0])
    ys, xs = np.nonzero(fg)
    return (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)


HEADS_SLICE_MOD = 5
# `easyvqa:dev`: one heldout image in five ((number // 5) % 5 == DEV_BIN), for design
# choices only (docs/method.md, "Development split"); `easyvqa:fit` is the rest of heldout.
DEV_BIN = 4


def image_number(item: Item) -> int:
    return int(item.image_id.rsplit("img", 1)[1])


def easyvqa_part(number: int) -> str:
    """Which image-disjoint part of easy-VQA train an image number belongs to: `actor`
    (number % 5 != 0, what the embedded actor trains on), else `dev` (one in five of the
    rest) or `fit` (the heads' fitting pool); `heldout` = `fit` + `dev`."""
    if number % HEADS_SLICE_MOD != 0:
        return "actor"
    return "dev" if (number // HEADS_SLICE_MOD) % HEADS_SLICE_MOD == DEV_BIN else "fit"


def load_easyvqa(split: str) -> list[Item]:
    """`train`, `test`, or image-disjoint parts of train: `actor` (image number % 5 != 0,
    what the embedded actor trains on), `heldout` (% 5 == 0, for the heads), and heldout's
    two parts, `dev` (design choices only) and `fit` (the rest: the heads' fitting pool)."""
    import easy_vqa

    if split in ("actor", "heldout", "dev", "fit"):
        items = load_easyvqa("train")
        parts = {"heldout": ("dev", "fit")}.get(split, (split,))
        return [it for it in items if easyvqa_part(image_number(it)) in parts]
    if split not in ("train", "test"):
        raise ValueError("easyvqa split must be train, test, actor, heldout, dev or fit")
    qs, ans, img_ids = getattr(easy_vqa, f"get_{split}_questions")()
    paths = getattr(easy_vqa, f"get_{split}_image_paths")()
    boxes: dict[int, tuple[int, int, int, int]] = {}
    items = []
    for k, (q, a, i) in enumerate(zip(qs, ans, img_ids)):
        if i not in boxes:
            boxes[i] = shape_box(paths[i])
        items.append(Item(id=f"easyvqa-{split}-{k}", image_path=paths[i], question=q, answer=a,
                          image_id=f"easyvqa-{split}-img{i}", box=boxes[i], domain="easyvqa",
                          answer_type=easyvqa_answer_type(q, a)))
    return items


# ---------------------------------------------------------------- generic / medical
def load_jsonl(path: str) -> list[Item]:
    base = Path(path).parent
    items = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                img = str((base / r["image"]).resolve())
                items.append(Item(
                    id=str(r.get("id", n)), image_path=img, question=r["question"],
                    answer=str(r["answer"]), image_id=str(r.get("image_id", r["image"])),
                    box=tuple(r["box"]) if r.get("box") else None,
                    domain=r.get("domain", ""), answer_type=r.get("answer_type", ""),
                    options=r.get("options") or {}))
            except (KeyError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{n}: bad item ({e})") from e
    return items


def load_slake(root: str, split: str = "test") -> list[Item]:
    rootp = Path(root)
    name = {"val": "validate", "validation": "validate"}.get(split, split)
    rows = json.loads((rootp / f"{name}.json").read_text())
    return [Item(id=f"slake-{r['qid']}", image_path=str(rootp / "imgs" / r["img_name"]),
                 question=r["question"], answer=str(r["answer"]),
                 image_id=f"slake-{r.get('img_id', r['img_name'])}",
                 domain=r.get("modality", "slake"), answer_type=r.get("answer_type", ""))
            for r in rows if r.get("q_lang", "en") == "en"]


def load_vqarad(root: str) -> list[Item]:
    rootp = Path(root)
    js = rootp / "VQA_RAD Dataset Public.json"
    if not js.exists():
        found = sorted(rootp.glob("*.json"))
        if not found:
            raise FileNotFoundError(f"no VQA-RAD json in {root}")
        js = found[0]
    imgdir = next((d for d in (rootp / "VQA_RAD Image Folder", rootp / "images") if d.exists()),
                  rootp)
    rows = json.loads(js.read_text())
    return [Item(id=f"vqarad-{r.get('qid', k)}", image_path=str(imgdir / r["image_name"]),
                 question=r["question"], answer=str(r["answer"]),
                 image_id=f"vqarad-{r['image_name']}", domain=r.get("image_organ", "vqarad"),
                 answer_type=str(r.get("answer_type", "")).lower())
            for k, r in enumerate(rows)]


def load_pathvqa(root: str, split: str = "test") -> list[Item]:
    import pickle

    rootp = Path(root)
    # The dataset ships its QA pairs as pickles; only load folders you trust.
    with open(rootp / "qas" / split / f"{split}_qa.pkl", "rb") as fh:
        rows = pickle.load(fh)  # noqa: S301
    out = []
    for k, r in enumerate(rows):
        img = rootp / "images" / split / f"{r['image']}.jpg"
        a = str(r["answer"])
        out.append(Item(id=f"pathvqa-{split}-{k}", image_path=str(img), question=r["question"],
                        answer=a, image_id=f"pathvqa-{r['image']}", domain="pathology",
                        answer_type="yes/no" if canon(a) in ("yes", "no") else "open"))
    return out


def load_pmcvqa(root: str, split: str = "test") -> list[Item]:
    rootp = Path(root)
    imgdir = next((d for d in (rootp / "figures", rootp / "images") if d.exists()), rootp)
    out = []
    with open(rootp / f"{split}.csv", newline="") as fh:
        for k, r in enumerate(csv.DictReader(fh)):
            opts = {}
            for letter in "ABCD":
                text = (r.get(f"Choice {letter}") or "").strip()
                opts[letter] = re.sub(rf"^{letter}\s*[:.]\s*", "", text)
            out.append(Item(id=f"pmcvqa-{split}-{k}", image_path=str(imgdir / r["Figure_path"]),
                            question=r["Question"], answer=r["Answer"].strip(),
                            image_id=f"pmcvqa-{r['Figure_path']}", domain="pmc",
                            answer_type="choice", options=opts))
    return out


LOADERS: dict[str, Callable[..., list[Item]]] = {
    "easyvqa": load_easyvqa, "jsonl": load_jsonl, "slake": load_slake, "vqarad": load_vqarad,
    "pathvqa": load_pathvqa, "pmcvqa": load_pmcvqa,
}


def load(spec: str) -> list[Item]:
    """Items for a data spec such as `easyvqa:test` or `slake:/data/slake:test`.

    A suffix `~FAMILY:SEVERITY` (e.g. `easyvqa:test~blur:3`) corrupts every image
    (models.shift, docs/method.md §8).
    """
    if "~" in spec:
        from models.shift import shift_items, split_spec

        base, shift = split_spec(spec)
        if shift is not None:
            return shift_items(load(base), *shift)
    kind, _, rest = spec.partition(":")
    if kind == "render" and rest:
        from models.render import load_render  # imports this module

        return load_render(rest)
    if kind not in LOADERS or not rest:
        raise ValueError(f"bad data spec {spec!r}; kinds: {', '.join(LOADERS)} (KIND:ARGS)")
    if kind in ("easyvqa", "jsonl", "vqarad"):
        return LOADERS[kind](rest)
    path, _, split = rest.rpartition(":") if rest.count(":") else (rest, "", "")
    return LOADERS[kind](path, split) if split else LOADERS[kind](path)


# ---------------------------------------------------------------- hard negatives
class HardNegativeIndex:
    """Donors for CCG (docs/method.md §2): same normalised question, different canonical answer,
    different image, same data. Assigned deterministically from a seed."""

    def __init__(self, items: list[Item], seed: int = 0) -> None:
        self.seed = seed
        self.by_question: dict[str, list[Item]] = {}
        for it in items:
            self.by_question.setdefault(normalise_question(it.question), []).append(it)

    def donors(self, item: Item) -> list[Item]:
        pool = self.by_question.get(normalise_question(item.question), [])
        return [d for d in pool if d.image_id != item.image_id and d.canonical
                and d.canonical != item.canonical]

    def assign(self, item: Item) -> Item | None:
        donors = sorted(self.donors(item), key=lambda d: d.id)
        if not donors:
            return None
        rng = np.random.default_rng([self.seed, int.from_bytes(item.id.encode()[-8:], "little")])
        return donors[int(rng.integers(len(donors)))]
