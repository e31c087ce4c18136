"""Checks that `make mutation` still runs, as part of `make test`.

The full run takes far longer than the test suite, so it rots unseen: a selected test that
reads a file mutmut does not copy, or fails to collect, stops it at its stats phase. This
runs mutmut's whole pipeline (copy, mutate, stats over the configured test selection, clean
run, forced-fail check, one mutant) with the real configuration, except that only one small
module is mutated, in a scratch copy so that neither pyproject.toml nor `mutants/` is touched.
Exit status 0 when the stats are collected and the one mutant is killed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = "heads/metrics.py"
MUTANT = "heads.metrics.x_brier__mutmut_1"  # `(c - z) ** 2` mutated: every brier test sees it


def main() -> int:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["mutmut"]
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    # The scratch run must import the copy, never a checkout named on PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"OMP_NUM_THREADS": "1", "DUALREAD_TEST_THREADS": "1"}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        dst = Path(tmp)
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants")
        for folder in [*cfg["source_paths"], "tests"]:
            shutil.copytree(ROOT / folder, dst / folder, ignore=skip)
        text = (ROOT / "pyproject.toml").read_text("utf-8")
        text, n = re.subn(r"only_mutate = \[.*?\]", f'only_mutate = ["{MODULE}"]', text,
                          count=1, flags=re.S)
        if n != 1:
            print("mutation check: no only_mutate list in pyproject.toml [tool.mutmut]")
            return 1
        (dst / "pyproject.toml").write_text(text, "utf-8")
        run = subprocess.run([mutmut, "run", "--max-children", "2", MUTANT], cwd=dst, env=env,
                             capture_output=True, text=True)
        results = subprocess.run([mutmut, "results", "--all", "true"], cwd=dst, env=env,
                                 capture_output=True, text=True)
    verdict = re.search(rf"{re.escape(MUTANT)}: (\w+)", results.stdout)
    took = time.monotonic() - start
    if run.returncode != 0 or not verdict or verdict.group(1) != "killed":
        print(run.stdout[-4000:].replace("\r", "\n"), run.stderr[-2000:], results.stdout[-1000:])
        print(f"mutation check FAILED after {took:.0f} s: `make mutation` would not run "
              f"(mutmut exit {run.returncode}, {MUTANT}: "
              f"{verdict.group(1) if verdict else 'no result'})")
        return 1
    print(f"mutation check: stats collected over the configured tests, {MUTANT} killed "
          f"({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
