"""Development study of outline descriptors for near unseen shapes (no actor).

    python -m studies.near_shapes_study --out docs/defer/near-shapes-dev.md

The shipped layout part (`heads.layout_novelty`, descriptor version 1) is read first on
the development suites, as `heads/embedded` holds it. Then every outline variant of
`VARIANTS` (`heads.layout_novelty.Outline`; "v1" adds nothing: the shipped descriptor) is
fitted the same way on the same images: the `easyvqa:heldout` fitting images of the layout
study plus each of them re-encoded once by every augment family (as the shipped fit),
calibrated on other images of it, and read at the part's own α (0.02 / 4). Nothing is
fitted on a rendered suite. Development suites only: the near shapes are
`render:shape-near-dev`, added for this study (docs/defer/suites.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from heads.detectors import AUGMENT_FAMILIES
from heads.layout_novelty import LayoutNovelty, Outline, layout_descriptors, outline_part
from heads.suites import suite_kinds
from models.data import load, sample
from models.shift import per_family
from studies.part_study import fit_and_calibration_images, load_note, unique_images, write

COMMAND = "python -m studies.near_shapes_study --out docs/defer/near-shapes-dev.md"
NEAR = "render:shape-near-dev"
# every variant tried, in the order tried: name -> outline numbers added to each slot
VARIANTS: dict[str, Outline | None] = {
    "v1": None,
    "grid8": Outline(grid=8),
    "grid10": Outline(grid=10),
    "moments0.5": Outline(moments=True, moment_weight=0.5),
    "moments1": Outline(moments=True, moment_weight=1.0),
    "moments2": Outline(moments=True, moment_weight=2.0),
    "rays16": Outline(rays=16, ray_weight=1.0),
    "rays16x3": Outline(rays=16, ray_weight=3.0),
    "grid8+moments1": Outline(grid=8, moments=True, moment_weight=1.0),
    # second round, after the first showed octagons and ellipses unflagged: the clean
    # calibration tail (a few large rectangles, far in area × aspect × colour) sets the
    # threshold, and an ellipse is a circle's thumbnail at another aspect. (A first
    # `sized` scaled the moments themselves, not their difference from a disc's, so the
    # object's size swamped its outline; its rows were discarded as a defect.)
    "moments4": Outline(moments=True, moment_weight=4.0),
    "moments4-sized": Outline(moments=True, moment_weight=4.0, sized=True),
    "moments8-sized": Outline(moments=True, moment_weight=8.0, sized=True),
    "aspect1": Outline(aspect_weight=1.0),
    "moments4-sized+aspect1": Outline(moments=True, moment_weight=4.0, sized=True,
                                      aspect_weight=1.0),
    "moments4-sized+aspect1+area.5+colour.5": Outline(
        moments=True, moment_weight=4.0, sized=True, aspect_weight=1.0, area_weight=0.5,
        colour_weight=0.5),
    "grid8x3+aspect1": Outline(grid=8, grid_weight=3.0, aspect_weight=1.0),
    # third round: the clean tail is large, rare objects (size × aspect × colour); their
    # outlines have close neighbours, an unseen outline has none: score also by the
    # nearest outline alone (`Outline.shape_factor`)
    "shape2": Outline(shape_factor=2.0),
    "shape3": Outline(shape_factor=3.0),
    "aspect1+shape2": Outline(aspect_weight=1.0, shape_factor=2.0),
    "aspect1+shape3": Outline(aspect_weight=1.0, shape_factor=3.0),
    "grid8+aspect1+shape3": Outline(grid=8, aspect_weight=1.0, shape_factor=3.0),
    "moments1+aspect1+shape3": Outline(moments=True, aspect_weight=1.0, shape_factor=3.0),
    # fourth round: the outline score flags ellipses; octagons still pass: finer outline
    # numbers inside it
    "shape1.5": Outline(shape_factor=1.5),
    "grid8+shape2": Outline(grid=8, shape_factor=2.0),
    "grid8x2+shape2": Outline(grid=8, grid_weight=2.0, shape_factor=2.0),
    "moments1+shape2": Outline(moments=True, shape_factor=2.0),
    "moments2-sized+shape2": Outline(moments=True, moment_weight=2.0, sized=True,
                                     shape_factor=2.0),
    "rays16+shape2": Outline(rays=16, shape_factor=2.0),
}
# How the recommendation is picked, written before the fourth round was run: the variant
# flagging most of the near shapes among those that keep clean test images and every
# benign family but the framed ones (margin, bed-edge: flagged by the shipped part too) at
# most 0.02 flagged, unseen colours and two-object scenes at least 0.99 and unseen dev shapes
# at least as v1; ties go to the earlier (simpler) variant.
PICK = {"clean": 0.0, "benign_worst": 0.02, "colour_two": 0.99}


def _suites(per_suite: int) -> list[tuple[str, str, list]]:
    out = []
    for spec, kind in suite_kinds("dev"):
        items = sample(unique_images(load(spec)), per_suite, seed=2)
        out.append((spec, kind, items))
    return out


def _eligible(flags: dict[str, np.ndarray], kinds: dict[str, str], v1_shape_dev: float
              ) -> bool:
    """Whether a variant's flags meet `PICK`."""
    benign = [f.mean() for s, f in flags.items() if kinds[s] == "benign" and not _framed(s)]
    return (flags["easyvqa:test"].mean() <= PICK["clean"]
            and max(benign) <= PICK["benign_worst"]
            and min(flags["render:colour-dev"].mean(), flags["render:two"].mean())
            >= PICK["colour_two"]
            and flags["render:shape-dev"].mean() >= v1_shape_dev)


def _summary(name: str, outline: Outline | None, flags: dict[str, np.ndarray],
             kinds: dict[str, str], shapes: np.ndarray, ms: float) -> str:
    framed = {s: f.mean() for s, f in flags.items() if kinds[s] == "benign" and _framed(s)}
    benign = {s: f.mean() for s, f in flags.items() if kinds[s] == "benign" and not _framed(s)}
    worst = max(benign, key=benign.get)
    harmful = np.mean([f.mean() for s, f in flags.items() if kinds[s] == "harmful"])
    near = flags[NEAR]
    per = " / ".join(f"{near[shapes == s].mean():.2f}" for s in SHAPE_ORDER)
    dim = "94" if outline is None else str(94 + 3 * outline.dim)
    return (f"| {name} | {outline.text() if outline else 'none (shipped)'} | {dim} | "
            f"{flags['easyvqa:test'].mean():.3f} | {np.mean(list(benign.values())):.3f} | "
            f"{benign[worst]:.3f} (`{worst.removeprefix('easyvqa:test')}`) | "
            f"{np.mean(list(framed.values())):.3f} | "
            f"**{near.mean():.3f}** | {per} | {flags['render:shape-dev'].mean():.3f} | "
            f"{flags['render:colour-dev'].mean():.3f} | {flags['render:two'].mean():.3f} | "
            f"{flags['render:count'].mean():.3f} | {harmful:.3f} | {ms:.2f} |")


SHAPE_ORDER = ("octagon", "ellipse", "trapezoid", "parallelogram")
# the benign families that add a grey frame or scanner-bed edge: the shipped part flags
# them whatever the outline numbers (its table above), so they are shown apart
FRAMED = ("~margin:", "~bed-edge:")


def _framed(spec: str) -> bool:
    return any(f in spec for f in FRAMED)


HEADER = ["| variant | outline numbers a slot adds | dim | clean test | benign mean | "
          "benign worst | margin, bed-edge | near shapes | octagon / ellipse / trapezoid / "
          "parallelogram | shape-dev | colour-dev | two | count | harmful mean | ms an image |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-images", type=int, default=475)
    ap.add_argument("--cal-images", type=int, default=314)
    ap.add_argument("--per-suite", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.02 / 4)
    ap.add_argument("--shipped", type=Path, default=Path("heads/embedded"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    fit, cal = fit_and_calibration_images(a.fit_images, a.cal_images)
    aug = per_family(fit, AUGMENT_FAMILIES, len(fit), 200)
    fit_ims = [it.image() for it in fit + aug]
    cal_ims = [it.image() for it in cal]
    suites = _suites(a.per_suite)
    ims = {spec: [it.image() for it in items] for spec, _, items in suites}
    kinds = {spec: kind for spec, kind, _ in suites}
    near_items = next(items for spec, _, items in suites if spec == NEAR)
    shapes = np.array([it.scene.objects[0].shape for it in near_items])

    lines = ["# Outline descriptors for near unseen shapes (development study)", "",
             f"    {COMMAND}", "",
             "Development suites only ([suites.md](suites.md)); `render:shape-near-dev` "
             "(octagon, ellipse, trapezoid, parallelogram) was added for this study because "
             "`shape-dev`'s star and cross are far from every training outline. What the "
             "shipped rule does on it (the actor's accuracy, released share, wrong among "
             "released): [near-shapes-dev-eval.md](near-shapes-dev-eval.md). Nothing here "
             "changes the shipped heads; the pick is for the next refit.", ""]
    lines += _shipped(a, ims, kinds, shapes)
    lines += ["", "## Every variant tried, refitted on the study's images", "",
              f"Each variant fitted on {len(fit)} `easyvqa:heldout` images + {len(aug)} "
              f"benign re-encodings ({', '.join(AUGMENT_FAMILIES)}), calibrated on "
              f"{len(cal)} other images; flagged: share of a suite's {a.per_suite} images "
              f"with p < {a.alpha:.4f}. Benign: the {sum(k == 'benign' for k in kinds.values())}"
              " development benign suites (8 transform families at severities 1, 3, 5, and "
              "`render:plain`, `nosuper`, `size128`); harmful: the 12 development corruption "
              "suites. `ms an image`: descriptor + nearest scene, one thread.", ""] + HEADER
    results: dict[str, dict[str, np.ndarray]] = {}
    rows: dict[str, str] = {}
    for name in a.variants.split(","):
        outline = VARIANTS[name]
        t = time.perf_counter()
        part = (LayoutNovelty() if outline is None
                else outline_part(outline, "layout_knn_study")())
        part.fit(layout_descriptors(fit_ims, outline=outline))
        part.calibrate(layout_descriptors(cal_ims, outline=outline))
        fit_s = time.perf_counter() - t
        flags, secs, n = {}, 0.0, 0
        for spec, images in ims.items():
            t = time.perf_counter()
            s = part.score(layout_descriptors(images, outline=outline))
            secs += time.perf_counter() - t
            n += len(images)
            flags[spec] = part.p_values_of(s) < a.alpha
        results[name] = flags
        rows[name] = _summary(name, outline, flags, kinds, shapes, 1000 * secs / n)
        lines.append(rows[name])
        print(lines[-1], f"(fit {fit_s:.1f} s)", flush=True)
    lines += ["", f"Costs: {load_note()}."]
    if "v1" in results:
        best, pick_lines = _pick(results, rows, kinds, shapes)
        lines += pick_lines
        if best is not None:
            lines += _cost(VARIANTS[best], best, fit_ims, cal_ims, ims[NEAR] + ims[CLEAN])
            lines += NOTES
    write(lines, a.out)


CLEAN = "easyvqa:test"
NOTES = ["", "## Notes", "",
         "- The pick adds no number to the vector: the bank, the calibration images and "
         "the 94 numbers are those of version 1; the score is the larger of the distance to "
         "the nearest fitting scene and twice the distance to the nearest fitting *outline* "
         "(the same vector without each object's area and colour, "
         "`heads.layout_novelty.shape_columns`). Its card records the descriptor "
         "text with the outline, so a version-1 part is refused by its class and the other "
         "way round, by kind (`tests/test_layout_outline.py`).",
         "- Why it helps: the clean calibration tail, which sets the threshold, is made of "
         "large objects of a rare size, aspect and colour; their outlines have close "
         "neighbours among the fitting scenes. An ellipse is a circle's thumbnail at an "
         "aspect no circle has: near a circle as a whole scene (its aspect weighs 0.25), "
         "far from every outline.",
         "- Octagons stay unflagged by every variant: at 64 px an octagon of 8 … 32 px "
         "stands out of the circle in its box by 8% of its radius (0.3 … 1.3 px) at eight "
         "corners (the drawn 40-px octagon's standardised moments are within "
         "0.02 of a disc's, `tests/test_layout_outline.py`). Finer thumbnails, moments and "
         "radial profiles flagged a few octagons only at weights that also flagged benign "
         "vignetting or the recipe without supersampling.",
         "- A larger aspect weight (aspect1 rows) lowers every flag share: elongated "
         "rectangles then make the clean tail.",
         "- The framed benign families (`margin`, `bed-edge`) are flagged about 0.9 by the "
         "shipped part and by every variant: neither family is among the fit's augment "
         "families (why the frame is flagged was not examined here). That is not "
         "an outline question and this study leaves it as it is."]


def _cost(outline: Outline, name: str, fit_ims: list, cal_ims: list, images: list
          ) -> list[str]:
    """Best of three timings (ms an image) of describing and scoring `images`, version 1
    and the pick, each part fitted as above."""
    out = ["", f"Cost per image on {len(images)} images (the near shapes and the clean test "
           "images), best of three runs, one thread: describing, then scoring "
           "(nearest scene, and for the pick also nearest outline).", "",
           "| variant | describe ms | score ms | total ms |", "|---|---|---|---|"]
    for label, o in (("v1", None), (name, outline)):
        part = LayoutNovelty() if o is None else outline_part(o, "layout_knn_study")()
        part.fit(layout_descriptors(fit_ims, outline=o))
        part.calibrate(layout_descriptors(cal_ims, outline=o))
        best_d = best_s = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            x = layout_descriptors(images, outline=o)
            t1 = time.perf_counter()
            part.score(x)
            t2 = time.perf_counter()
            best_d, best_s = min(best_d, t1 - t), min(best_s, t2 - t1)
        n = len(images)
        out.append(f"| {label} | {1000 * best_d / n:.3f} | {1000 * best_s / n:.3f} | "
                   f"{1000 * (best_d + best_s) / n:.3f} |")
    return out + ["", f"({load_note()}.)"]


def _pick(results: dict, rows: dict, kinds: dict, shapes: np.ndarray
          ) -> tuple[str | None, list[str]]:
    """The variant `PICK` recommends, and the page's section on it."""
    v1_dev = results["v1"]["render:shape-dev"].mean()
    ok = [n for n, f in results.items() if _eligible(f, kinds, v1_dev)]
    if not ok:
        return None, ["", "## Recommended for the next refit", "", "No variant meets `PICK`."]
    best = max(ok, key=lambda n: (results[n][NEAR].mean(), -list(results).index(n)))
    f, base = results[best], results["v1"]
    out = ["", "## Recommended for the next refit", "",
           "Picked by the rule written before the last round (`PICK` in the study): the "
           "variant flagging most near shapes among those keeping the clean test images at "
           f"{PICK['clean']:g}, every benign development family but the framed ones at most "
           f"{PICK['benign_worst']:g}, unseen colours and two-object scenes at least "
           f"{PICK['colour_two']:g} and unseen dev shapes at least as v1. "
           f"Eligible: {', '.join(ok)}.", "", HEADER[0], HEADER[1], rows["v1"], rows[best],
           "", f"`{best}`: {VARIANTS[best].text() if VARIANTS[best] else 'the shipped one'}; "
           "per development suite, this variant and v1 (both refitted on the study's images):",
           "", "| suite | kind | v1 flagged | " + best + " flagged |", "|---|---|---|---|"]
    for spec in f:
        extra = ""
        if spec == NEAR:
            extra = " (" + ", ".join(f"{s} {f[spec][shapes == s].mean():.2f}"
                                     for s in SHAPE_ORDER) + ")"
        out.append(f"| `{spec}` | {kinds[spec]} | {base[spec].mean():.3f} | "
                   f"{f[spec].mean():.3f}{extra} |")
    return best, out


def _shipped(a: argparse.Namespace, ims: dict, kinds: dict, shapes: np.ndarray) -> list[str]:
    from heads.novelty import load_detector

    det = load_detector(a.shipped)
    part = det.parts["layout"]
    alpha = 0.02 / len(det.parts)
    out = ["## The shipped layout part", "",
           f"The layout part of `{a.shipped}` (descriptor version 1, fitted by `dualread "
           f"fit-detectors` on `easyvqa:fit`: {part.n_fit} scenes) alone, at its Bonferroni "
           f"share alpha {alpha:.4f}, on the same development images.", "",
           "| suite | kind | images | flagged |", "|---|---|---|---|"]
    for spec, images in ims.items():
        f = part.p_values_of(part.score(layout_descriptors(images))) < alpha
        extra = ""
        if spec == NEAR:
            extra = " (" + ", ".join(f"{s} {f[shapes == s].mean():.2f}"
                                     for s in SHAPE_ORDER) + ")"
        out.append(f"| `{spec}` | {kinds[spec]} | {len(images)} | {f.mean():.3f}{extra} |")
    return out


if __name__ == "__main__":
    main()
