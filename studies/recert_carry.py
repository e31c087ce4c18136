"""Re-certification as the service runs it, window after window: separate windows against
windows carried across tests (`recert_max_window`), on the served rows of
`studies.recert_study` (its cache).

For each stream and each of `--splits` seeded orders of it (the same orders as the
window study), the verdicts are fed one by one to a `heads.recert.RuleStore` (the
service's store, its state file left out: the study measures its decisions, not its
disk), which tests every `recert_window` verdicts of each design (`DESIGNS`) at
δ_t = δ/(t(t+1)), divided by ⌈max_window / window⌉ (3) for carried windows, and switches
when a certificate holds. After `c` verdicts (each checkpoint), the rule then active is applied to
the next `--next` items of the order: released share and risk among released, as a user
would see them. Poisoned runs mark a share of the wrong answers correct.

    python -m studies.recert_carry --cache CACHE --out docs/recert/carry
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from heads.recert import KEEP_RULES, SHIPPED, RuleStore, Served, Settings, Verdict
from studies import command_line
from studies.recert_study import STREAMS, cache_file, rule_on

# (name, recert_window, recert_max_window): separate windows of 1000 (the service's
# defaults), windows of 1000 carried up to 3000, and one window of 3000 (a test only at
# the 3000th verdict)
DESIGNS = (("separate 1000", 1000, None), ("carried 1000 up to 3000", 1000, 3000),
           ("one window of 3000", 3000, None))


class QuietStore(RuleStore):
    """The service's store without its state file: the same decisions, no disk writes."""

    def _save(self) -> None:
        pass


def run(heads, stream: list[dict], window: int, max_window: int | None, checkpoints: list[int],
        nxt: int, seed: int, flip: float, state: Path) -> dict:
    """One seeded order of `stream` through a store; the active rule at each checkpoint
    applied to the next items."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(stream))
    store = QuietStore(state, heads, "study", Settings(window=window, max_window=max_window,
                                                       min_per_class=10))
    out: dict = {"switches": [], "at": {}}
    last = max(checkpoints)
    for n, i in enumerate(order[:last], start=1):
        x = stream[i]
        said = x["correct"] or bool(flip and rng.uniform() < flip)
        got = store.add(x["id"], Served.from_dict(x["served"]), said, "study")
        if not got["counted"]:       # checkpoints count counted verdicts, as the service
            raise ValueError(f"{x['id']}: not counted ({got['reason']}): a repeated input")
        if got.get("attempt") == "switch":
            out["switches"].append(n)
        if n in checkpoints:
            after = [stream[j] for j in order[n: n + nxt]]
            rule = store.active
            released, risk, _ = rule_on(heads, rule, after) if after else (None, None, 0)
            out["at"][n] = {"switched": rule.version != SHIPPED, "released": released,
                            "risk": risk, "tau": rule.tau}
    out["rule"] = store.active
    return out


def stream_change(heads, first: list[dict], second: list[dict], window: int,
                  max_window: int | None, n_first: int, n_second: int, nxt: int, seed: int,
                  reset: bool, state: Path) -> dict:
    """`n_first` verdicts of one stream, then (after an operator's reset, or not)
    `n_second` of another; the rule then active applied to the second stream's next items."""
    rng = np.random.default_rng(seed)
    a, b = rng.permutation(len(first)), rng.permutation(len(second))
    store = QuietStore(state, heads, "study", Settings(window=window, max_window=max_window,
                                                       min_per_class=10))
    for i in a[:n_first]:
        store.add(first[i]["id"], Served.from_dict(first[i]["served"]), first[i]["correct"],
                  "study")
    before = store.active.version != SHIPPED
    if reset:
        store.reset_window("study")
    for i in b[:n_second]:
        # the streams' item ids may repeat across specs: the request ids must not
        store.add("second-" + second[i]["id"], Served.from_dict(second[i]["served"]),
                  second[i]["correct"], "study")
    released, risk, _ = rule_on(heads, store.active, [second[j] for j in b[n_second:
                                                                          n_second + nxt]])
    return {"switched_on_first": before, "serving_shipped": store.active.version == SHIPPED,
            "released": released, "risk": risk}


def summary(runs: list[dict], checkpoint: int, floor: float | None, r: float) -> dict:
    rows = [x["at"][checkpoint] for x in runs if checkpoint in x["at"]]
    rel = [x["released"] for x in rows if x["released"] is not None]
    risk = [x["risk"] for x in rows if x["released"]]
    switched = [x["risk"] for x in rows if x["released"] and x["switched"]]
    return {"runs": len(rows), "switched": sum(x["switched"] for x in rows),
            "released_mean": round(float(np.mean(rel)), 4) if rel else None,
            "released_min": round(float(np.min(rel)), 4) if rel else None,
            "risk_mean": round(float(np.mean(risk)), 4) if risk else None,
            "risk_max": round(float(np.max(risk)), 4) if risk else None,
            # the rules the service certified (a run not switched serves the shipped one)
            "risk_max_switched": round(float(np.max(switched)), 4) if switched else None,
            "risk_above_r": sum(x > r for x in risk),
            "at_floor": None if floor is None else sum(x >= floor for x in rel),
            # the target run by run: released at the floor with risk ≤ r
            "at_floor_within_r": None if floor is None else sum(
                x["released"] is not None and x["released"] >= floor and x["risk"] <= r
                for x in rows)}


def save_cost(heads, stream: list[dict], n: int, folder: Path, rule=None,
              rounds: int = 10) -> dict:
    """What writing the state file costs with a full window of `n` of `stream`'s verdicts
    (the service writes it on every counted verdict) and, with `rule`, the most rules a
    store keeps (copies of it; a stream that keeps certifying switches at every test):
    median milliseconds and its size."""
    store = RuleStore(folder / "cost.json", heads, "study", Settings(window=n))
    store.window = [Verdict(f"{i:032x}", Served.from_dict(x["served"]), x["correct"],
                            time.time(), "operator") for i, x in enumerate(stream[:n])]
    for k in range(KEEP_RULES - 1 if rule is not None else 0):
        store.rules[f"r{k}"] = copy.deepcopy(rule)
        store.chain.append(f"r{k}")
    took = []
    for _ in range(rounds):
        t = time.perf_counter()
        store._save()
        took.append(time.perf_counter() - t)
    return {"verdicts": len(store.window), "rules": len(store.rules),
            "median_ms": round(float(np.median(took)) * 1e3, 1),
            "bytes": (folder / "cost.json").stat().st_size, "rounds": rounds}


def study(rows: dict[str, list[dict]], checkpoints: list[int], nxt: int, splits: int,
          poison: float) -> dict:
    from heads.dualread import Heads
    from heads.recert import shipped_rule

    heads = Heads.load(None)
    shipped = shipped_rule(heads)
    r, d = shipped.policy["target_risk"], shipped.policy["delta"]
    clean = rows.get("clean")
    floor = None if clean is None else round(rule_on(heads, shipped, clean)[0] - 0.05, 4)
    out: dict = {"target_risk": r, "delta": d, "floor": floor, "checkpoints": checkpoints,
                 "next": nxt, "splits": splits, "shipped_tau": shipped.tau, "streams": {}}
    kept = None      # a certified rule, to size the state file with the rules kept
    with tempfile.TemporaryDirectory() as tmp:
        for name, stream in rows.items():
            marks = [c for c in checkpoints if c <= len(stream)]
            entry = out["streams"][name] = {"n": len(stream)}
            for design, window, max_window in DESIGNS:
                for label, flip in (("honest", 0.0), (f"poisoned_{poison:g}", poison)):
                    runs = [run(heads, stream, window, max_window, marks, nxt, k, flip,
                                Path(tmp) / "state.json") for k in range(splits)]
                    kept = next((x["rule"] for x in runs if x["rule"].version != SHIPPED),
                                kept)
                    entry[f"{design} | {label}"] = {
                        "window": window, "max_window": max_window,
                        "first_switch": [x["switches"][0] if x["switches"] else None
                                         for x in runs],
                        **{str(c): summary(runs, c, floor if name == "benign" else None, r)
                           for c in marks if c >= window}}
                    print(name, design, label, flush=True)
        if {"benign", "harmful"} <= set(rows) and len(rows["benign"]) > 3000 \
                and len(rows["harmful"]) >= 1000 + nxt:
            # a benign stream certified, then a harmful one: with and without a reset
            out["stream_change"] = {}
            for design, window, max_window in DESIGNS[:2]:
                for reset in (False, True):
                    got = [stream_change(heads, rows["benign"], rows["harmful"], window,
                                         max_window, 3000, 1000, nxt, k, reset,
                                         Path(tmp) / "state.json") for k in range(splits)]
                    rel = [x["released"] for x in got]
                    risk = [x["risk"] for x in got if x["released"]]
                    out["stream_change"][f"{design} | {'reset' if reset else 'no reset'}"] = {
                        "switched_on_benign": sum(x["switched_on_first"] for x in got),
                        "serving_shipped": sum(x["serving_shipped"] for x in got),
                        "released_mean": round(float(np.mean(rel)), 4),
                        "risk_mean": round(float(np.mean(risk)), 4) if risk else None}
        longest = max(rows.values(), key=len)
        n = max(m or w for _, w, m in DESIGNS)
        out["state_file_write"] = [save_cost(heads, longest, n, Path(tmp)),
                                   save_cost(heads, longest, n, Path(tmp), kept)]
    return out


def markdown(report: dict, command: str) -> str:
    r, floor = report["target_risk"], report["floor"]
    lines = ["# Re-certification window after window: separate or carried windows", "",
             "Produced by one command, on the served rows that `python -m "
             "studies.recert_study --cache CACHE` cached for the same `--streams` and "
             "`--sizes` (for the test-image streams, the command that heads "
             "docs/recert/study.md):", "",
             f"    {command}", "",
             f"r = {r}, δ = {report['delta']} over the whole history (the t-th test at "
             f"δ/(t(t+1)), divided by ⌈max_window / window⌉ for carried windows); "
             f"{report['splits']} seeded orders of each stream; after each "
             f"checkpoint the rule then active is applied to the next {report['next']} "
             f"items. Benign floor (the shipped rule's clean released share − 0.05): {floor}.",
             "", "Released and risk: means over the orders (a rule that has not switched "
             "yet is the shipped one, and counts with what it releases); in brackets the "
             "least released and the highest risk of one order; at floor: orders whose next "
             "items are released at ≥ the floor; —: no next items (the stream ends there) "
             "or none released.", "",
             "| stream | design | labels | verdicts | switched | released (min) | risk (max) | "
             "risk max, switched | orders with risk > r | at floor | at floor, risk ≤ r |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in report["streams"].items():
        for key, v in entry.items():
            if not isinstance(v, dict):
                continue
            for c, s in v.items():
                if not isinstance(s, dict):
                    continue
                rel = "—" if s["released_mean"] is None else \
                    f"{s['released_mean']} ({s['released_min']})"
                risk = "—" if s["risk_mean"] is None else f"{s['risk_mean']} ({s['risk_max']})"
                cells = [s["risk_max_switched"], s["risk_above_r"], s["at_floor"],
                         s["at_floor_within_r"]]
                lines.append(f"| {name} | {key} | {c} | {s['switched']}/{s['runs']} | {rel} | "
                             f"{risk} | " + " | ".join("—" if x is None else str(x)
                                                       for x in cells) + " |")
    change = report.get("stream_change")
    if change:
        lines += ["", "## A stream change", "", f"3000 honest verdicts of the benign stream, "
                  "then (after an operator's reset, or not) 1000 of the harmful one; the rule "
                  f"then active applied to the harmful stream's next {report['next']} items "
                  "(means over the orders; risk over the orders that released any).", "",
                  "| design | reset | switched on benign | serving the shipped rule after | "
                  "released | risk |", "|---|---|---|---|---|---|"]
        for key, v in change.items():
            design, reset = key.split(" | ")
            lines.append(f"| {design} | {reset} | {v['switched_on_benign']}/{report['splits']} "
                         f"| {v['serving_shipped']}/{report['splits']} | {v['released_mean']} "
                         f"| {'—' if v['risk_mean'] is None else v['risk_mean']} |")
    for w in report.get("state_file_write", []):
        lines += ["", f"Writing the state file with a full window of {w['verdicts']} verdicts "
                  f"and {w['rules']} kept rule(s) (the service writes it on every counted "
                  f"verdict): {w['median_ms']} ms (median of {w['rounds']}), "
                  f"{w['bytes']:,} bytes."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="report.json and study.md")
    ap.add_argument("--cache", type=Path, required=True,
                    help="the served rows of `studies.recert_study` (run it first)")
    ap.add_argument("--streams", default="", help="another data spec for a stream, as in "
                    "studies.recert_study")
    ap.add_argument("--sizes", default="", help="items per stream, as in studies.recert_study")
    ap.add_argument("--checkpoints", default="1000,2000,3000")
    ap.add_argument("--next", type=int, default=500)
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--poison", type=float, default=0.2)
    a = ap.parse_args()
    specs = {name: spec for name, (spec, _) in STREAMS.items()}
    specs.update(kv.split("=", 1) for kv in a.streams.split(",") if kv)
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in a.sizes.split(",") if kv)}
    rows = {}
    for name, spec in specs.items():
        path = cache_file(a.cache, name, spec)
        if not path.exists():
            raise SystemExit(f"no served rows for {name} ({spec}) in {a.cache}: run "
                             "studies.recert_study with this cache first")
        rows[name] = json.loads(path.read_text())[:sizes.get(name, STREAMS[name][1])]
    report = study(rows, [int(c) for c in a.checkpoints.split(",")], a.next, a.splits,
                   a.poison)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    argv = sys.argv[1:]
    # the cache's path is this machine's: the command names it CACHE
    argv = [("CACHE" if k and argv[k - 1] == "--cache" else x) for k, x in enumerate(argv)]
    (a.out / "study.md").write_text(markdown(report, command_line("studies.recert_carry",
                                                                  argv)))
    print((a.out / "study.md").read_text())


if __name__ == "__main__":
    main()
