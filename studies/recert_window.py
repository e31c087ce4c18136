"""Choosing the default re-certification window (`recert_window`) on development streams.

    python -m studies.recert_window --out OUT NAME=REPORT [NAME=REPORT ...]

Each REPORT is a `studies.recert_study` report.json of one development source (clean,
benign and harmful streams on images that are neither easy-VQA test nor the heads' fitting
pool; docs/recert/window.md says which). The rule below was fixed and committed before any
study on the refitted heads was run; it reads only what the reports hold.

For a candidate window w, a source *tests* w when its benign stream holds w + `next`
items (a full set of next items after every window). On each source that tests w:

- benign, the service's search, honest verdicts: in at least MIN_SHARE of the splits the
  window certifies and the next items are released at ≥ the source's clean coverage (the
  shipped rule's released share of its clean stream) − COVERAGE_SLACK; and the mean risk
  among released on the next items, over the windows that certified, is ≤ r (the
  certificate bounds the stream's risk; 500 next items are a sample of it, so risk is
  judged on the mean, coverage per split);
- poisoning (the service's search, POISON of the wrong answers marked correct), on the
  benign stream and on the harmful one where it is long enough: the worst next-items risk
  of a certified window is ≤ 2r, or no window certifies;
- harmful, the service's search, honest verdicts, where the harmful stream is longer than
  w: no window certifies.

The default is the smallest candidate that at least one source tests and that passes on
every source testing it. If none does, the default stays FALLBACK and the output says so.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from studies import command_line

CANDIDATES = (300, 500, 1000, 1500, 2000, 3000)
MIN_SHARE = 0.8                # 16 of 20 splits
COVERAGE_SLACK = 0.05          # the target: clean coverage − 0.05
POISON = "sequence_poisoned_0.2"
FALLBACK = 1000                # the shipped default, kept when no candidate passes


def judge(report: dict, window: int, search: str = "sequence") -> dict | None:
    """The rule's three conditions for `window` on one source's report; None when the
    source does not test the window. `search`: whose figures are read (the report's keys
    `<search>_honest`, `<search>_poisoned_0.2`; the service's search by default)."""
    r = report["target_risk"]
    b, h = report["benign"], report.get("harmful")
    w = b["windows"].get(str(window))
    if w is None or w["next_items"] < report["next"]:
        return None
    floor = round(report["clean"]["shipped_released"] - COVERAGE_SLACK, 4)
    honest = w[f"{search}_honest"]
    poison_key = POISON.replace("sequence", search, 1)
    splits = honest["next_by_split"]
    meeting = sum(1 for x in splits if x is not None and x[0] >= floor)
    need = math.ceil(MIN_SHARE * len(splits))
    risk = honest["next_risk_mean"]
    benign_ok = meeting >= need and risk is not None and risk <= r
    poisoned = {"benign": w[poison_key]["next_risk_max"]}
    harmful_certified = None
    hw = (h or {}).get("windows", {}).get(str(window))
    if hw is not None:
        poisoned["harmful"] = hw[poison_key]["next_risk_max"]
        harmful_certified = hw[f"{search}_honest"]["certified"]
    poison_ok = all(v is None or v <= 2 * r for v in poisoned.values())
    harmful_ok = harmful_certified is None or harmful_certified.startswith("0/")
    return {"floor": floor, "splits_meeting": f"{meeting}/{len(splits)}", "need": need,
            "certified": honest["certified"], "risk_mean": risk, "benign": benign_ok,
            "poisoned_worst_risk": poisoned, "poisoning": poison_ok,
            "harmful_certified": harmful_certified, "harmful": harmful_ok,
            "passes": benign_ok and poison_ok and harmful_ok}


def pick(reports: dict[str, dict], search: str = "sequence") -> dict:
    """Every candidate judged on every source, and the default the rule picks."""
    rows, chosen = {}, None
    for window in CANDIDATES:
        judged = {name: judge(rep, window, search) for name, rep in reports.items()}
        tested = {k: v for k, v in judged.items() if v is not None}
        ok = bool(tested) and all(v["passes"] for v in tested.values())
        rows[str(window)] = {"sources": judged, "passes": ok}
        if ok and chosen is None:
            chosen = window
    return {"candidates": list(CANDIDATES), "min_share": MIN_SHARE, "search": search,
            "coverage_slack": COVERAGE_SLACK, "poison": POISON, "fallback": FALLBACK,
            "windows": rows, "picked": chosen if chosen is not None else FALLBACK,
            "picked_by_rule": chosen is not None}


def markdown(result: dict, command: str) -> str:
    lines = ["# Default re-certification window: the rule applied", "",
             "Produced by one command (the rule: `studies/recert_window.py`, "
             "[window.md](../window.md)):", "", f"    {command}", "",
             "Per source and window: splits whose window certified and released ≥ the "
             "floor on the next items (needed), mean risk of the certified windows, worst "
             "next-items risk with poisoned verdicts, harmful windows certified "
             "(honest). '—': the source's streams are too short to test the window."
             + ("" if result.get("search", "sequence") == "sequence" else
                f" Threshold search judged: `{result['search']}`."), "",
             "| window | source | floor | benign: splits meeting (need) | certified | "
             "risk mean | poisoned worst risk | harmful certified | passes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for window, row in result["windows"].items():
        for name, v in row["sources"].items():
            if v is None:
                lines.append(f"| {window} | {name} | — | — | — | — | — | — | — |")
                continue
            worst = ", ".join(f"{k} {x}" for k, x in v["poisoned_worst_risk"].items())
            lines.append(f"| {window} | {name} | {v['floor']} | {v['splits_meeting']} "
                         f"({v['need']}) | {v['certified']} | {v['risk_mean']} | {worst} | "
                         f"{v['harmful_certified'] or '—'} | "
                         f"{'yes' if v['passes'] else 'no'} |")
    verdict = (f"**Picked: {result['picked']}** (the smallest candidate that passes on "
               "every source testing it)." if result["picked_by_rule"] else
               f"**No candidate passes: the default stays {result['fallback']}.**")
    return "\n".join(lines + ["", verdict, ""])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="pick.json and pick.md")
    ap.add_argument("--search", default="sequence", help="the report's search whose "
                    "figures are judged (studies.recert_search's variants: seq0.02, ...)")
    ap.add_argument("reports", nargs="+", help="NAME=PATH of a recert_study report.json")
    a = ap.parse_args(argv)
    reports = {}
    for kv in a.reports:
        name, path = kv.split("=", 1)
        reports[name] = json.loads(Path(path).read_text())
    result = pick(reports, a.search)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pick.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out / "pick.md").write_text(markdown(result, command_line("studies.recert_window",
                                                                 argv)))
    print(json.dumps({"picked": result["picked"], "by_rule": result["picked_by_rule"]}))


if __name__ == "__main__":
    main()
