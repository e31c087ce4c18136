"""The defer rule's stress suites (SPEC §8, docs/defer/suites.md) and their report row.

`suite_specs("dev" | "heldout")` lists the data specs of one side of the split (clean test
first); `dualread evaluate --suite heldout` evaluates them. `suite_row` is what the report
shows for each: accuracy, released share, risk among released with its one-sided 95%
Clopper–Pearson upper bound, share of correct answers released, ECE among released, and
the released share τ alone would give (the difference is what the detectors defer).
"""

from __future__ import annotations

import numpy as np

from heads.defer import clopper_pearson_upper
from heads.metrics import METRICS
from models.benign import BENIGN_SPLIT
from models.render import SUITES

CLEAN = "easyvqa:test"
SEVERITIES_SHOWN = (1, 3, 5)
HARMFUL_SPLIT = {"dev": ("noise", "blur", "contrast", "background"),
                 "heldout": ("jpeg", "brightness", "resolution", "occlusion")}
UB_LEVEL = 0.05              # one-sided 95%


def suite_specs(split: str, base: str = CLEAN) -> list[str]:
    """Every data spec of one side of the split, with the kind of each (benign, harmful,
    novel), clean first."""
    return [s for s, _ in suite_kinds(split, base)]


def suite_kinds(split: str, base: str = CLEAN) -> list[tuple[str, str]]:
    if split not in ("dev", "heldout"):
        raise ValueError("suite must be dev or heldout")
    out = [(base, "clean")]
    out += [(f"{base}~{f}:{s}", "benign") for f in BENIGN_SPLIT[split]
            for s in SEVERITIES_SHOWN]
    out += [(f"render:{k}", v["kind"]) for k, v in SUITES.items()
            if v["split"] == split and v["kind"] == "benign"]
    out += [(f"{base}~{f}:{s}", "harmful") for f in HARMFUL_SPLIT[split]
            for s in SEVERITIES_SHOWN]
    out += [(f"render:{k}", v["kind"]) for k, v in SUITES.items()
            if v["split"] == split and v["kind"] == "novel"]
    return out


def kind_of(spec: str) -> str:
    """benign, harmful, novel or clean (or "other" for a spec of no suite)."""
    for split in ("dev", "heldout"):
        for s, k in suite_kinds(split):
            if s == spec or (spec.startswith("render:") and s == ":".join(spec.split(":")[:2])):
                return k
    return "other"


def suite_row(z: np.ndarray, confidence: np.ndarray, deferred: np.ndarray,
              deferred_tau: np.ndarray) -> dict:
    """The report row of one suite: `deferred` by the whole rule, `deferred_tau` by τ
    alone (same items)."""
    z = np.asarray(z).astype(int)
    c = np.asarray(confidence, float)
    kept = ~np.asarray(deferred, bool)
    n, k = len(z), int(kept.sum())
    errors = int((1 - z[kept]).sum())
    correct = z == 1
    return {"n": n, "accuracy": float(z.mean()) if n else float("nan"),
            "released": k / n if n else float("nan"),
            "risk_released": errors / k if k else 0.0,
            "risk_released_ub95": clopper_pearson_upper(errors, k, UB_LEVEL),
            "correct_released": float(kept[correct].mean()) if correct.any() else float("nan"),
            "ece_released": float(METRICS["ece"](c[kept], z[kept])) if k else float("nan"),
            "released_tau_only": float((~np.asarray(deferred_tau, bool)).mean())
            if n else float("nan")}


def pool_by_kind(rows: dict[str, dict]) -> dict[str, dict]:
    """Counts of the suites of each kind added up (benign, harmful, novel): released share,
    risk among released and its upper bound over all their items."""
    out: dict[str, dict] = {}
    for spec, r in rows.items():
        kind = kind_of(spec)
        if kind in ("clean", "other"):
            continue
        n, k = r["n"], round(r["released"] * r["n"])
        acc = out.setdefault(kind, {"n": 0, "right": 0, "kept": 0, "errors": 0,
                                    "right_kept": 0})
        right = round(r["accuracy"] * n)
        acc["n"] += n
        acc["right"] += right
        acc["kept"] += k
        acc["errors"] += round(r["risk_released"] * k)
        acc["right_kept"] += round(r["correct_released"] * right) if right else 0
    return {kind: {"n": a["n"], "accuracy": a["right"] / a["n"], "released": a["kept"] / a["n"],
                   "risk_released": a["errors"] / a["kept"] if a["kept"] else 0.0,
                   "risk_released_ub95": clopper_pearson_upper(a["errors"], a["kept"], UB_LEVEL),
                   "correct_released": a["right_kept"] / a["right"] if a["right"] else float("nan")}
            for kind, a in out.items()}


def suite_markdown(rows: dict[str, dict]) -> list[str]:
    """One table over the evaluated specs (rows by spec), and the clean deferral the
    detectors add."""
    lines = ["## Defer rule per suite", "",
             "Released: not deferred. Risk: wrong among released; UB: its one-sided 95% "
             "Clopper–Pearson upper bound. τ only: the released share without the detectors.",
             "", "| data | kind | n | accuracy | released | risk | UB 95% | correct released | "
                 "ECE released | τ only |", "|---|---|---|---|---|---|---|---|---|---|"]
    for spec, r in rows.items():
        lines.append(f"| `{spec}` | {kind_of(spec)} | {r['n']} | {r['accuracy']:.3f} | "
                     f"{r['released']:.3f} | {r['risk_released']:.3f} | "
                     f"{r['risk_released_ub95']:.3f} | {r['correct_released']:.3f} | "
                     f"{r['ece_released']:.3f} | {r['released_tau_only']:.3f} |")
    pooled = pool_by_kind(rows)
    if pooled:
        lines += ["", "Pooled by kind (items of every suite of that kind together):", "",
                  "| kind | n | accuracy | released | risk | UB 95% | correct released |",
                  "|---|---|---|---|---|---|---|"]
        for kind, r in pooled.items():
            lines.append(f"| {kind} | {r['n']} | {r['accuracy']:.3f} | {r['released']:.3f} | "
                         f"{r['risk_released']:.3f} | {r['risk_released_ub95']:.3f} | "
                         f"{r['correct_released']:.3f} |")
    clean = [s for s in rows if kind_of(s) == "clean"]
    for s in clean:
        r = rows[s]
        lines += ["", f"Clean deferral the detectors add on `{s}`: "
                      f"{r['released_tau_only'] - r['released']:.3f} "
                      f"(released {r['released_tau_only']:.3f} with τ alone, "
                      f"{r['released']:.3f} with the whole rule)."]
    return lines + [""]
