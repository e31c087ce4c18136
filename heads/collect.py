"""Run the frozen actor once over items and keep what every scorer needs, cached on disk.

Shards are safetensors files of CHUNK items each. A shard's key holds the actor
fingerprint, the item ids, the settings that change its content (max_new_tokens, κ) and
a version of the code that computed it: `FEATURE_SCHEMA` plus a hash of the feature code
for the natural pass, each pass's `version` plus a hash of its code for extra passes
(`heads.passes`). An interrupted run resumes where it stopped; a changed feature or pass
recomputes instead of silently reusing stale readouts.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

import heads.features as features_module
import models.canon as canon_module
from heads.features import FEATURE_SCHEMA, KAPPA, extract
from heads.passes import (  # noqa: F401  (older import site of these names)
    K_SAMPLES,
    PASSES,
    PTRUE_PROMPT,
    agreement,
    ptrue_probs,
    resolve,
    semantic_entropy,
    source_hash,
)
from models.canon import is_correct
from models.counterfactuals import black_image  # noqa: F401  (older import site)
from models.data import Item

CHUNK = 64
Tensors = dict[str, torch.Tensor]


def _key(actor_fp: str, items: list[Item], part: str, extra: str = "") -> str:
    h = hashlib.sha256((actor_fp + part + extra + "|".join(i.id for i in items)).encode())
    return h.hexdigest()[:20]


class Collector:
    def __init__(self, actor, cache_dir: str | Path | None, max_new_tokens: int = 64,
                 batch: int = CHUNK, kappa: float = KAPPA) -> None:
        self.actor = actor
        self.cache = Path(cache_dir) if cache_dir else None
        self.max_new_tokens = max_new_tokens
        self.batch = batch
        self.kappa = kappa
        self.seconds: Counter = Counter()

    # ------------------------------------------------------------------ one chunk
    def _base(self, items: list[Item]) -> tuple[Tensors, dict]:
        imgs = [it.image() for it in items]
        t = time.perf_counter()
        res = self.actor.answer(imgs, [it.question for it in items], self.max_new_tokens,
                                readout="capture")
        self.seconds["generate+readout"] += time.perf_counter() - t
        feats = [extract(r.readout, self.kappa) for r in res]
        tensors = {k: torch.stack([f[k] for f in feats]) for k in feats[0]}
        tensors["z"] = torch.tensor([float(is_correct(r.answer, it.answer, it.options or None))
                                     for r, it in zip(res, items)])
        meta = {"ids": [it.id for it in items], "image_ids": [it.image_id for it in items],
                "answers": [r.answer for r in res], "canonical": [r.canonical for r in res],
                "responses": [r.text for r in res],
                "well_formed": [r.parsed.well_formed for r in res]}
        return tensors, meta

    def _extra(self, name: str, items: list[Item], meta: dict) -> Tensors:
        t = time.perf_counter()
        out = PASSES[name].run(self, items, meta)
        self.seconds[name] += time.perf_counter() - t
        return out

    def versions(self, part: str) -> str:
        """What, besides the items and the actor, a shard of `part` depends on."""
        settings = f"mnt={self.max_new_tokens}|kappa={self.kappa!r}"
        if part == "base":
            # a subclass that adds base features gets shards of its own
            code = source_hash(features_module, canon_module, Collector._base,
                               type(self)._base)
            return f"schema={FEATURE_SCHEMA}|code={code}|{settings}"
        p = PASSES[part]
        return f"schema={FEATURE_SCHEMA}|v={p.version}|code={p.code_hash()}|{settings}"

    # ------------------------------------------------------------------ driver
    def run(self, items: list[Item], extras: tuple[str, ...] = (), label: str = "readouts",
            passes: tuple[str, ...] = ()) -> tuple[Tensors, dict]:
        """Features (stacked over items) and metadata, with the extra passes requested.

        `passes` names passes of `heads.passes`; `extras` is the older spelling (it also
        accepts the old names `bicr` and `ptrue`). Both are merged.
        """
        wanted = resolve(tuple(passes) + tuple(extras))
        chunks = [items[s: s + self.batch] for s in range(0, len(items), self.batch)]
        all_t: list[Tensors] = []
        all_m: list[dict] = []
        columns = [TextColumn("{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total} items"), TimeRemainingColumn()]
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task(label, total=len(items))
            for chunk in chunks:
                tensors, meta = self._cached(chunk, "base", lambda c=chunk: self._base(c))
                for name in wanted:
                    more, _ = self._cached(
                        chunk, name, lambda c=chunk, m=meta, n=name: (self._extra(n, c, m), {}))
                    tensors = {**tensors, **more}
                all_t.append(tensors)
                all_m.append(meta)
                bar.advance(task, len(chunk))
        feats = {k: torch.cat([t[k] for t in all_t]) for k in all_t[0]}
        meta = {k: sum((m[k] for m in all_m), []) for k in all_m[0]}
        return feats, meta

    def _cached(self, chunk: list[Item], part: str,
                compute: Callable[[], tuple[Tensors, dict]]) -> tuple[Tensors, dict]:
        if self.cache is None:
            return compute()
        key = _key(self.actor.fingerprint, chunk, part, self.versions(part))
        path = self.cache / f"{part}-{key}.safetensors"
        side = path.with_suffix(".json")
        if path.exists() and side.exists():
            return load_file(str(path)), json.loads(side.read_text())
        tensors, meta = compute()
        self.cache.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        side.write_text(json.dumps(meta))
        return tensors, meta
