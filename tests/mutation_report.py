"""The mutants not killed, the kill rate per module and overall from `mutmut results --all
true`, and whether the run meets its target, as `make mutation` prints it.

    mutmut results --all true | python tests/mutation_report.py [--modules "a.b c.d"]

Exit status 1 when a module (of those named, or every module listed) has a mutant no run
has checked, or kills fewer than `--target` per cent of its mutants: timeouts and mutants
no selected test reaches ("no tests") count as not killed, and are shown apart.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable

LINE = re.compile(r"^\s*(?P<name>\S+?)\.x[_ǁ]\S*: (?P<status>.+?)\s*$")
SHOWN = ("killed", "timeout", "survived", "no tests", "not checked")


def not_killed(lines: Iterable[str], modules: set[str] | None = None) -> list[str]:
    """The lines of the mutants a run did not kill, in the modules asked for (mutmut's own
    listing shows every module's unchecked mutants too: thousands after a split run)."""
    out = []
    for line in lines:
        m = LINE.match(line)
        if m and m["status"] != "killed" and (not modules or m["name"] in modules):
            out.append(line.strip())
    return out


def tally(lines: Iterable[str], modules: set[str] | None = None) -> dict[str, Counter]:
    """Status counts per module (`heads.recert`), and over them all under `all`."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for line in lines:
        m = LINE.match(line)
        if not m or (modules and m["name"] not in modules):
            continue
        counts[m["name"]][m["status"]] += 1
        counts["all"][m["status"]] += 1
    return dict(counts)


def report(counts: dict[str, Counter], target: float) -> tuple[str, bool]:
    """The table's text, and whether every module meets the target with nothing left
    unchecked."""
    rows, ok = [], bool(counts)
    for module in sorted(counts, key=lambda m: (m == "all", m)):
        c = counts[module]
        total = sum(c.values())
        killed = 100 * c["killed"] / total
        other = total - sum(c[s] for s in SHOWN)
        short = module != "all" and (killed < target or c["not checked"] > 0)
        ok &= not short
        rows.append(f"{module:<28} " + "  ".join(f"{s} {c[s]:4d}" for s in SHOWN)
                    + (f"  other {other}" if other else "")
                    + f"  of {total:5d}: {killed:5.1f}% killed"
                    + ("  UNDER TARGET" if short else ""))
    if not counts:
        rows.append("no mutants in the results")
    rows.append(f"target {target:g}% killed on every module: " + ("met" if ok else "NOT met"))
    return "\n".join(rows), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default="", help="space-separated modules (default all)")
    ap.add_argument("--target", type=float, default=85.0)
    a = ap.parse_args(argv)
    lines, modules = sys.stdin.readlines(), set(a.modules.split()) or None
    left = not_killed(lines, modules)
    if left:
        print("not killed:\n" + "\n".join(f"    {line}" for line in left))
    text, ok = report(tally(lines, modules), a.target)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
