"""Run the frozen actor once over items and keep what every scorer needs, cached on disk.

Shards are safetensors files of CHUNK items each, keyed by the actor fingerprint and the
item ids, so an interrupted run resumes where it stopped. Extra passes (black-image
replay for BICR, the P(True) query, K samples for SC@K / semantic uncertainty) are asked
for explicitly and cached in their own shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

from heads.features import KAPPA, extract
from models.canon import canon, is_correct
from models.data import Item

CHUNK = 64
K_SAMPLES = 8
PTRUE_PROMPT = ("{question}\nProposed answer: {answer}\n"
                "Is the proposed answer correct? Answer yes or no.")


def black_image(size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, (0, 0, 0))


def _key(actor_fp: str, items: list[Item], part: str, extra: str = "") -> str:
    h = hashlib.sha256((actor_fp + part + extra + "|".join(i.id for i in items)).encode())
    return h.hexdigest()[:20]


def ptrue_probs(actor, images, questions, answers) -> np.ndarray:
    """P(Yes) / (P(Yes) + P(No)) for the first token after a yes/no follow-up prompt."""
    qs = [PTRUE_PROMPT.format(question=q, answer=a) for q, a in zip(questions, answers)]
    probs = actor.next_token_probs(images, qs)
    tok = actor.tokenizer

    def ids(words):
        out = set()
        for w in words:
            enc = tok.encode(w, add_special_tokens=False)
            if enc:
                out.add(enc[0])
        return sorted(out)
    yes, no = ids(["yes", "Yes", " yes", " Yes"]), ids(["no", "No", " no", " No"])
    py, pn = probs[:, yes].sum(-1), probs[:, no].sum(-1)
    return (py / (py + pn).clamp_min(1e-12)).numpy()


def agreement(greedy: str, samples: list[str]) -> float:
    """Share of samples whose canonical answer equals the greedy one (invalid disagree)."""
    return float(np.mean([bool(s) and s == greedy for s in samples])) if samples else 0.0


def semantic_entropy(samples: list[str]) -> float:
    """Entropy of canonical-answer clusters, normalised by log K; invalid ones stay apart."""
    labels = [s if s else f"<invalid{k}>" for k, s in enumerate(samples)]
    counts = np.array(list(Counter(labels).values()), float)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(samples))) if len(samples) > 1 else 0.0


class Collector:
    def __init__(self, actor, cache_dir: str | Path | None, max_new_tokens: int = 64,
                 batch: int = CHUNK) -> None:
        self.actor = actor
        self.cache = Path(cache_dir) if cache_dir else None
        self.max_new_tokens = max_new_tokens
        self.batch = batch
        self.seconds: Counter = Counter()

    # ------------------------------------------------------------------ one chunk
    def _base(self, items: list[Item]) -> tuple[dict[str, torch.Tensor], dict]:
        imgs = [it.image() for it in items]
        t = time.perf_counter()
        res = self.actor.answer(imgs, [it.question for it in items], self.max_new_tokens,
                                readout="capture")
        self.seconds["generate+readout"] += time.perf_counter() - t
        feats = [extract(r.readout, KAPPA) for r in res]
        tensors = {k: torch.stack([f[k] for f in feats]) for k in feats[0]}
        tensors["z"] = torch.tensor([float(is_correct(r.answer, it.answer, it.options or None))
                                     for r, it in zip(res, items)])
        meta = {"ids": [it.id for it in items], "image_ids": [it.image_id for it in items],
                "answers": [r.answer for r in res], "canonical": [r.canonical for r in res],
                "responses": [r.text for r in res],
                "well_formed": [r.parsed.well_formed for r in res]}
        return tensors, meta

    def _bicr(self, items, meta) -> dict[str, torch.Tensor]:
        imgs = [black_image(it.image().size) for it in items]
        t = time.perf_counter()
        res = self.actor.score(imgs, [it.question for it in items], meta["responses"], cue=False)
        self.seconds["bicr"] += time.perf_counter() - t
        return {"h_close_black": torch.stack([r.readout.h_close for r in res])}

    def _ptrue(self, items, meta) -> dict[str, torch.Tensor]:
        t = time.perf_counter()
        p = ptrue_probs(self.actor, [it.image() for it in items],
                        [it.question for it in items], meta["answers"])
        self.seconds["ptrue"] += time.perf_counter() - t
        return {"ptrue": torch.tensor(p)}

    def _samples(self, items, meta) -> dict[str, torch.Tensor]:
        t = time.perf_counter()
        rows = self.actor.sample([it.image() for it in items], [it.question for it in items],
                                 K_SAMPLES, temperature=1.0, max_new_tokens=self.max_new_tokens,
                                 seed=0)
        self.seconds["samples"] += time.perf_counter() - t
        out = {f"sc{k}": [] for k in (2, 4, 8)}
        out["semantic"] = []
        for greedy, samples in zip(meta["canonical"], rows):
            canon_s = [canon(s.answer) for s in samples]
            for k in (2, 4, 8):
                out[f"sc{k}"].append(agreement(greedy, canon_s[:k]))
            out["semantic"].append(semantic_entropy(canon_s))
        return {k: torch.tensor(v) for k, v in out.items()}

    # ------------------------------------------------------------------ driver
    def run(self, items: list[Item], extras: tuple[str, ...] = (), label: str = "readouts"
            ) -> tuple[dict[str, torch.Tensor], dict]:
        """Features (stacked over items) and metadata, with any extras requested."""
        parts = {"bicr": self._bicr, "ptrue": self._ptrue, "samples": self._samples}
        chunks = [items[s: s + self.batch] for s in range(0, len(items), self.batch)]
        all_t: list[dict[str, torch.Tensor]] = []
        all_m: list[dict] = []
        columns = [TextColumn("{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total} items"), TimeRemainingColumn()]
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task(label, total=len(items))
            for chunk in chunks:
                tensors, meta = self._cached(chunk, "base", lambda c=chunk: self._base(c))
                for name in extras:
                    more, _ = self._cached(chunk, name,
                                           lambda c=chunk, m=meta, n=name: (parts[n](c, m), {}))
                    tensors = {**tensors, **more}
                all_t.append(tensors)
                all_m.append(meta)
                bar.advance(task, len(chunk))
        feats = {k: torch.cat([t[k] for t in all_t]) for k in all_t[0]}
        meta = {k: sum((m[k] for m in all_m), []) for k in all_m[0]}
        return feats, meta

    def _cached(self, chunk: list[Item], part: str, compute):
        if self.cache is None:
            return compute()
        key = _key(self.actor.fingerprint, chunk, part, str(self.max_new_tokens))
        path = self.cache / f"{part}-{key}.safetensors"
        side = path.with_suffix(".json")
        if path.exists() and side.exists():
            return load_file(str(path)), json.loads(side.read_text())
        tensors, meta = compute()
        self.cache.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        side.write_text(json.dumps(meta))
        return tensors, meta
