"""A small scene renderer with easy-VQA's recipe, for stress suites (SPEC §8).

easy-VQA draws one shape of one of 8 colours on a flat pale background (each channel
uniform in 230..255) on a 2× canvas with PIL's non-anti-aliased drawing, then resizes it
to 64 px bilinearly; shape sizes are uniform in [canvas/8, canvas/2]. This module draws
scenes the same way, and can also draw what the training images never show: colours and
shapes outside the training set, several objects, and questions of kinds never asked
(counting, position, size). Every item carries its gold answer. Low-level statistics
(background, edges, anti-aliasing) match the training images, so a detector that flags
these has to flag the content, not the encoding.

A data spec `render:KIND[:N[:SEED]]` gives N images (default 200) of a suite KIND
(`SUITES`), a few questions each; rendering is deterministic in (KIND, SEED, image index)
and happens when an item's image is read. These images are for evaluation only: nothing
fits on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from models.items import COLOURS, SHAPES, Item

IM_SIZE = 64
DRAW_SCALE = 2
# the training colours (easy-VQA's RGB values) and colours it never shows
RGB = {"black": (0, 0, 0), "gray": (128, 128, 128), "red": (255, 0, 0),
       "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
       "teal": (0, 128, 128), "brown": (165, 42, 42),
       # unseen: development
       "orange": (255, 140, 0), "purple": (128, 0, 128), "pink": (255, 105, 180),
       # unseen: held out
       "cyan": (0, 255, 255), "olive": (128, 128, 0), "navy": (0, 0, 128),
       "magenta": (255, 0, 255)}
assert set(COLOURS) <= set(RGB)
UNSEEN_COLOURS = {"dev": ("orange", "purple", "pink"),
                  "heldout": ("cyan", "olive", "navy", "magenta")}
UNSEEN_SHAPES = {"dev": ("star", "cross"), "heldout": ("pentagon", "semicircle"),
                 # registered after the held-out suites above had been evaluated twice
                 "fresh": ("hexagon", "diamond", "ring"),
                 # development, added after the split: outlines close to the training
                 # circle and rectangle (shape-dev's star and cross are far from every one)
                 "near-dev": ("octagon", "ellipse", "trapezoid", "parallelogram")}
# height / width of a shape's box where it is neither square nor the triangle's
NEAR_HEIGHT = {"ellipse": 0.6, "trapezoid": 0.6, "parallelogram": 0.55}
DEFAULT_IMAGES = 200
QUESTIONS_PER_IMAGE = 3


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    box: tuple[int, int, int, int]      # x0, y0, x1, y1 on the draw canvas


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]
    background: tuple[int, int, int]
    size: int = IM_SIZE                  # output side
    scale: int = DRAW_SCALE              # draw canvas = size * scale
    resample: str = "bilinear"           # how the canvas is brought down to `size`


# ------------------------------------------------------------------ drawing
def _polygon(cx: float, cy: float, r: float, k: int, start: float = -math.pi / 2,
             inner: float | None = None) -> list[tuple[float, float]]:
    """A regular k-gon (or a k-pointed star when `inner` is a radius ratio)."""
    pts = []
    steps = 2 * k if inner else k
    for i in range(steps):
        a = start + 2 * math.pi * i / steps
        rr = r * (inner if inner and i % 2 else 1)
        pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return pts


def draw_object(draw: ImageDraw.ImageDraw, o: Obj) -> None:
    x0, y0, x1, y1 = o.box
    w, h = x1 - x0, y1 - y0
    fill = RGB[o.colour]
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, min(w, h) / 2
    if o.shape == "rectangle":
        draw.rectangle([(x0, y0), (x1, y1)], fill=fill)
    elif o.shape == "circle":
        draw.ellipse([(x0, y0), (x0 + w, y0 + w)], fill=fill)
    elif o.shape == "triangle":
        # easy-VQA's: a corner at (x, y + s) and sides at 0° and -60°
        s = w
        x, y = x0, y0 + s * math.sin(math.pi / 3)
        draw.polygon([(x, y), (x + s, y), (x + s * math.cos(-math.pi / 3),
                                            y + s * math.sin(-math.pi / 3))], fill=fill)
    elif o.shape == "star":
        draw.polygon(_polygon(cx, cy, r, 5, inner=0.45), fill=fill)
    elif o.shape == "cross":
        t = w / 3
        draw.rectangle([(x0 + t, y0), (x1 - t, y1)], fill=fill)
        draw.rectangle([(x0, y0 + t), (x1, y1 - t)], fill=fill)
    elif o.shape == "pentagon":
        draw.polygon(_polygon(cx, cy, r, 5), fill=fill)
    elif o.shape == "semicircle":
        draw.pieslice([(x0, y0), (x1, y1 + h)], 180, 360, fill=fill)
    elif o.shape == "hexagon":
        draw.polygon(_polygon(cx, cy, r, 6, start=0.0), fill=fill)
    elif o.shape == "diamond":
        draw.polygon(_polygon(cx, cy, r, 4), fill=fill)
    elif o.shape == "octagon":
        # flat sides touching the box, as the circle does
        draw.polygon(_polygon(cx, cy, r / math.cos(math.pi / 8), 8, start=math.pi / 8),
                     fill=fill)
    elif o.shape == "ellipse":
        draw.ellipse([(x0, y0), (x1, y1)], fill=fill)
    elif o.shape == "trapezoid":
        draw.polygon([(x0, y1), (x1, y1), (x1 - w / 4, y0), (x0 + w / 4, y0)], fill=fill)
    elif o.shape == "parallelogram":
        s = 0.3 * w
        draw.polygon([(x0 + s, y0), (x1, y0), (x1 - s, y1), (x0, y1)], fill=fill)
    elif o.shape == "ring":
        draw.ellipse([(x0, y0), (x0 + w, y0 + w)], outline=fill, width=max(2, w // 5))
    else:
        raise ValueError(f"unknown shape {o.shape!r}")


def render(scene: Scene) -> Image.Image:
    side = scene.size * scene.scale
    k = side / (IM_SIZE * DRAW_SCALE)          # boxes are given on the 128-px canvas
    im = Image.new("RGB", (side, side), scene.background)
    draw = ImageDraw.Draw(im)
    for o in scene.objects:
        draw_object(draw, Obj(o.shape, o.colour, tuple(int(round(v * k)) for v in o.box)))
    if scene.scale == 1:
        return im
    how = {"bilinear": Image.BILINEAR, "lanczos": Image.LANCZOS, "box": Image.BOX}
    return im.resize((scene.size, scene.size), resample=how[scene.resample])


# ------------------------------------------------------------------ sampling scenes
CANVAS = IM_SIZE * DRAW_SCALE
MIN_SIZE, MAX_SIZE = CANVAS // 8, CANVAS // 2


def _place(rng: np.random.Generator, shapes: list[str], colours: list[str],
           lo: int = MIN_SIZE, hi: int = MAX_SIZE, gap: int = 4) -> tuple[Obj, ...]:
    """Non-overlapping objects (rejection sampling on boxes), sizes uniform in [lo, hi]."""
    for _ in range(1000):
        out: list[Obj] = []
        for s, c in zip(shapes, colours):
            w = int(rng.integers(lo, hi + 1))
            h = w if s != "rectangle" else int(rng.integers(lo, hi + 1))
            if s == "triangle":
                h = int(math.ceil(w * math.sin(math.pi / 3)))
            elif s in NEAR_HEIGHT:
                h = int(round(w * NEAR_HEIGHT[s]))
            x, y = int(rng.integers(0, CANVAS - w)), int(rng.integers(0, CANVAS - h))
            box = (x, y, x + w, y + h)
            if any(not (box[2] + gap <= b.box[0] or b.box[2] + gap <= box[0]
                        or box[3] + gap <= b.box[1] or b.box[3] + gap <= box[1])
                   for b in out):
                break
            out.append(Obj(s, c, box))
        if len(out) == len(shapes):
            return tuple(out)
    raise RuntimeError("could not place the objects")


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(v) for v in rng.integers(230, 256, size=3))


def single_questions(o: Obj, colours: tuple[str, ...], shapes: tuple[str, ...]
                     ) -> list[tuple[str, str]]:
    """easy-VQA's question forms about one object, with gold answers; the yes/no forms
    ask about every colour and shape in `colours` / `shapes`."""
    s, c = o.shape, o.colour
    qs = [("what shape is in the image?", s), ("what shape is present?", s),
          ("what shape does the image contain?", s), (f"what is the {c} shape?", s),
          (f"what color is the {s}?", c), (f"what is the color of the {s}?", c),
          ("what color is the shape?", c), ("what is the color of the shape?", c)]
    for name in shapes:
        yes = "yes" if name == s else "no"
        qs += [(f"is there a {name}?", yes), (f"does the image contain a {name}?", yes)]
    for name in colours:
        yes = "yes" if name == c else "no"
        qs += [(f"is there a {name} shape?", yes),
               (f"does the image contain a {name} shape?", yes)]
    return qs


def multi_questions(objs: tuple[Obj, ...]) -> list[tuple[str, str]]:
    """Questions with one gold answer on a scene of distinct shapes and colours."""
    qs = []
    present_s, present_c = {o.shape for o in objs}, {o.colour for o in objs}
    shown = [o.shape for o in objs]
    for o in objs:
        if shown.count(o.shape) == 1:      # "the circle" names one object only then
            qs.append((f"what color is the {o.shape}?", o.colour))
        qs.append((f"what is the {o.colour} shape?", o.shape))
    for name in SHAPES:
        qs.append((f"is there a {name}?", "yes" if name in present_s else "no"))
    for name in COLOURS:
        qs.append((f"is there a {name} shape?", "yes" if name in present_c else "no"))
    return qs


def _distinct(rng: np.random.Generator, pool: tuple[str, ...], k: int) -> list[str]:
    return [pool[i] for i in rng.choice(len(pool), size=k, replace=False)]


def make_scene(kind: str, rng: np.random.Generator) -> tuple[Scene, list[tuple[str, str]]]:
    """One scene of suite `kind` and every question asked about it, with gold answers."""
    bg = _background(rng)
    spec = SUITES[kind]
    if spec["objects"] == 1:
        shape = _distinct(rng, spec["shapes"], 1)[0]
        colour = _distinct(rng, spec["colours"], 1)[0]
        lo, hi = spec.get("sizes", (MIN_SIZE, MAX_SIZE))
        objs = _place(rng, [shape], [colour], lo, hi)
        ask = spec["ask"]
        if ask == "easyvqa":
            qs = single_questions(objs[0], tuple(dict.fromkeys(COLOURS + (colour,))),
                                  tuple(dict.fromkeys(SHAPES + (shape,))))
        elif ask == "size":
            big = "large" if objs[0].box[2] - objs[0].box[0] >= CANVAS // 3 else "small"
            qs = [("is the shape large or small?", big),
                  (f"is the {shape} big or small?", "big" if big == "large" else "small"),
                  ("what size is the shape?", big)]
        else:
            raise ValueError(ask)
    else:
        k = spec["objects"] if isinstance(spec["objects"], int) else \
            int(rng.integers(spec["objects"][0], spec["objects"][1] + 1))
        shapes = [spec["shapes"][i] for i in rng.integers(len(spec["shapes"]), size=k)] \
            if spec.get("repeat_shapes") else _distinct(rng, spec["shapes"], k)
        colours = _distinct(rng, spec["colours"], k)
        objs = _place(rng, shapes, colours, MIN_SIZE, spec.get("max_size", CANVAS // 3))
        ask = spec["ask"]
        if ask == "multi":
            qs = multi_questions(objs)
        elif ask == "count":
            words = {1: "1", 2: "2", 3: "3"}
            qs = [("how many shapes are there?", words[k]),
                  ("how many shapes are in the image?", words[k]),
                  ("what is the number of shapes?", words[k])]
        elif ask == "position":
            a, b = objs[0], objs[1]
            left = a if (a.box[0] + a.box[2]) < (b.box[0] + b.box[2]) else b
            right = b if left is a else a
            qs = [(f"is the {left.colour} shape on the left or the right?", "left"),
                  (f"is the {right.colour} shape on the left or the right?", "right"),
                  (f"which side is the {left.shape} on?", "left"),
                  (f"which side is the {right.shape} on?", "right")]
        else:
            raise ValueError(ask)
    return Scene(objs, bg, spec.get("size", IM_SIZE), spec.get("scale", DRAW_SCALE),
                 spec.get("resample", "bilinear")), qs


# Each suite: what it draws and asks. `split`: development (design choices may look at
# it) or heldout (evaluated once); `kind`: benign, novel (content the actor never saw).
# Decided before any result was seen (docs/defer/suites.md).
_ONE = {"objects": 1, "shapes": SHAPES, "colours": COLOURS, "ask": "easyvqa"}
SUITES: dict[str, dict] = {
    # faithful re-renders of the training distribution
    "plain": {**_ONE, "split": "dev", "kind": "benign"},
    "nosuper": {**_ONE, "scale": 1, "split": "dev", "kind": "benign"},
    "size128": {**_ONE, "size": 128, "split": "dev", "kind": "benign"},
    "ss4-lanczos": {**_ONE, "scale": 4, "resample": "lanczos", "split": "heldout",
                    "kind": "benign"},
    # content never seen
    "colour-dev": {**_ONE, "colours": UNSEEN_COLOURS["dev"], "split": "dev", "kind": "novel"},
    "colour-heldout": {**_ONE, "colours": UNSEEN_COLOURS["heldout"], "split": "heldout",
                       "kind": "novel"},
    "shape-dev": {**_ONE, "shapes": UNSEEN_SHAPES["dev"], "split": "dev", "kind": "novel"},
    # development, added after the split (docs/defer/suites.md): unseen shapes close in
    # outline to the training ones, which shape-dev lacks
    "shape-near-dev": {**_ONE, "shapes": UNSEEN_SHAPES["near-dev"], "split": "dev",
                       "kind": "novel"},
    "shape-heldout": {**_ONE, "shapes": UNSEEN_SHAPES["heldout"], "split": "heldout",
                      "kind": "novel"},
    "two": {"objects": 2, "shapes": SHAPES, "colours": COLOURS, "ask": "multi",
            "split": "dev", "kind": "novel"},
    "three": {"objects": 3, "shapes": SHAPES, "colours": COLOURS, "ask": "multi",
              "max_size": CANVAS * 3 // 10, "split": "heldout", "kind": "novel"},
    # fresh held-out families, registered (docs/defer/suites.md) after the held-out suites
    # above had been evaluated twice and before any result on these was seen
    "shape-fresh": {**_ONE, "shapes": UNSEEN_SHAPES["fresh"], "split": "heldout",
                    "kind": "novel"},
    "four": {"objects": 4, "shapes": SHAPES, "repeat_shapes": True, "colours": COLOURS,
             "ask": "multi", "max_size": CANVAS // 4, "split": "heldout", "kind": "novel"},
    # questions of kinds never asked
    "count": {"objects": (1, 3), "shapes": SHAPES, "colours": COLOURS, "ask": "count",
              "split": "dev", "kind": "novel"},
    "position": {"objects": 2, "shapes": SHAPES, "colours": COLOURS, "ask": "position",
                 "split": "heldout", "kind": "novel"},
    "size": {**_ONE, "ask": "size", "sizes": (MIN_SIZE, MAX_SIZE), "split": "heldout",
             "kind": "novel"},
}


@dataclass(frozen=True)
class RenderedItem(Item):
    """An item whose image is drawn when read (no file): `scene` says what to draw."""

    scene: Scene | None = None

    def image(self) -> Image.Image:
        return render(self.scene)


def load_render(rest: str) -> list[Item]:
    """`KIND[:N[:SEED]]` -> items: N images of suite KIND, QUESTIONS_PER_IMAGE questions
    each (a deterministic draw from every question the scene allows)."""
    parts = rest.split(":")
    kind = parts[0]
    if kind not in SUITES:
        raise ValueError(f"unknown render suite {kind!r}; known: {', '.join(SUITES)}")
    try:
        n = int(parts[1]) if len(parts) > 1 and parts[1] else DEFAULT_IMAGES
        seed = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        raise ValueError(f"bad render spec {rest!r}: render:KIND[:N[:SEED]]") from None
    if not 1 <= n <= 100_000:
        raise ValueError("render: N must be 1..100000")
    items: list[Item] = []
    for i in range(n):
        rng = np.random.default_rng([seed, i, sum(map(ord, kind)), len(kind)])
        scene, qs = make_scene(kind, rng)
        pick = rng.choice(len(qs), size=min(QUESTIONS_PER_IMAGE, len(qs)), replace=False)
        img_id = f"render-{kind}-{seed}-img{i}"
        for j in sorted(pick):
            q, a = qs[j]
            at = "yes/no" if a in ("yes", "no") else "other"
            items.append(RenderedItem(id=f"{img_id}-q{j}", image_path=f"render:{kind}:{i}",
                                      question=q, answer=a, image_id=img_id,
                                      domain="render", answer_type=at, scene=scene))
    return items
