"""Which paired differences in committed reports stay clear of 0 over the whole family.

    python -m studies.multiplicity docs/eval-easyvqa-1000/report.json \
        docs/probes/easyvqa-500/report.json [--out docs/multiplicity.md]

Each paired interval in a report is a 95% bootstrap percentile interval on its own. The
reports keep the interval, not the resamples, so the family-wise correction here works
from the interval: a normal approximation, standard error (hi − lo) / (2 · 1.96), a
two-sided p-value from difference / standard error, then Holm's step-down over the family
of one report (at 5%). The families: `evaluate`'s DualRead − m contrasts (AUROC and
natural CCG-AUC for every other method: `paired_vs_dualread`), and the CCG probe's
contrasts between interfaces (natural CCG-AUC; strict equals natural when every decisive
pair is yes/no) with EMVR's paired differences (each interface against μ(C), the actor's
mask − control drop).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from studies import command_line

Z95 = 1.959963984540054
ALPHA = 0.05


def p_from_ci(diff: float, lo: float, hi: float) -> float:
    """Two-sided p-value of `diff` = 0 from its 95% interval (normal approximation)."""
    se = (hi - lo) / (2 * Z95)
    if se <= 0:
        return 0.0 if diff != 0 else 1.0
    return math.erfc(abs(diff) / se / math.sqrt(2))


def holm(ps: list[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down: which hypotheses are rejected with family-wise error ≤ alpha."""
    order = sorted(range(len(ps)), key=lambda k: ps[k])
    out = [False] * len(ps)
    for rank, k in enumerate(order):
        if ps[k] > alpha / (len(ps) - rank):
            break
        out[k] = True
    return out


def contrasts(report: dict) -> list[tuple[str, float, float, float]]:
    """(label, difference, lo, hi) of every paired contrast a report holds."""
    rows = []
    for spec, d in report.get("datasets", {}).items():       # `dualread evaluate`
        for m, v in d.get("paired_vs_dualread", {}).items():
            for metric, c in v.items():
                if isinstance(c, dict) and "ci" in c:
                    rows.append((f"{spec}: DualRead − {m}, {metric}", c["diff"], *c["ci"]))
    for name, c in report.get("ccg", {}).get("contrasts", {}).items():   # `dualread probe`
        n = c["natural"]
        rows.append((f"CCG natural: {name}", n["difference"], *n["ci"]))
    for m, v in report.get("emvr", {}).items():       # EMVR's paired differences
        for key in v if isinstance(v, dict) else ():
            if ("_minus_" in key or "difference" in key) and f"{key}_ci" in v:
                rows.append((f"EMVR {m}: {key}", v[key], *v[f"{key}_ci"]))
    return rows


def p_text(p: float, resamples: int | None) -> str:
    """A p-value as far as the bootstrap behind its interval can speak for it."""
    floor = 1 / resamples if resamples else 1e-3
    return f"< {floor:.2g}" if p < floor else f"{p:.2g}"


def resamples(report: dict) -> int | None:
    """The bootstrap's resample count, where the report records one."""
    for b in (report.get("bootstrap"), report.get("emvr", {}).get("bootstrap"),
              report.get("config", {}).get("bootstrap")):
        if isinstance(b, int) and b > 0:
            return b
    return None


def family(report: dict) -> list[dict]:
    rows = contrasts(report)
    ps = [p_from_ci(d, lo, hi) for _, d, lo, hi in rows]
    clear = holm(ps)
    b = resamples(report)
    return [{"contrast": label, "difference": d, "ci95": [lo, hi],
             "ci95_clear_of_0": lo > 0 or hi < 0, "p_approx": p, "p_text": p_text(p, b),
             "holm_clear_of_0": h}
            for (label, d, lo, hi), p, h in zip(rows, ps, clear)]


def markdown(command: str, families: dict[str, list[dict]]) -> str:
    lines = ["# Paired contrasts under a family-wise correction", "",
             f"Command: `{command}`.", "",
             "Each report's paired intervals are 95% bootstrap percentile intervals, each on "
             "its own. Here each report's contrasts (evaluate's DualRead − method rows; the "
             "probes' CCG contrasts and EMVR's paired differences) form one family: a "
             "two-sided p-value from each interval (normal approximation, standard error = "
             "width / 3.92, the interval taken as roughly symmetric; the reports keep the "
             "intervals, not the bootstrap resamples), then Holm's step-down at 5% "
             "family-wise. A p-value below one over the resample count is past what the "
             "bootstrap resolves and is shown as `< 1/B`. *clear*: the difference stays clear "
             "of 0 after the correction.", ""]
    for path, rows in families.items():
        both = sum(r["holm_clear_of_0"] for r in rows)
        alone = sum(r["ci95_clear_of_0"] for r in rows)
        lines += [f"## `{path}`: {len(rows)} contrasts", "",
                  f"95% interval clear of 0 on its own: {alone}; clear of 0 after Holm: "
                  f"{both}.", "",
                  "| contrast | difference | 95% CI | p (approx.) | Holm |",
                  "|---|---|---|---|---|"]
        for r in rows:
            lo, hi = r["ci95"]
            lines.append(f"| {r['contrast']} | {r['difference']:+.3f} | [{lo:+.3f}, {hi:+.3f}] "
                         f"| {r['p_text']} | {'clear' if r['holm_clear_of_0'] else '—'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    command = command_line("studies.multiplicity", argv)
    families = {str(p): family(json.loads(p.read_text())) for p in args.reports}
    text = markdown(command, families)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
