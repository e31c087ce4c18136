"""Re-certification measured on the shipped actor and heads (docs/operations.md).

Serves every item of a clean, a benign and a harmful stream through `Service` (what
`/answer` runs), grades the answers with the one grader (`models.canon.is_correct`), and
keeps what a served answer leaves for re-certification (`heads.recert.Served`). Then, for
`--splits` random splits of each stream into a window of `--window` verdicts and the next
`--next` items, certifies a rule on the window (`heads.recert.certify`, as the service
does) and applies it to the next items: released share and risk among released, against
the shipped rule's on clean items. Poisoned windows mark a share of the wrong answers
correct before certifying; the next items are judged on their true labels.

    python -m heads.recert_study --out /tmp/recert --window 1000 --next 500
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from heads.defer import clopper_pearson_upper
from heads.recert import Served, Verdict, certify, dualread_at

# stream: (data spec, items); noise:3 is answered as well as clean items (docs/eval-shift:
# accuracy 0.895 vs 0.89) and every item of it was flagged by the retired image check
STREAMS = {"clean": ("easyvqa:test", 300), "benign": ("easyvqa:test~noise:3", 1500),
           "harmful": ("easyvqa:test~contrast:5", 400)}


def collect(spec: str, n: int, seed: int, batch: int = 16, done: list[dict] | None = None
            ) -> list[dict]:
    """The first `n` items of a seeded permutation of `spec`, served and graded; the rows
    in `done` (an earlier, shorter run with the same seed) are kept, not served again."""
    from app.service import Service
    from app.serving import AnswerItem
    from models.canon import is_correct
    from models.data import load

    items = load(spec)
    done = list(done or [])[:n]
    pick = np.random.default_rng(seed).permutation(len(items))[len(done):n]
    svc = Service(None, None)
    rows = done
    try:
        for s in range(0, len(pick), batch):
            its = [items[i] for i in pick[s: s + batch]]
            res = svc.answer_batch([AnswerItem(it.image(), it.question, 64) for it in its],
                                   [time.monotonic() + 600] * len(its))
            print(f"{spec}: {s + len(its)}/{len(pick)}", flush=True)
            for it, r in zip(its, res):
                if isinstance(r, Exception) or r.served is None:
                    continue
                rows.append({"id": it.id, "served": r.served.to_dict(), "defer": r.defer,
                             "correct": bool(is_correct(r.answer, it.answer))})
    finally:
        svc.close()
    return rows


def rule_on(heads, rule, rows: list[dict]) -> tuple[float, float, int]:
    """(released share, risk among released, released) of `rows` under `rule`."""
    h = rule.apply(heads)
    served = [Served.from_dict(r["served"]) for r in rows]
    x = np.array([s.logits for s in served])
    p = dualread_at(x, h.temperature("psr"), h.temperature("per"))
    pv = {}
    if h.novelty is not None:
        pv["novelty"] = h.novelty.p_values_of(np.array([s.scores["novelty"] for s in served]))
    defer = h.defer_mask(p, pv.get("novelty"), [("x" if s.problem else None) for s in served])
    z = np.array([r["correct"] for r in rows])
    keep = ~defer
    return float(keep.mean()), float(1 - z[keep].mean()) if keep.any() else 0.0, int(keep.sum())


def drift_of(heads, shipped, rows: list[dict]) -> dict:
    """What the drift gauges would read after `rows` under the shipped rule."""
    from app.recertify import drift_reference
    from heads.drift import DriftWindow

    d = DriftWindow(len(rows))
    d.set_reference(drift_reference(shipped, heads))
    for r in rows:
        d.record(r["served"]["scores"],
                 r["served"]["p_values"].get("novelty", 1.0) < heads.novelty_alpha)
    s = d.stats()
    return {"n": s["n"], "flagged_share": round(s["flagged_share"], 4),
            "ks": {k: round(v[0], 4) for k, v in s["ks"].items()},
            "ks_p_value": {k: float(f"{v[1]:.2g}") for k, v in s["ks"].items()}}


def study(rows: dict[str, list[dict]], window: int, nxt: int, splits: int, poison: float
          ) -> dict:
    from heads.dualread import Heads
    from heads.recert import shipped_rule

    heads = Heads.load(None)
    shipped = shipped_rule(heads)
    r, d = shipped.policy["target_risk"], shipped.policy["delta"]
    out = {"target_risk": r, "delta": d, "window": window, "next": nxt, "splits": splits,
           "shipped_tau": shipped.tau}
    clean = rows["clean"]
    cov, risk, k = rule_on(heads, shipped, clean)
    z = np.array([x["correct"] for x in clean])
    out["clean"] = {"n": len(clean), "accuracy": round(float(z.mean()), 4),
                    "shipped_released": round(cov, 4), "shipped_risk": round(risk, 4),
                    "shipped_risk_upper_95": round(clopper_pearson_upper(
                        round(risk * k), k, 0.05), 4)}
    for name, stream in rows.items():
        z = np.array([x["correct"] for x in stream])
        s_cov, s_risk, _ = rule_on(heads, shipped, stream)
        entry = {"n": len(stream), "accuracy": round(float(z.mean()), 4),
                 "shipped_released": round(s_cov, 4), "shipped_risk": round(s_risk, 4),
                 "drift": drift_of(heads, shipped, stream[:500])}
        if len(stream) <= window:
            entry["recertified"] = f"not measured: {len(stream)} items, no more than " \
                                   f"the window ({window})"
            out[name] = entry
            continue
        entry["next_items"] = min(nxt, len(stream) - window)
        for label, flip in (("honest", 0.0), (f"poisoned_{poison:g}", poison)):
            held, covs, risks, reasons = 0, [], [], {}
            for k in range(splits):
                rng = np.random.default_rng(k)
                order = rng.permutation(len(stream))
                win, after = [stream[i] for i in order[:window]], \
                    [stream[i] for i in order[window: window + nxt]]
                verdicts = [Verdict(x["id"], Served.from_dict(x["served"]),
                                    x["correct"] or bool(flip and rng.uniform() < flip), 0.0,
                                    "study") for x in win]
                rule, cert = certify(verdicts, heads, f"s{k}", target_risk=r, delta=d,
                                     min_per_class=10)
                if rule is None:
                    why = cert["reason"].split(":")[0]
                    reasons[why] = reasons.get(why, 0) + 1
                    continue
                held += 1
                c, rk, _ = rule_on(heads, rule, after)
                covs.append(c)
                risks.append(rk)
            entry[label] = {
                "certified": f"{held}/{splits}", "refused_because": reasons,
                "next_released_mean": round(float(np.mean(covs)), 4) if covs else None,
                "next_released_min": round(float(np.min(covs)), 4) if covs else None,
                "next_risk_mean": round(float(np.mean(risks)), 4) if risks else None,
                "next_risk_max": round(float(np.max(risks)), 4) if risks else None}
        out[name] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="", help="items per stream, e.g. "
                    "clean=300,benign=500 (default: STREAMS' counts); the first items of "
                    "the same seeded order, so a smaller size reuses a larger run's cache")
    ap.add_argument("--window", type=int, default=300)
    ap.add_argument("--next", type=int, default=500)
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--poison", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in a.sizes.split(",") if kv)}
    for name, (spec, n) in STREAMS.items():
        n = sizes.get(name, n)
        cache = a.out / f"{name}.json"
        have = json.loads(cache.read_text()) if cache.exists() else []
        if len(have) < n:
            cache.write_text(json.dumps(collect(spec, n, a.seed, done=have)))
        rows[name] = json.loads(cache.read_text())[:n]
        print(name, len(rows[name]), flush=True)
    report = study(rows, a.window, a.next, a.splits, a.poison)
    (a.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
