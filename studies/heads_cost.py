"""Where the shipped heads spend their time an item, part by part, in wall and CPU time.

    python -m studies.heads_cost --out docs/defer/bench/heads-cost.md
    python -m studies.heads_cost --bench docs/bench/bench.json \
        --out docs/defer/bench/heads-budget.md

Captures readouts of easy-VQA test items with the embedded actor, then times (median of
repeated calls, torch threads 1) the features, each part of the composite novelty
detector (the parts that read the image split into what they compute from it and
the score) and the whole `Heads.assess`,
at batch 1 and in batches of 8. CPU time leaves out waiting for a core, not the slowdown
a loaded machine's shared caches cause: compare parts within one run; it also counts
every BLAS thread, so it can exceed the wall time.

`--bench`: a `dualread bench` run's bench.json. Its answer alone (the service's decoding,
no DualRead) and readout assembly, per item at each batch, give the budget the cost
target (capture ≤ 1.03 × the answer alone) leaves for everything after the readout; the
study then decodes the items again through `Service.answer_responses`, with the shipped
detector and without it, and times what the batch spends after the readout.
"""

from __future__ import annotations

import argparse
import copy
import json
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


def budgets(bench: dict) -> dict[int, tuple[float, float, float]]:
    """Per batch size: the answer alone and the readout (ms an item) of a bench run, and
    what the target leaves after them, TARGET × answer − answer − readout (decoding with
    the state capture taken as costing what the answer alone's decoding does)."""
    out = {}
    for run in bench["in_process"].values():
        answer = run["seconds_per_item"]["answer"] * 1e3
        readout = run["readout_seconds_per_item"] * 1e3
        out[run["batch"]] = (answer, readout, (TARGET - 1) * answer - readout)
    return out


WHOLE = "whole `Heads.assess` (with the image)"
REST = "the rest of `/answer`'s batch after the readout (`Service.answer_responses`)"
BARE = REST.replace("(`", "without the detector (`")


def service_rest_ms(actor, heads: Heads, images: list, questions: list[str], batch: int,
                    rounds: int) -> tuple[float, float]:
    """Median wall ms an item of what `/answer`'s batch spends after decoding and the
    readout (heads, detector, defer, results, caches as decoding left them), with the
    shipped detector and without it, the two interleaved batch by batch."""
    from app.service import Service
    from app.serving import AnswerItem

    bare = copy.copy(heads)
    bare.novelty = None
    services = {"full": Service.of(actor, heads), "bare": Service.of(actor, bare)}
    out: dict[str, list[float]] = {"full": [], "bare": []}
    starts = range(0, len(images) - batch + 1, batch)
    for r in range(rounds + 1):           # round 0 warms both up
        for s in starts:
            for name, svc in services.items():
                its = [AnswerItem(im, q, 64) for im, q in
                       zip(images[s:s + batch], questions[s:s + batch])]
                t = time.perf_counter()
                res, done = svc.answer_responses(its, [math.inf] * batch, "capture")
                rest = time.perf_counter() - t - res.timings.generate - res.timings.readout
                if any(isinstance(d, Exception) for d in done):
                    raise RuntimeError(f"an item failed: {done}")
                if r:
                    out[name].append(rest / batch * 1e3)
    return float(np.median(out["full"])), float(np.median(out["bare"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/heads-cost.md")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--bench", help="a `dualread bench` bench.json: add the budget rows")
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
            timed["the readers alone (`Heads.assess` without the detector)"] = \
                each(lambda r, i: heads.assess(r, i, novelty=False))
            timed[WHOLE] = each(heads.assess)
            for name, fn in timed.items():
                with one_blas_thread():     # as `Heads.assess` runs them
                    wall, cpu = timed_ms(fn, a.rounds)
                rows.append((b, name, wall / n, cpu / n))
            if a.bench:       # decodes again: only where the budget is asked for
                full, bare = service_rest_ms(actor, heads, ims, [it.question for it in items],
                                             b, max(1, a.rounds // 5))
                rows += [(b, REST, full, float("nan")), (b, BARE, bare, float("nan"))]
    load_after = os.getloadavg()
    flags = f" --items {a.items} --rounds {a.rounds}" + (f" --bench {a.bench}" if a.bench else "")
    lines = [f"Command: `python -m studies.heads_cost{flags} --out {a.out}`  ",
             f"Load average (1/5/15 min) before {[round(v, 2) for v in load_before]}, after "
             f"{[round(v, 2) for v in load_after]}; {a.items} easy-VQA test items, torch "
             f"threads 1, numpy's BLAS on one thread (as `Heads.assess` runs), median of "
             f"{a.rounds} rounds, wall and process CPU time (all threads).", "",
             "| batch | what | wall ms an item | CPU ms an item |", "|---|---|---|---|"]
    lines += [f"| {b} | {name} | {wall:.2f} | " + ("–" if math.isnan(cpu) else f"{cpu:.2f}")
              + " |" for b, name, wall, cpu in rows]
    if a.bench:
        lines += budget_lines(a.bench, rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def budget_lines(path: str, rows: list[tuple[int, str, float, float]]) -> list[str]:
    """The budget rows: what the cost target leaves an item after decoding and the
    readout, against what the service spends there (measured here) with the detector and
    without it; what is left of the budget without the detector is the detector's."""
    bench = json.loads(Path(path).read_text())
    wall = {(b, name): w for b, name, w, _ in rows}
    lines = ["", f"Budget from `{path}` (commit {str(bench.get('git_commit'))[:8]}): "
             f"capture ≤ {TARGET} × the answer alone leaves, an item, "
             f"{TARGET - 1:.2f} × the answer alone − the readout for everything after it "
             "(heads, detector, defer, results). Rest: what `/answer`'s batch spends there, "
             "measured here, with the shipped detector and without it.", "",
             "| batch | answer alone ms | readout ms | budget ms | rest ms | × budget | "
             "rest without the detector ms | left for the detector ms | the detector ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, (answer, readout, left) in sorted(budgets(bench).items()):
        if (b, REST) not in wall:
            continue
        rest, bare = wall[(b, REST)], wall[(b, BARE)]
        ratio = f"{rest / left:.1f}" if left > 0 else "budget ≤ 0"
        lines.append(f"| {b} | {answer:.1f} | {readout:.2f} | {left:.2f} | {rest:.2f} | "
                     f"{ratio} | {bare:.2f} | {left - bare:.2f} | {rest - bare:.2f} |")
    return lines


if __name__ == "__main__":
    main()
