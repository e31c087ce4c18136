"""Does a wrong answer lower the confidence because it contradicts the image, or only the
response's own rationale? (Measurement only; nothing is fitted here.)

    python -m studies.consistency_check [--data easyvqa:test] [--limit 500] [--cache cache]
                                      [--out docs/consistency-check]

On items the actor answered correctly, three trajectories per item are scored with the
shipped heads: its own response, the same response with the answer tag flipped (the TGS
probe's rule: the rationale now disagrees with the answer), and, for colour and shape
answers, the same wrong word written everywhere in the response (rationale and answer
agree; only the image disagrees), replayed teacher-forced through the actor.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from clients.probes.text import flip_answer
from heads import registry
from heads.collect import Collector
from heads.dualread import Heads
from heads.features import extract
from heads.methods.dualread import FLIP_PASS
from studies.flip_sweep import COLOUR_SHAPE, consistent_flip

METHODS = ("dualread", "per", "psr")


def run(data: str, limit: int, cache: str | None, out: Path, command: str) -> dict:
    from models.data import load, sample
    from models.loading import load_actor

    actor = load_actor(None)
    heads = Heads.load(actor_fingerprint=actor.fingerprint)
    items = sample(load(data), limit)
    col = Collector(actor, cache, kappa=heads.kappa)
    f, meta = col.run(items, passes=(FLIP_PASS,), label="readouts and answer flips")
    ok = (f["flip_ok"].bool() & (f["z"] == 1)).nonzero().flatten()
    pairs = []
    for i in ok.tolist():
        a = meta["answers"][i].strip().lower()
        new = flip_answer(a, items[i].id) if a in COLOUR_SHAPE else None
        text = consistent_flip(meta["responses"][i], a, new) if new else None
        if text is not None:
            pairs.append((i, text))
    rows = []
    for s in range(0, len(pairs), 32):
        part = pairs[s: s + 32]
        res = actor.score([items[i].image() for i, _ in part],
                          [items[i].question for i, _ in part], [t for _, t in part])
        rows += [extract(r.readout, heads.kappa) for r in res]
    idx = torch.tensor([i for i, _ in pairs], dtype=torch.long)

    def tagged(sel: torch.Tensor) -> dict:
        g = {k: v[sel] for k, v in f.items()}
        g["h_close"], g["phi"] = f["flip_h_close"][sel], f["flip_phi"][sel]
        return g

    own_all, own_cs = ({k: v[sel] for k, v in f.items()} for sel in (ok, idx))
    consistent = {k: torch.stack([r[k] for r in rows]) for k in rows[0]} if rows else {}
    report: dict = {"command": command, "data": data, "limit": limit,
                    "heads": heads.card.get("git_commit"), "answer_pairs": len(ok),
                    "colour_shape_pairs": len(pairs), "mean_drop": {}}
    for m in METHODS:
        score = registry.get(m).score
        d = {"tag_flip_all": float(np.mean(score(heads, own_all) - score(heads, tagged(ok))))}
        if rows:
            base = score(heads, own_cs)
            d["tag_flip_colour_shape"] = float(np.mean(base - score(heads, tagged(idx))))
            d["consistent_flip_colour_shape"] = float(np.mean(base - score(heads, consistent)))
        report["mean_drop"][m] = {k: round(v, 4) for k, v in d.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="easyvqa:test")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--cache", default="cache")
    ap.add_argument("--out", type=Path, default=Path("docs/consistency-check"))
    args = ap.parse_args(argv)
    command = "python -m studies.consistency_check " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    rep = run(args.data, args.limit, args.cache, args.out, command.strip())
    print(json.dumps(rep["mean_drop"], indent=1))


if __name__ == "__main__":
    main()
