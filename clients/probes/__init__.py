"""Probe suites run against any dualread deployment over HTTP (docs/method.md §2–§5).

`dualread probe NAME --url URL --data SPEC --out DIR` with NAME one of `PROBES` or `all`.
Each probe module has `params`, `run_item`, `summarise`, `markdown` and `figures`; the
runner (`runner.py`) makes runs resumable and writes the reports.
"""

from __future__ import annotations

from clients.probes import ccg, emvr, reliance, tgs

PROBES = {m.NAME: m for m in (ccg, tgs, emvr, reliance)}
