"""Choosing re-certification's threshold search on development streams.

    python -m studies.recert_search --cache CACHE --out OUT

Certifies windows of each development source's benign and harmful streams (the served
rows of `studies.recert_study`, reused from CACHE) with every search of VARIANTS, honest
and poisoned, and picks one by the rule below, which was fixed and committed before any
of the new variants' figures were looked at (docs/recert/search.md). Then
`studies.recert_window --search PICKED` re-applies the window rule to the picked search.

Every variant keeps the certificate's guarantee (risk among released ≤ r with probability
≥ 1 − δ_t over the window's draw): a fixed-sequence grid, at any step, is read off the
temperature part and sized by a label-free count, so each test spends all of δ_t; the
binary search's tests depend on the τ part's labels, so each spends δ_t / ⌈log2 m⌉.

The rule. For variant v, window w and a source that tests w (its benign stream holds w +
`next` items; `studies.recert_window.judge`):

- a benign split *meets the target* when its window certifies and the next items are
  released at ≥ the source's clean coverage − 0.05 with risk among released ≤ r;
- w is *safe* for v when, on every source testing w, the worst next-items risk of a
  poisoned certified window (benign, and harmful where long enough) is ≤ 2r and no honest
  harmful window certifies.

A variant that certifies an honest harmful window at any w on any source is out. Of the
others, the pick has the most splits meeting the target, summed over its safe windows and
the sources testing them; a tie goes to CURRENT, then to the earlier of VARIANTS. If no
variant is left, or the best count is 0, the pick is CURRENT.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from studies import command_line
from studies.recert_window import CANDIDATES, judge

# name -> `heads.recert.certify` keywords; CURRENT is the service's search before this study
VARIANTS: dict[str, dict] = {
    "seq0.01": {"search": "sequence", "step": 0.01},
    "seq0.02": {"search": "sequence", "step": 0.02},
    "seq0.05": {"search": "sequence", "step": 0.05},
    "binary": {"search": "binary"},
}
CURRENT = "seq0.01"
# development sources: stream -> (data spec, items), as in docs/recert/window.md
SOURCES: dict[str, dict[str, tuple[str, int]]] = {
    "dev": {"clean": ("easyvqa:dev", 1527), "benign": ("easyvqa:dev~bed-edge:1", 1527),
            "harmful": ("easyvqa:dev~contrast:5", 1527)},
    "render": {"clean": ("render:plain:1200:1", 2000),
               "benign": ("render:plain:1200:1~bed-edge:1", 3500),
               "harmful": ("render:plain:1200:1~contrast:5", 1000)},
}


def meeting(report: dict, window: int, variant: str) -> int | None:
    """Benign splits of `window` whose window certified and whose next items were released
    at ≥ the floor with risk ≤ r; None when the source does not test the window."""
    j = judge(report, window, variant)
    if j is None:
        return None
    r = report["target_risk"]
    splits = report["benign"]["windows"][str(window)][f"{variant}_honest"]["next_by_split"]
    return sum(1 for x in splits if x is not None and x[0] >= j["floor"] and x[1] <= r)


def choose(reports: dict[str, dict], variants: list[str] | None = None,
           current: str = CURRENT) -> dict:
    """The rule (module docstring) on one report per source: each variant's count, its
    safe windows, whether it certified a harmful stream, and the pick."""
    names = variants or list(VARIANTS)
    rows = {}
    for v in names:
        harmful_any, safe, count, by_window = False, [], 0, {}
        for window in CANDIDATES:
            judged = {s: judge(rep, window, v) for s, rep in reports.items()}
            tested = {s: j for s, j in judged.items() if j is not None}
            if not tested:
                continue
            harmful_any |= not all(j["harmful"] for j in tested.values())
            ok = all(j["poisoning"] and j["harmful"] for j in tested.values())
            met = {s: meeting(reports[s], window, v) for s in tested}
            by_window[str(window)] = {"safe": ok, "meeting": met,
                                      "poisoned_worst_risk": {
                                          s: j["poisoned_worst_risk"] for s, j in tested.items()},
                                      "harmful_certified": {
                                          s: j["harmful_certified"] for s, j in tested.items()}}
            if ok:
                safe.append(window)
                count += sum(met.values())
        rows[v] = {"harmful_certified_somewhere": harmful_any, "safe_windows": safe,
                   "splits_meeting": count, "windows": by_window}
    left = [v for v in names if not rows[v]["harmful_certified_somewhere"]]
    best = max((rows[v]["splits_meeting"] for v in left), default=0)
    if best == 0:
        picked = current
    else:
        top = [v for v in left if rows[v]["splits_meeting"] == best]
        picked = current if current in top else top[0]
    return {"current": current, "variants": rows, "picked": picked}


def released(reports: dict[str, dict], variants: list[str]) -> list[str]:
    """What each search released of the next benign items (honest), for the record: the
    rule does not read it."""
    lines = ["", "Benign stream, honest verdicts: windows certified, next items released "
             "(mean over certified windows) and risk among them, by variant.", "",
             "| source | window | " + " | ".join(variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for source, rep in reports.items():
        for window, w in rep["benign"]["windows"].items():
            cells = [f"{w[v + '_honest']['certified']}, {w[v + '_honest']['next_released_mean']}"
                     f", {w[v + '_honest']['next_risk_mean']}" for v in variants]
            lines.append(f"| {source} | {window} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict, command: str, extra: list[str] = ()) -> str:
    lines = ["# Threshold search: the rule applied", "",
             "Produced by one command (the rule: `studies/recert_search.py`, "
             "[search.md](../search.md)):", "", f"    {command}", "",
             "Per variant and window: benign splits meeting the target (certified, next "
             "items released ≥ clean coverage − 0.05 with risk ≤ r) by source, worst "
             "poisoned next-items risk, harmful windows certified (honest), and whether the "
             "window is safe (counted).", "",
             "| variant | window | splits meeting (dev / render) | poisoned worst risk | "
             "harmful certified | safe |", "|---|---|---|---|---|---|"]
    for v, row in result["variants"].items():
        for window, w in row["windows"].items():
            met = " / ".join(str(w["meeting"].get(s, "—")) for s in ("dev", "render"))
            worst = "; ".join(f"{s}: " + ", ".join(f"{k} {x}" for k, x in p.items())
                              for s, p in w["poisoned_worst_risk"].items())
            harm = ", ".join(f"{s} {x}" for s, x in w["harmful_certified"].items()
                             if x is not None) or "—"
            lines.append(f"| {v} | {window} | {met} | {worst} | {harm} | "
                         f"{'yes' if w['safe'] else 'no'} |")
    lines += ["", "| variant | certified a harmful stream | safe windows | splits meeting "
              "(safe windows) |", "|---|---|---|---|"]
    for v, row in result["variants"].items():
        lines.append(f"| {v} | {'yes' if row['harmful_certified_somewhere'] else 'no'} | "
                     f"{', '.join(map(str, row['safe_windows'])) or '—'} | "
                     f"{row['splits_meeting']} |")
    return "\n".join(lines + list(extra) + ["", f"**Picked: `{result['picked']}`** "
                                            f"(current: `{result['current']}`).", ""])


def main(argv: list[str] | None = None) -> None:
    from studies import recert_study

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="SOURCE/report.json per source, choice.json and choice.md")
    ap.add_argument("--cache", type=Path, default=None,
                    help="served rows (studies.recert_study's --cache); needed unless --reuse")
    ap.add_argument("--sources", default=",".join(SOURCES), help="comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    ap.add_argument("--windows", default=",".join(map(str, CANDIDATES)))
    ap.add_argument("--next", type=int, default=500)
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--poison", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="read OUT/SOURCE/report.json of "
                    "an earlier run (one per source, e.g. run in parallel) instead of "
                    "certifying again")
    a = ap.parse_args(argv)
    if a.cache is None and not a.reuse:
        ap.error("--cache is needed unless --reuse")
    variants = [v for v in a.variants.split(",") if v]
    windows = [int(w) for w in a.windows.split(",") if w]
    reports = {}
    for source in (s for s in a.sources.split(",") if s):
        if a.reuse:
            reports[source] = json.loads((a.out / source / "report.json").read_text())
            continue
        rows = {}
        for name, (spec, n) in SOURCES[source].items():
            if spec.startswith("easyvqa:test"):
                raise SystemExit("development streams only")
            cache = a.cache / f"{name}-{re.sub(r'[^A-Za-z0-9.-]+', '_', spec)}.json"
            have = json.loads(cache.read_text()) if cache.exists() else []
            if len(have) < n:
                have = recert_study.collect(spec, n, a.seed, done=have)
                cache.write_text(json.dumps(have))
            rows[name] = have[:n]
            # the study reads each stream's spec from STREAMS (gold answers by kind)
            recert_study.STREAMS[name] = (spec, n)
        # only the windows the window rule can judge: a full set of next benign items
        tested = [w for w in windows if w + a.next <= len(rows["benign"])]
        t0 = time.monotonic()
        rep = recert_study.study(rows, tested, a.next, a.splits, a.poison,
                    searches={v: VARIANTS[v] for v in variants},
                    recertify=("benign", "harmful"))
        rep["seconds"] = round(time.monotonic() - t0)
        (a.out / source).mkdir(parents=True, exist_ok=True)
        (a.out / source / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
        reports[source] = rep
        print(source, rep["seconds"], "s", flush=True)
    result = choose(reports, variants)
    (a.out / "choice.json").write_text(json.dumps(result, indent=2) + "\n")
    command = command_line("studies.recert_search", argv)
    if a.cache is not None:
        command = command.replace(str(a.cache), "CACHE")
    (a.out / "choice.md").write_text(markdown(result, command, released(reports, variants)))
    print(json.dumps({"picked": result["picked"],
                      "count": {v: r["splits_meeting"] for v, r in result["variants"].items()}}))


if __name__ == "__main__":
    main()
