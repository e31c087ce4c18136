"""`make bench`: what one answer costs, and what the readout adds to it.

Times `Actor.answer` on easy-VQA test items at several batch sizes with readout none
(generation only), capture (states from generate + heads) and replay (one extra
teacher-forced pass + heads). Medians over repeats, after one warm-up call.

    python -m models.bench [--actor DIR] [--device cpu|cuda] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from heads.dualread import Heads
from models.data import load, sample
from models.loading import load_actor


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actor", default=None)
    ap.add_argument("--heads", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    actor = load_actor(args.actor, device=args.device)
    heads = Heads.load(args.heads, actor.fingerprint)
    items = sample(load("easyvqa:test"), 64, seed=1)
    print(f"actor {actor.fingerprint} on {args.device}, torch threads {torch.get_num_threads()}")
    print("| batch | generate only (s/item) | + capture readout + heads | "
          "+ replay readout + heads | capture overhead | replay overhead |")
    print("|---|---|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        chunk = items[:b]
        imgs, qs = [it.image() for it in chunk], [it.question for it in chunk]

        def run(mode: str, imgs=imgs, qs=qs) -> None:
            res = actor.answer(imgs, qs, 64, readout=mode)
            if mode != "none":
                for r in res:
                    heads.confidence(r.readout)

        t_none, t_cap, t_rep = (_time(lambda m=m: run(m), args.repeats)
                                for m in ("none", "capture", "replay"))
        print(f"| {b} | {t_none / b:.4f} | {t_cap / b:.4f} | {t_rep / b:.4f} | "
              f"{t_cap / t_none:.2f}x | {t_rep / t_none:.2f}x |")


if __name__ == "__main__":
    main()
