"""`dualread bench`: what confidence and serving cost, measured side by side.

`run_bench` (bench.run) drives the in-process modes (bench.inprocess), the
HTTP load generator (clients.bench) and, with `--gpu`, a Qwen3-VL-2B-sized random actor
(bench.gpu); bench.report checks the targets and renders bench.md.
"""

from bench.inprocess import MODES, ratio_ci, run_modes, summarise, time_heads
from bench.run import FULL, GPU, QUICK, Plan, plan_for, run_bench

__all__ = ["FULL", "GPU", "MODES", "QUICK", "Plan", "plan_for", "ratio_ci", "run_bench",
           "run_modes", "summarise", "time_heads"]
