"""Input drift on the live stream: the share of answers the novelty detectors flag, and a
two-sample Kolmogorov–Smirnov test of the served scores in a rolling window against the
distribution the active rule was fitted on.

The reference of each score: for the shipped rule, each detector's `clean_scores()` (a
single detector's clean conformal calibration scores; a composite detector's stored clean
sample of its combined score, whose rows share images, so the exported KS p-value is
optimistic — the alert reads the statistic); for a re-certified
rule, the scores of the window it was certified on (`DeferRule.drift_reference`, which
also holds DualRead's confidence). No request content is kept: one float per score.

One input counts once in the window: an answer whose input digest (`heads.recert.
input_key`: decoded pixels and question) is already in the window is not recorded, so a
client replaying one image and question under many requests cannot fill the window with
it. The digest covers the question, so one image under many questions (or one pixel
changed) is many inputs: distinct inputs do move it, drift is a property of the traffic,
whoever sends it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np
from scipy.stats import ks_2samp

MIN_WINDOW = 20        # fewer answers: no statistic (a KS test on a handful is noise)


class DriftWindow:
    def __init__(self, window: int = 500) -> None:
        self.rows: deque[tuple[dict[str, float], bool, str]] = deque(maxlen=window)
        self.keys: Counter[str] = Counter()        # input digests in the window
        self.reference: dict[str, np.ndarray] = {}
        self.lock = threading.Lock()
        self.version = 0          # bumps on every change: the collector caches on it

    def set_reference(self, reference: dict[str, np.ndarray | list[float]]) -> None:
        """A new fitting distribution (a rule switch): the window restarts with it."""
        with self.lock:
            self.reference = {k: np.sort(np.asarray(v, float)) for k, v in reference.items()
                              if len(v)}
            self.rows.clear()
            self.keys.clear()
            self.version += 1

    def record(self, scores: dict[str, float], flagged: bool, key: str = "") -> bool:
        """Add one answer; False (nothing recorded) when its input is already in the
        window. `key` "" (unknown input) always records."""
        with self.lock:
            if key and self.keys[key]:
                return False
            if len(self.rows) == self.rows.maxlen:
                old = self.rows[0][2]
                if old:
                    self.keys[old] -= 1
                    if not self.keys[old]:
                        del self.keys[old]
            self.rows.append(({k: float(v) for k, v in scores.items()}, bool(flagged), key))
            if key:
                self.keys[key] += 1
            self.version += 1
            return True

    def stats(self) -> dict:
        """{"n", "flagged_share", "ks": {score: (statistic, p_value)}}; {} when the window
        holds fewer than MIN_WINDOW answers."""
        with self.lock:
            rows, ref = list(self.rows), dict(self.reference)
        if len(rows) < MIN_WINDOW:
            return {}
        ks = {}
        for name, r in ref.items():
            x = np.array([s[name] for s, _, _ in rows if name in s], float)
            x = x[np.isfinite(x)]
            if len(x) >= MIN_WINDOW:
                res = ks_2samp(x, r)
                ks[name] = (float(res.statistic), float(res.pvalue))
        return {"n": len(rows), "flagged_share": float(np.mean([f for _, f, _ in rows])),
                "ks": ks}
