"""What reading the detector's image-only parts during decoding saves, against reading
them after it, through the service's own batch call.

    python -m studies.read_ahead --out docs/defer/bench/read-ahead.md

Three modes, interleaved unit by unit (order rotated) on easy-VQA test items with the
embedded actor and heads, torch threads 1: the answer alone (`Actor.answer`, no states
kept), `Service.answer_batch` as served (the pixel and layout parts read on a worker while
the actor decodes) and the same call with that worker replaced by nothing (every part read
after decoding, as before). Each mode's seconds an item over the answer alone's, with a
paired bootstrap 95% CI over units, at batch 1 and in batches of 8. Wall-clock time: the
read-ahead uses a second core when one is free, so the machine's load is printed with it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from app.service import Service
from app.serving import AnswerItem
from heads.dualread import EMBEDDED_HEADS, Heads
from models.data import load, sample
from models.loading import load_actor

MODES = ("answer", "after", "ahead")


class _NoWorker:
    """Stands in for the service's image worker: nothing is read ahead."""

    def submit(self, *args: object) -> None:
        return None


def ratio_ci(num: list[float], den: list[float], seed: int = 0) -> tuple[float, float, float]:
    """median(num) / median(den), with a bootstrap 95% CI resampling units in pairs."""
    a, b = np.asarray(num), np.asarray(den)
    idx = np.random.default_rng(seed).integers(0, len(a), (2000, len(a)))
    boots = np.median(a[idx], 1) / np.median(b[idx], 1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(np.median(a) / np.median(b)), float(lo), float(hi)


def timed(service: Service, mode: str, imgs: list, qs: list, tokens: int) -> float:
    """Seconds an item of one mode on one unit."""
    t = time.perf_counter()
    if mode == "answer":
        service.actor.answer(imgs, qs, tokens, readout="none", deadlines=[float("inf")] * len(imgs))
    else:
        worker = service._image_reader
        if mode == "after":
            service._image_reader = _NoWorker()
        try:
            out = service.answer_batch([AnswerItem(i, q, tokens) for i, q in zip(imgs, qs)],
                                       [float("inf")] * len(imgs))
        finally:
            service._image_reader = worker
        failed = [r for r in out if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"{len(failed)} item(s) failed: {failed[0]!r}")
    return (time.perf_counter() - t) / len(imgs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/read-ahead.md")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds at batch 8 (1 at batch 1)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    load_before, started = os.getloadavg(), time.time()
    actor = load_actor(None)
    service = Service.of(actor, Heads.load(EMBEDDED_HEADS, actor.fingerprint))
    items = sample(load("easyvqa:test"), a.items, seed=2)
    imgs, qs = [it.image() for it in items], [it.question for it in items]
    lines = []
    for b, rounds in ((1, 1), (8, a.rounds)):
        units = list(range(0, len(items) - b + 1, b))
        for m in MODES:            # warm-up: lazy initialisation falls on no mode
            timed(service, m, imgs[:b], qs[:b], a.max_new_tokens)
        sec: dict[str, list[list[float]]] = {m: [[] for _ in units] for m in MODES}
        n = 0
        for _ in range(rounds):
            for u, s in enumerate(units):
                for m in MODES[n % 3:] + MODES[:n % 3]:
                    sec[m][u].append(timed(service, m, imgs[s:s + b], qs[s:s + b],
                                           a.max_new_tokens))
                n += 1
        per_unit = {m: [float(np.mean(v)) for v in sec[m]] for m in MODES}
        row = [f"| {b} | {len(units)} × {rounds} | "
               f"{1e3 * np.median(per_unit['answer']):.1f}"]
        for m in ("after", "ahead"):
            r, lo, hi = ratio_ci(per_unit[m], per_unit["answer"])
            row.append(f"{1e3 * np.median(per_unit[m]):.1f} | {r:.3f} [{lo:.3f}, {hi:.3f}]")
        r, lo, hi = ratio_ci(per_unit["ahead"], per_unit["after"])
        lines.append(" | ".join(row) + f" | {r:.3f} [{lo:.3f}, {hi:.3f}] |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([
        "# Reading the image parts during decoding",
        "",
        f"`python -m studies.read_ahead --out {a.out} --items {a.items} --rounds {a.rounds}`; "
        f"load average (1/5/15 min) {', '.join(f'{v:.2f}' for v in load_before)} before, "
        f"{', '.join(f'{v:.2f}' for v in os.getloadavg())} after; "
        f"wall {time.time() - started:.0f} s. Median ms an item; ratios to the answer alone "
        "(and ahead over after) with paired bootstrap 95% CIs over units.",
        "",
        "| batch | units × rounds | answer alone | read after decoding | × answer | "
        "read during decoding | × answer | during / after |",
        "|---|---|---|---|---|---|---|---|",
        *lines, ""]))
    print(out.read_text())


if __name__ == "__main__":
    main()
