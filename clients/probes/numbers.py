"""How probe reports write numbers: `clean` for report.json, `fmt` for the markdown. Shared
by the runner and the one-page summary, which the runner imports."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def clean(x: Any) -> Any:
    """JSON-safe: NaN/inf → null, numpy scalars → Python, tuples → lists."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    if isinstance(x, list | tuple) and len(x) == 2:
        return f"[{fmt(x[0], digits)}, {fmt(x[1], digits)}]"
    return str(x)
