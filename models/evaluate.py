"""Actor-side evaluation: accuracy by answer type, format, and reliance on the image."""

from __future__ import annotations

import subprocess
from collections import defaultdict
from pathlib import Path

from rich.progress import Progress

from models.canon import is_correct
from models.counterfactuals import BLANK_RGB, blank_image
from models.counterfactuals import BLANK_SIZE as BLANK
from models.data import Item

__all__ = ["BLANK", "BLANK_RGB", "blank_image", "evaluate_actor", "git_commit", "run_items",
           "summarise"]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_items(actor, items: list[Item], blank: bool = False, batch: int = 32,
              max_new_tokens: int = 64, label: str = "answering") -> list[dict]:
    """Greedy answers (no readout) with correctness, in batches, with a progress bar."""
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=len(items))
        for s in range(0, len(items), batch):
            chunk = items[s: s + batch]
            imgs = [blank_image() if blank else it.image() for it in chunk]
            res = actor.answer(imgs, [it.question for it in chunk], max_new_tokens,
                               readout="none")
            for it, r in zip(chunk, res):
                rows.append({"id": it.id, "type": it.answer_type, "answer": r.answer,
                             "correct": is_correct(r.answer, it.answer, it.options or None),
                             "well_formed": r.parsed.well_formed,
                             "verbalized": r.parsed.verbalized})
            bar.advance(task, len(chunk))
    return rows


def summarise(rows: list[dict]) -> dict:
    by = defaultdict(list)
    for r in rows:
        by[r["type"]].append(r["correct"])
    n = max(1, len(rows))
    out = {"n": len(rows), "accuracy": round(sum(r["correct"] for r in rows) / n, 4)}
    out["by_type"] = {k: round(sum(v) / len(v), 4) for k, v in sorted(by.items())}
    out["well_formed"] = round(sum(r["well_formed"] for r in rows) / max(1, len(rows)), 4)
    return out


def evaluate_actor(actor, items: list[Item], batch: int = 32) -> dict:
    """Card metrics: real-image accuracy, blank-image accuracy, their gap (docs/method.md §5)."""
    real = summarise(run_items(actor, items, batch=batch, label="real images"))
    blank = summarise(run_items(actor, items, blank=True, batch=batch, label="blank images"))
    return {
        "real": real,
        "blank": blank,
        "blank_drop": round(real["accuracy"] - blank["accuracy"], 4),
        "chance": {"color": 1 / 8, "shape": 1 / 3},
    }
