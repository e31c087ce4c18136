"""Measurement study: DualRead under generic corruptions, and which novelty signal makes
`defer` hold under shift (docs/method.md §8).

    python -m studies.shift_study [--out docs/shift-study] [--cache cache/shift-study]

Data (all readouts cached; a rerun only analyses):
- clean fitting data: a sample of `easyvqa:heldout` (what the shipped heads were fitted on),
  cut with the heads' own image-disjoint rule (heads.fit.image_split): reader / temperature
  / defer. Novelty scorers are fitted on the reader split and calibrated on the defer split.
- a corrupted pool: other `easyvqa:heldout` items, every family at severities 1–5, used only
  for choosing a scorer and for fitting corruption-augmented heads, family held out.
- test: a sample of `easyvqa:test`, clean and under every family at severities 1, 3, 5
  (the same items in every cell, so cells are paired).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heads.collect import Collector
from models.data import Item, load, sample
from models.shift import FAMILIES, SEVERITIES, shift_items

TEST_SEVERITIES = (5, 3, 1)   # collected worst first: a partial run still has the target rows


class _Recorder:
    """Forwards to the actor and keeps its last answers (their readouts carry h_image)."""

    def __init__(self, actor) -> None:
        self._actor = actor
        self.last: list = []

    def __getattr__(self, name: str):
        return getattr(self._actor, name)

    def answer(self, *args, **kwargs):
        self.last = self._actor.answer(*args, **kwargs)
        return self.last


class StateCollector(Collector):
    """The heads' collector, plus the image-token states [M, D] of every readout."""

    def __init__(self, actor, cache_dir: str | Path, **kwargs) -> None:
        super().__init__(_Recorder(actor), cache_dir, **kwargs)

    def _base(self, items: list[Item]):
        tensors, meta = super()._base(items)
        states = [r.readout.h_image for r in self.actor.last]
        if len({tuple(s.shape) for s in states}) != 1:
            raise ValueError("image-token counts differ across items; this study needs one size")
        tensors["h_image"] = torch.stack(states).float()
        return tensors, meta


def item_sets(n_fit: int, n_pool: int, n_test: int, n_fit2: int = 0) -> dict[str, list[Item]]:
    """Every item set of the study, deterministic."""
    heldout = load("easyvqa:heldout")
    fit = sample(heldout, n_fit, seed=0)
    taken = {it.id for it in fit}
    rest = [it for it in heldout if it.id not in taken]
    sets: dict[str, list[Item]] = {"fit": fit}
    pooled: set[str] = set()
    for k, fam in enumerate(FAMILIES):
        # severities 1..5 in turn over the family's own sample
        base = sample(rest, n_pool, seed=100 + k)
        pooled |= {it.id for it in base}
        sets[f"pool~{fam}"] = [shift_items([it], fam, SEVERITIES[j % 5])[0]
                               for j, it in enumerate(base)]
    # more clean fitting data, clear of the pool (collected after the first part; merged)
    if n_fit2:
        sets["fit2"] = sample([it for it in rest if it.id not in pooled], n_fit2, seed=7)
    test = sample(load("easyvqa:test"), n_test, seed=1)
    sets["test"] = test
    for sev in TEST_SEVERITIES:
        for fam in FAMILIES:
            sets[f"test~{fam}:{sev}"] = shift_items(test, fam, sev)
    return sets


def collection_order(sets: dict[str, list[Item]]) -> list[str]:
    """Clean data, then the worst severity, then the pool, then milder severities."""
    first = ["fit", "test"] + [f"test~{f}:{TEST_SEVERITIES[0]}" for f in FAMILIES]
    first += ["fit2"] if "fit2" in sets else []
    pool = [k for k in sets if k.startswith("pool~")]
    return first + pool + [k for k in sets if k not in first and k not in pool]


def actor_digest(folder: Path) -> str:
    """Every file of the (small) embedded actor hashed whole, the card by its system prompt
    only: what the study's set files are keyed by, independent of other fingerprints."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        if f.name == "actor_card.json":
            h.update(repr(json.loads(f.read_text()).get("system_prompt")).encode())
        else:
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def set_file(cache: Path, name: str, digest: str, items: list[Item]) -> Path:
    """One consolidated file per item set, keyed by the actor and the item ids only, so the
    analysis does not depend on how the collector keys its shards."""
    h = hashlib.sha256("|".join([digest, *(it.id for it in items)]).encode())
    safe = name.replace("~", "_").replace(":", "")
    return cache / "sets" / f"{safe}-{h.hexdigest()[:16]}.safetensors"


def collect(sets: dict[str, list[Item]], cache: Path, available: bool = False
            ) -> dict[str, tuple[dict, dict]]:
    """Readouts of every set (or, with `available`, of the sets already collected)."""
    from models.loading import EMBEDDED_ACTOR, load_actor

    digest = actor_digest(EMBEDDED_ACTOR)
    out, col = {}, None
    for name in collection_order(sets):
        path = set_file(cache, name, digest, sets[name])
        if path.exists():
            out[name] = (load_file(str(path)), json.loads(path.with_suffix(".json").read_text()))
            continue
        if available:
            continue
        col = col or StateCollector(load_actor(), cache)
        t0 = time.perf_counter()
        feats, meta = col.run(sets[name], label=name)
        keep = {k: meta[k] for k in ("ids", "image_ids", "answers")}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in feats.items()}, str(path))
        path.with_suffix(".json").write_text(json.dumps(keep))
        out[name] = (feats, keep)
        print(f"collected {name}: {len(sets[name])} items, {time.perf_counter() - t0:.1f} s, "
              f"accuracy {feats['z'].mean():.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/shift-study")
    ap.add_argument("--cache", default="cache/shift-study")
    ap.add_argument("--n-fit", type=int, default=2000)
    ap.add_argument("--n-fit2", type=int, default=1500, help="more clean heldout items")
    ap.add_argument("--n-pool", type=int, default=250, help="corrupted heldout items per family")
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--collect-only", action="store_true")
    ap.add_argument("--available", action="store_true",
                    help="analyse the sets already cached, collect nothing")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sets = item_sets(args.n_fit, args.n_pool, args.n_test, args.n_fit2)
    data = collect(sets, Path(args.cache), args.available)
    if args.collect_only:
        return
    if "fit2" in data:
        sets["fit"] = sets["fit"] + sets.pop("fit2")
        (f1, m1), (f2, m2) = data["fit"], data.pop("fit2")
        data["fit"] = ({k: torch.cat([f1[k], f2[k]]) for k in f1},
                       {k: m1[k] + m2[k] for k in m1})
    else:
        sets.pop("fit2", None)
    from studies.shift_analysis import analyse

    argv = sys.argv[1:] if argv is None else argv
    analyse(data, sets, Path(args.out), command=" ".join(["python -m studies.shift_study", *argv]))


if __name__ == "__main__":
    main()
