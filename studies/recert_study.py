"""Re-certification measured on the shipped actor and heads (docs/operations.md).

Serves every item of a clean, a benign and a harmful stream through `Service` (what
`/answer` runs), grades the answers with the one grader (`models.canon.is_correct`), and
keeps what a served answer leaves for re-certification (`heads.recert.Served`). Then, for
each window size of `--windows` smaller than a stream and `--splits` random splits of the
stream into a window and the next `--next` items, certifies a rule on the window
(`heads.recert.certify`, as the service does) and applies it to the next items: released
share and risk among released, against the shipped rule's on clean items. Each window is
certified twice: with the service's threshold search (fixed-sequence testing) and with
the offline binary search, for comparison. Poisoned windows mark a share of the wrong
answers correct before certifying; the next items are judged on their true labels.

    python -m studies.recert_study --cache CACHE --out docs/recert
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

from heads.defer import clopper_pearson_upper
from heads.recert import Served, Verdict, certify, dualread_at, spent_delta

# stream: (data spec, items). benign: the grey scanner bed along one side of the picture
# (a development family, docs/defer/suites.md), picked in the pilots (docs/recert/
# pilots.md) as the development change the four-part detector flags (about 9 in 10) whose
# errors are least confident; contrast:5 is answered about half the time. `--streams`
# names others, `--sizes` other lengths.
STREAMS = {"clean": ("easyvqa:test", 500), "benign": ("easyvqa:test~bed-edge:1", 2000),
           "harmful": ("easyvqa:test~contrast:5", 2000)}
# threshold searches compared: name -> `certify` keywords
SEARCHES: dict[str, dict] = {"sequence": {"search": "sequence"}, "binary": {"search": "binary"}}


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
    return rows


def cache_file(folder: Path, stream: str, spec: str) -> Path:
    """Where a stream's served rows are kept: one file per data spec, so a stream given
    another spec is served again."""
    return folder / f"{stream}-{re.sub(r'[^A-Za-z0-9.-]+', '_', spec)}.json"


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


def recertified(heads, stream: list[dict], window: int, nxt: int, splits: int,
                flip: float, search: str | dict, r: float, d: float) -> dict:
    """Certify `splits` random windows of `stream`; the next items under each rule."""
    held, covs, risks, reasons, taus, per_split = 0, [], [], {}, [], []
    for k in range(splits):
        rng = np.random.default_rng(k)
        order = rng.permutation(len(stream))
        win, after = [stream[i] for i in order[:window]], \
            [stream[i] for i in order[window: window + nxt]]
        verdicts = [Verdict(x["id"], Served.from_dict(x["served"]),
                            x["correct"] or bool(flip and rng.uniform() < flip), 0.0,
                            "study") for x in win]
        how = {"search": search} if isinstance(search, str) else search
        rule, cert = certify(verdicts, heads, f"s{k}", target_risk=r, delta=d,
                             min_per_class=10, **how)
        if rule is None:
            why = cert["reason"].split(":")[0].split(" on the ")[0]
            reasons[why] = reasons.get(why, 0) + 1
            per_split.append(None)
            continue
        held += 1
        c, rk, _ = rule_on(heads, rule, after)
        covs.append(c)
        risks.append(rk)
        taus.append(rule.tau)
        per_split.append([round(c, 4), round(rk, 4)])
    return {"certified": f"{held}/{splits}", "refused_because": reasons,
            "next_released_mean": round(float(np.mean(covs)), 4) if covs else None,
            "next_released_min": round(float(np.min(covs)), 4) if covs else None,
            "next_risk_mean": round(float(np.mean(risks)), 4) if risks else None,
            "next_risk_max": round(float(np.max(risks)), 4) if risks else None,
            "next_risk_above_r": sum(x > r for x in risks),
            "tau_median": round(float(np.median(taus)), 4) if taus else None,
            # each split's [released, risk] on its next items; None: not certified
            "next_by_split": per_split}


def study(rows: dict[str, list[dict]], windows: list[int], nxt: int, splits: int,
          poison: float, attempt: int = 1, searches: dict[str, dict] | None = None,
          recertify: tuple[str, ...] | None = None) -> dict:
    """`searches`: name -> `certify` keywords (default SEARCHES); `recertify`: the streams
    whose windows are certified (default all; the others get their shipped-rule figures
    only)."""
    from heads.dualread import Heads
    from heads.recert import shipped_rule

    heads = Heads.load(None)
    shipped = shipped_rule(heads)
    r, d = shipped.policy["target_risk"], shipped.policy["delta"]
    # the service tests its t-th window at δ/(t(t+1)) (α-spending, heads.recert)
    d_t = spent_delta(d, attempt)
    out = {"target_risk": r, "delta": d, "attempt": attempt, "delta_tested": d_t,
           "windows": windows, "next": nxt, "splits": splits,
           "shipped_tau": shipped.tau,
           "drift_reference": {k: len(v) for k, v in
                               drift_reference_of(heads, shipped).items()}}
    for name, stream in rows.items():
        z = np.array([x["correct"] for x in stream])
        s_cov, s_risk, k = rule_on(heads, shipped, stream)
        entry = {"n": len(stream), "accuracy": round(float(z.mean()), 4),
                 "shipped_released": round(s_cov, 4), "shipped_risk": round(s_risk, 4),
                 "shipped_risk_upper_95": round(clopper_pearson_upper(
                     round(s_risk * k), k, 0.05), 4),
                 "drift": drift_of(heads, shipped, stream[:500]),
                 "risk_of_most_confident": most_confident(heads, stream),
                 "wrong_by_answer_kind": by_kind(STREAMS[name][0], stream), "windows": {}}
        for window in windows:
            if len(stream) <= window or (recertify is not None and name not in recertify):
                continue
            w = entry["windows"][str(window)] = {"next_items": min(nxt, len(stream) - window)}
            for search, how in (searches or SEARCHES).items():
                for label, flip in (("honest", 0.0), (f"poisoned_{poison:g}", poison)):
                    w[f"{search}_{label}"] = recertified(heads, stream, window, nxt, splits,
                                                         flip, how, r, d_t)
        out[name] = entry
    return out


def most_confident(heads, rows: list[dict], shares=(0.3, 0.5, 0.7)) -> dict:
    """Risk among the `share` of `rows` with the highest DualRead confidence (shipped
    temperatures, detectors ignored): the least risk any τ releasing that share can reach
    with these confidences (a re-certified rule refits the branch temperatures, which
    can reorder items, so this is a diagnostic, not a bound)."""
    x = np.array([r["served"]["logits"] for r in rows])
    p = dualread_at(x, heads.temperature("psr"), heads.temperature("per"))
    z = np.array([r["correct"] for r in rows])[np.argsort(-p, kind="stable")]
    return {str(s): round(float(1 - z[: max(1, int(s * len(z)))].mean()), 4) for s in shares}


def by_kind(spec: str, rows: list[dict]) -> dict:
    """Wrong share by the kind of gold answer (yes/no, a colour word, a shape word): where
    a transform's errors are (one that draws a frame may be read as a shape)."""
    from models.data import load

    gold = {it.id: it for it in load(spec)}
    out: dict[str, list[int]] = {}
    for r in rows:
        it = gold[r["id"]]
        kind = "yes/no" if it.answer in ("yes", "no") else \
            ("colour" if "colo" in it.question else "shape")
        n = out.setdefault(kind, [0, 0])
        n[0] += 1
        n[1] += not r["correct"]
    return {k: {"n": n, "wrong": round(w / n, 4)} for k, (n, w) in sorted(out.items())}


def drift_reference_of(heads, shipped) -> dict:
    from app.recertify import drift_reference

    return drift_reference(shipped, heads)


def markdown(report: dict, command: str) -> str:
    """The report as the page docs/operations.md quotes."""
    r = report["target_risk"]
    lines = ["# Re-certification study", "",
             "Produced by one command (served rows cached in `--cache`; the report is "
             "`report.json` next to this page):", "", f"    {command}", "",
             f"Shipped rule: τ = {report['shipped_tau']:.4f}, r = {r}, δ = "
             f"{report['delta']}; each window is tested as the service's attempt "
             f"{report['attempt']} of a history, at δ_t = δ/(t(t+1)) = "
             f"{report['delta_tested']:.4g} (α-spending). Drift reference of the shipped "
             "rule (items): "
             f"{report['drift_reference'] or 'none'}. Each window size: {report['splits']} "
             f"random splits of the stream into a window of verdicts and the next "
             f"{report['next']} items (fewer when the stream is shorter).", "",
             "## Streams under the shipped rule", "",
             "Drift over each stream's first 500 items. Risk of the most confident x%: the "
             "wrong share among the x% of the stream with the highest DualRead confidence "
             "(shipped temperatures, detectors ignored): the least risk a threshold "
             "releasing that share can reach at those temperatures (a re-certified rule "
             "refits the two branches' temperatures, which can change the order).", "",
             "| stream | n | accuracy | released | risk | UB 95% | drift: flagged share | "
             "drift: KS statistic by score | risk of the most confident 30% / 50% / 70% | "
             "wrong by gold answer kind |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in STREAMS:
        e = report.get(name)
        if e is None:
            continue
        ks = ", ".join(f"{k} {v}" for k, v in e["drift"]["ks"].items()) or "none"
        lines.append(f"| {name} (`{STREAMS[name][0]}`) | {e['n']} | {e['accuracy']} | "
                     f"{e['shipped_released']} | {e['shipped_risk']} | "
                     f"{e['shipped_risk_upper_95']} | {e['drift']['flagged_share']} | {ks} | "
                     + " / ".join(str(v) for v in e["risk_of_most_confident"].values())
                     + " | " + ", ".join(f"{k} {v['wrong']} ({v['n']})"
                                         for k, v in e["wrong_by_answer_kind"].items())
                     + " |")
    lines += ["", "## Re-certified on a window, applied to the next items", "",
              "released / risk: means over the windows whose certificate held; risk max and "
              f"'> r': the worst window and how many of them had risk above r = {r} on their "
              "next items (the guarantee allows a share δ of windows over r in the "
              "population, and the next items are a finite sample).", "",
              "| stream | window | search | verdicts | certified | released | released min "
              "| risk | risk max | > r |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in STREAMS:
        e = report.get(name)
        if e is None:
            continue
        for window, w in e["windows"].items():
            for key, v in w.items():
                if key == "next_items":
                    continue
                search, label = key.split("_", 1)
                lines.append(f"| {name} | {window} | {search} | {label} | {v['certified']} | "
                             f"{v['next_released_mean']} | {v['next_released_min']} | "
                             f"{v['next_risk_mean']} | {v['next_risk_max']} | "
                             f"{v['next_risk_above_r']} |")
    return "\n".join(lines + [""] + targets(report)) + "\n"


def targets(report: dict) -> list[str]:
    """The issue's targets, read off the report (docs/operations.md): one line each, per
    window size, with the figures that decide it."""
    r, clean, out = report["target_risk"], report.get("clean"), []
    if clean is None:
        return out
    floor = round(clean["shipped_released"] - 0.05, 4)
    out += ["## Targets", "",
            f"Clean coverage: the shipped rule releases {clean['shipped_released']} of the "
            f"clean stream, so the benign target is next-items released ≥ {floor} with "
            f"risk ≤ r = {r} (the service's search, honest verdicts). Released and risk: "
            "means over the windows that certified; *all windows*: the mean released over "
            "every window, one that did not certify counted at the shipped rule's share of "
            "the stream, and the target holds on that.", "",
            "| target | window | figures | met |", "|---|---|---|---|"]
    b, h = report.get("benign"), report.get("harmful")
    for window, w in (b or {}).get("windows", {}).items():
        v = w["sequence_honest"]
        got, tried = (int(x) for x in v["certified"].split("/"))
        every = None if v["next_released_mean"] is None or not tried else round(
            (got * v["next_released_mean"] + (tried - got) * b["shipped_released"]) / tried, 4)
        ok = every is not None and every >= floor and v["next_risk_mean"] <= r
        out.append(f"| benign re-certifies and releases | {window} | certified "
                   f"{v['certified']}, released {v['next_released_mean']}, all windows "
                   f"{every} (≥ {floor}), risk {v['next_risk_mean']} (≤ {r}), windows over r "
                   f"{v['next_risk_above_r']} | {'yes' if ok else 'no'} |")
    if h is not None:
        d = h["drift"]
        fires = d["n"] >= 100 and max(d["ks"].values(), default=0) > 0.25
        out.append(f"| harmful: drift alert condition | first {d['n']} | KS "
                   f"{max(d['ks'].values(), default=None)} (> 0.25), flagged "
                   f"{d['flagged_share']} | {'yes' if fires else 'no'} |")
        for window, w in h["windows"].items():
            held = {k: v["certified"] for k, v in w.items() if k.endswith("_honest")}
            none = all(x.startswith("0/") for x in held.values())
            out.append(f"| harmful: certificate fails, keeps deferring | {window} | "
                       + ", ".join(f"{k} {x}" for k, x in held.items())
                       + f" | {'yes' if none else 'no'} |")
    for name, e in (("benign", b), ("harmful", h)):
        for window, w in (e or {}).get("windows", {}).items():
            for k, v in w.items():
                if not k.startswith("sequence_poisoned"):
                    continue
                worst = v["next_risk_max"]
                ok = worst is None or worst <= 2 * r
                out.append(f"| poisoned ({k.split('_', 1)[1]}): risk ≤ 2r or refused | "
                           f"{window} ({name}) | certified {v['certified']}, worst next "
                           f"risk {worst} (≤ {2 * r}) | {'yes' if ok else 'no'} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="report.json and study.md")
    ap.add_argument("--cache", type=Path, default=None,
                    help="served rows of each stream (default: --out)")
    ap.add_argument("--sizes", default="", help="items per stream, e.g. "
                    "clean=300,benign=500 (default: STREAMS' counts); the first items of "
                    "the same seeded order, so a smaller size reuses a larger run's cache")
    ap.add_argument("--streams", default="", help="another data spec for a stream, e.g. "
                    "benign=easyvqa:test~crop:5 (default: STREAMS)")
    ap.add_argument("--windows", default="300,1000,1500",
                    help="window sizes (verdicts), comma-separated")
    ap.add_argument("--next", type=int, default=500)
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--poison", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attempt", type=int, default=1, help="test each window as the "
                    "service's t-th certificate test, at δ/(t(t+1))")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    cache_dir = a.cache or a.out
    cache_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in a.sizes.split(",") if kv)}
    for kv in (x for x in a.streams.split(",") if x):
        name, spec = kv.split("=", 1)
        STREAMS[name] = (spec, STREAMS[name][1])
    for name, (spec, n) in STREAMS.items():
        n = sizes.get(name, n)
        cache = cache_file(cache_dir, name, spec)
        have = json.loads(cache.read_text()) if cache.exists() else []
        if len(have) < n:
            cache.write_text(json.dumps(collect(spec, n, a.seed, done=have)))
        rows[name] = json.loads(cache.read_text())[:n]
        print(name, len(rows[name]), flush=True)
    windows = [int(w) for w in a.windows.split(",") if w]
    report = study(rows, windows, a.next, a.splits, a.poison, a.attempt)
    (a.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    command = "python -m studies.recert_study --cache CACHE --out " + str(a.out) + \
        (f" --streams {a.streams}" if a.streams else "") + \
        (f" --sizes {a.sizes}" if a.sizes else "") + f" --windows {a.windows} --next " \
        f"{a.next} --splits {a.splits} --poison {a.poison:g} --seed {a.seed} --attempt {a.attempt}"
    (a.out / "study.md").write_text(markdown(report, command))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
