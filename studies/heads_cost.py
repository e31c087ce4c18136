"""Where the shipped heads spend their time an item, part by part, in process CPU time.

    python -m studies.heads_cost --out docs/defer/bench/heads-cost.md

Captures readouts of easy-VQA test items with the embedded actor, then times (median of
repeated calls, torch threads 1) the features, each part of the composite novelty
detector (the parts that read the image split into what they compute from it and
the score) and the whole `Heads.assess`,
at batch 1 and in batches of 8. CPU time leaves out waiting for a core, not the slowdown
a loaded machine's shared caches cause: compare parts within one run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from heads.dualread import EMBEDDED_HEADS, Heads
from heads.features import extract_many
from heads.novelty import IMAGE_FEATURES, features
from heads.pixel_novelty import pixel_descriptors
from models.data import load, sample
from models.loading import load_actor


def cpu_ms(f: Callable[[], object], rounds: int) -> float:
    f()
    out = []
    for _ in range(rounds):
        t = time.process_time()
        f()
        out.append(time.process_time() - t)
    return float(np.median(out)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/heads-cost.md")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    actor = load_actor(None)
    heads = Heads.load(EMBEDDED_HEADS, actor.fingerprint)
    items = sample(load("easyvqa:test"), a.items, seed=1)
    ims = [it.image() for it in items]
    ros = [r.readout for r in actor.answer(ims, [it.question for it in items], 64)]
    rows = []
    with torch.inference_mode():
        for b in (1, 8):
            groups = [(ros[s:s + b], ims[s:s + b]) for s in range(0, len(ros) - b + 1, b)]

            def each(fn: Callable, groups: list = groups) -> Callable[[], None]:
                return lambda: [fn(r, i) for r, i in groups]

            n = len(groups) * b
            timed = {"features (extract_many)": each(lambda r, i: extract_many(r, heads.kappa)),
                     "pixel descriptors": each(lambda r, i: pixel_descriptors(i))}
            # what the other parts that read the decoded image compute from it (the
            # layout part's vectors)
            for name in heads.novelty.image_features:
                if name in IMAGE_FEATURES:
                    timed[f"image feature `{name}`"] = \
                        each(lambda r, i, f=IMAGE_FEATURES[name]: f(i))
            for name, part in heads.novelty.parts.items():
                xs = [features(part.feature, heads.with_images(extract_many(r, heads.kappa), i))
                      for r, i in groups]
                timed[f"novelty part `{name}` ({part.kind}), score"] = \
                    lambda part=part, xs=xs: [part.score(x) for x in xs]
            timed["whole `Heads.assess` (with the image)"] = each(heads.assess)
            for name, fn in timed.items():
                rows.append((b, name, cpu_ms(fn, a.rounds) / n))
    load_after = os.getloadavg()
    lines = ["Command: `python -m studies.heads_cost --out " + a.out + "`  ",
             f"Load average (1/5/15 min) before {[round(v, 2) for v in load_before]}, after "
             f"{[round(v, 2) for v in load_after]}; {a.items} easy-VQA test items, torch "
             "threads 1, process CPU time (median of "
             f"{a.rounds} rounds).", "",
             "| batch | what | CPU ms an item |", "|---|---|---|"]
    lines += [f"| {b} | {name} | {ms:.2f} |" for b, name, ms in rows]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
