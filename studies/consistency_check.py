"""Does a wrong answer lower the confidence because it contradicts the image, or only the
response's own rationale? (Measurement only; nothing is fitted here.)

    python -m studies.consistency_check [--data easyvqa:test] [--limit 500] [--cache cache]
                                      [--out docs/consistency-check]

On items the actor answered correctly, three trajectories per item are scored with the
shipped heads: its own response, the same response with the answer tag flipped (the TGS
probe's rule: the rationale now disagrees with the answer), and, for colour and shape
answers, the same wrong word written everywhere in the response (rationale and answer
agree; only the image disagrees), replayed teacher-forced through the actor.

`penalty` in the report: the consistency term itself (`consistency_log_prob`, nats, floored
at −CONSISTENCY_FLOOR) on every item's own answer, wrong and right apart, and on the
answer-flipped replays: its quantiles, the share it leaves alone (0) and the share at the
floor, and the share of DualRead ≥ τ (released) with the term and with it set to 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from clients.probes.text import flip_answer
from heads import registry
from heads.calibration import fuse
from heads.collect import Collector
from heads.dualread import Heads
from heads.features import extract
from heads.methods.dualread import (
    CONSISTENCY_FLOOR,
    FLIP_PASS,
    consistency_log_prob,
    p_post,
    p_pre,
)
from studies import command_line
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
    report["penalty"] = penalty_report(heads, f, tagged(ok))
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


QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def penalty_summary(term: np.ndarray, p: np.ndarray, p_free: np.ndarray, tau: float,
                    floor: float = CONSISTENCY_FLOOR) -> dict:
    """The consistency term (nats, ≤ 0) on a group of trajectories: its distribution, how
    often it is 0 (above the hinge) or at the floor, and the share of DualRead ≥ τ (the
    answer is released) with the term and without it (`p_free`: the same score with the
    term set to 0)."""
    term, p, p_free = (np.asarray(x, float) for x in (term, p, p_free))
    if not term.size:
        return {"n": 0}
    return {"n": int(term.size), "mean": round(float(term.mean()), 4),
            "quantiles": {f"{q:g}": round(float(np.quantile(term, q)), 4) for q in QUANTILES},
            "share_zero": round(float((term >= 0).mean()), 4),
            "share_at_floor": round(float((term <= -floor + 1e-9).mean()), 4),
            "share_ge_tau": round(float((p >= tau).mean()), 4),
            "share_ge_tau_without_term": round(float((p_free >= tau).mean()), 4),
            "mean_dualread_drop": round(float((p_free - p).mean()), 4)}


def _scores(heads: Heads, f: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(consistency term, DualRead, DualRead with the term set to 0) per trajectory."""
    term = torch.as_tensor(consistency_log_prob(heads, f), dtype=torch.float64)
    pre, post = p_pre(heads, f), p_post(heads, f)
    term = term.expand_as(post) if term.dim() == 0 else term
    free = torch.sigmoid(torch.logit(post) - term)
    return term.numpy(), fuse(pre, post).double().numpy(), fuse(pre, free).double().numpy()


def penalty_report(heads: Heads, own: dict, flipped: dict) -> dict:
    """The term on the actor's own answers (right and wrong, as `/answer` serves them) and
    on answer-flipped replays of its correct ones, against the heads' τ."""
    tau = float(heads.defer_threshold)
    z = own["z"].numpy().astype(bool)
    t, p, free = _scores(heads, own)
    ft, fp, ffree = _scores(heads, flipped)
    return {"tau": round(tau, 4), "floor": CONSISTENCY_FLOOR,
            "own_wrong": penalty_summary(t[~z], p[~z], free[~z], tau),
            "own_right": penalty_summary(t[z], p[z], free[z], tau),
            "answer_flips": penalty_summary(ft, fp, ffree, tau)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="easyvqa:test")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--cache", default="cache")
    ap.add_argument("--out", type=Path, default=Path("docs/consistency-check"))
    args = ap.parse_args(argv)
    command = command_line("studies.consistency_check", argv)
    rep = run(args.data, args.limit, args.cache, args.out, command)
    print(json.dumps({"mean_drop": rep["mean_drop"], "penalty": rep["penalty"]}, indent=1))


if __name__ == "__main__":
    main()
