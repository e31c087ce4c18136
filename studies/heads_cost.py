"""Where the shipped heads spend their time an item, part by part, in wall and CPU time.

    python -m studies.heads_cost --out docs/defer/bench/heads-cost.md
    python -m studies.heads_cost --budget --items 32 --out docs/defer/bench/heads-budget.md

Captures readouts of easy-VQA test items with the embedded actor, then times (median of
repeated calls, torch threads 1, numpy's BLAS on one thread as `Heads.assess` runs it)
the features, each part of the composite novelty detector (the parts that read the
image split into what they compute from it and the score) and the whole `Heads.assess`,
at batch 1 and in batches of 8. CPU time leaves out waiting for a core, not the slowdown
a loaded machine's shared caches cause: compare parts within one run.

`--budget`: also decodes the items again, three ways interleaved batch by batch (the
service's answer alone, `Actor.answer` without states; `/answer`'s batch,
`Service.answer_responses`, with the shipped detector; the same without the detector),
and prints the budget the cost target (capture ≤ 1.03 × the answer alone) leaves an item
after the readout, next to what the batch spends there, all from the same run (the
machine's speed drifts between runs, so a budget from another run would mislead).
"""

from __future__ import annotations

import argparse
import copy
import math
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
from heads.threads import one_blas_thread
from models.data import load, sample
from models.loading import load_actor

TARGET = 1.03      # issue 27: capture / answer alone at batch 1 and 8


def timed_ms(f: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median wall and process CPU milliseconds of one call of `f`."""
    f()
    wall, cpu = [], []
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        f()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return float(np.median(wall)) * 1e3, float(np.median(cpu)) * 1e3


WHOLE = "whole `Heads.assess` (with the image)"


def without_detector(heads: Heads) -> Heads:
    """The same heads (readers, τ, everything) without the novelty detector; `heads`
    itself keeps its detector."""
    bare = copy.copy(heads)
    bare.novelty = None
    return bare


def service_stages_ms(actor, heads: Heads, images: list, questions: list[str], batch: int,
                      rounds: int) -> dict[str, float]:
    """Median wall ms an item, batches of `batch`: `answer` (the answer alone, whole call),
    `answer_decode` (its decoding stage; the rest of its call builds the responses, which
    capture's readout stage does too), and for `/answer`'s batch with the shipped
    detector `decode`, `readout` and `rest` (all it spends after the readout: heads,
    detector, defer, results, with caches as decoding left them), and `rest_bare` (the
    same without the detector). The three calls are interleaved batch by batch."""
    from app.service import Service
    from app.serving import AnswerItem

    services = {"": Service.of(actor, heads), "_bare": Service.of(actor, without_detector(heads))}
    got: dict[str, list[float]] = {}

    def keep(name: str, seconds: float) -> None:
        got.setdefault(name, []).append(seconds / batch * 1e3)

    for r in range(rounds + 1):           # round 0 warms every path up
        for s in range(0, len(images) - batch + 1, batch):
            ims, qs = images[s:s + batch], questions[s:s + batch]
            t = time.perf_counter()
            res = actor.answer(ims, qs, 64, readout="none", deadlines=[math.inf] * batch)
            if r:
                keep("answer", time.perf_counter() - t)
                keep("answer_decode", res.timings.generate)
            for tag, svc in services.items():
                its = [AnswerItem(im, q, 64) for im, q in zip(ims, qs)]
                t = time.perf_counter()
                res, done = svc.answer_responses(its, [math.inf] * batch, "capture")
                rest = time.perf_counter() - t - res.timings.generate - res.timings.readout
                if any(isinstance(d, Exception) for d in done):
                    raise RuntimeError(f"an item failed: {done}")
                if r:
                    keep("rest" + tag, rest)
                    if not tag:
                        keep("decode", res.timings.generate)
                        keep("readout", res.timings.readout)
    return {name: float(np.median(v)) for name, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/heads-cost.md")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--budget", action="store_true",
                    help="also time decoding and `/answer`'s batch: the cost target's budget")
    a = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    actor = load_actor(None)
    heads = Heads.load(EMBEDDED_HEADS, actor.fingerprint)
    items = sample(load("easyvqa:test"), a.items, seed=1)
    ims = [it.image() for it in items]
    ros = [r.readout for r in actor.answer(ims, [it.question for it in items], 64)]
    rows = []
    stages: dict[int, dict[str, float]] = {}
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
            timed["the readers alone (`Heads.assess` without the detector)"] = \
                each(lambda r, i: heads.assess(r, i, novelty=False))
            timed[WHOLE] = each(heads.assess)
            for name, fn in timed.items():
                with one_blas_thread():     # as `Heads.assess` runs them
                    wall, cpu = timed_ms(fn, a.rounds)
                rows.append((b, name, wall / n, cpu / n))
            if a.budget:      # decodes again: only where the budget is asked for
                stages[b] = service_stages_ms(actor, heads, ims,
                                              [it.question for it in items], b,
                                              max(1, a.rounds // 2))
    load_after = os.getloadavg()
    flags = (" --budget" if a.budget else "") + f" --items {a.items} --rounds {a.rounds}"
    lines = [f"Command: `python -m studies.heads_cost{flags} --out {a.out}`  ",
             f"Load average (1/5/15 min) before {[round(v, 2) for v in load_before]}, after "
             f"{[round(v, 2) for v in load_after]}; {a.items} easy-VQA test items, torch "
             f"threads 1, numpy's BLAS on one thread (as `Heads.assess` runs), median of "
             f"{a.rounds} rounds, wall and process CPU time (all threads).", "",
             "| batch | what | wall ms an item | CPU ms an item |", "|---|---|---|---|"]
    lines += [f"| {b} | {name} | {wall:.2f} | {cpu:.2f} |" for b, name, wall, cpu in rows]
    if stages:
        lines += budget_lines(stages)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def budget_lines(stages: dict[int, dict[str, float]]) -> list[str]:
    """The budget table. Capture ≤ TARGET × the answer alone, with decoding with the state
    capture counted as costing what the answer alone's does (its own column says what it
    cost), leaves for everything after capture's readout stage
        TARGET × answer − answer_decode − readout
      = (TARGET − 1) × answer − (readout − (answer − answer_decode)),
    the answer alone's own response building (answer − answer_decode) being part of
    capture's readout stage too. Against it: what `/answer`'s batch spends there with the
    shipped detector and without it; what the budget leaves after the batch without the
    detector is a detector's."""
    lines = ["", f"Budget: capture ≤ {TARGET} × the answer alone leaves, an item, "
             f"{TARGET - 1:.2f} × the answer alone − (capture's readout stage − the answer "
             "alone's own time after decoding, which builds the responses as that stage "
             "does) for everything after the readout (heads, detector, defer, results); "
             "decoding with the state capture is counted as free (its column). Rest: what "
             "`/answer`'s batch spends after the readout, with the shipped detector and "
             "without it. Wall ms an item, medians, the three calls interleaved batch by "
             "batch in this run.", "",
             "| batch | answer alone | its time after decoding | decoding with capture − "
             "without | readout | budget | rest | × budget | rest without the detector | "
             "left for a detector | the detector |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, st in sorted(stages.items()):
        after = st["answer"] - st["answer_decode"]
        left = (TARGET - 1) * st["answer"] - (st["readout"] - after)
        ratio = f"{st['rest'] / left:.1f}" if left > 0 else "budget ≤ 0"
        lines.append(f"| {b} | {st['answer']:.1f} | {after:.2f} | "
                     f"{st['decode'] - st['answer_decode']:+.2f} | {st['readout']:.2f} | "
                     f"{left:.2f} | {st['rest']:.2f} | {ratio} | {st['rest_bare']:.2f} | "
                     f"{left - st['rest_bare']:.2f} | {st['rest'] - st['rest_bare']:.2f} |")
    return lines


if __name__ == "__main__":
    main()
