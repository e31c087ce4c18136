"""Rolling calibration monitor fed by clinician feedback (no images, no questions)."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import numpy as np

from heads.metrics import auroc, ece


class FeedbackMonitor:
    """Remembers (confidence, defer) per request id for a while; scores feedback on them."""

    def __init__(self, window: int = 500, remember: int = 10000) -> None:
        self.pending: OrderedDict[str, tuple[float, bool]] = OrderedDict()
        # ids that already have their verdict (as many as `remember`): a second verdict is
        # refused, and the caller is told why rather than that the id is unknown
        self.labelled: OrderedDict[str, None] = OrderedDict()
        self.window: deque[tuple[float, bool, bool]] = deque(maxlen=window)
        # what re-certification needs of each answer (`heads.recert.Served`), by request
        # id, apart from `pending`: only an operator's verdict takes it, so a verdict from
        # anyone else cannot use up an answer an operator has yet to judge
        self.served: OrderedDict[str, object] = OrderedDict()
        self.remember = remember
        self.lock = threading.Lock()

    def record(self, request_id: str, confidence: float, deferred: bool,
               served: object | None = None) -> None:
        with self.lock:
            self.pending[request_id] = (confidence, deferred)
            while len(self.pending) > self.remember:
                self.pending.popitem(last=False)
            if served is not None:
                self.served[request_id] = served
                while len(self.served) > self.remember:
                    self.served.popitem(last=False)

    def take_served(self, request_id: str) -> object | None:
        """The answer's re-certification record, once: a second call for the same id
        (a repeated or concurrent verdict) gets None."""
        with self.lock:
            return self.served.pop(request_id, None)

    def feedback(self, request_id: str, correct: bool) -> bool:
        with self.lock:
            seen = self.pending.pop(request_id, None)
            if seen is None:
                return False
            self.window.append((seen[0], seen[1], bool(correct)))
            self.labelled[request_id] = None
            while len(self.labelled) > self.remember:
                self.labelled.popitem(last=False)
            return True

    def already_labelled(self, request_id: str) -> bool:
        """Whether `request_id`'s answer got its verdict earlier (one verdict an answer)."""
        with self.lock:
            return request_id in self.labelled

    def stats(self) -> dict[str, float]:
        with self.lock:
            rows = list(self.window)
        if not rows:
            return {}
        c = np.array([r[0] for r in rows])
        d = np.array([r[1] for r in rows])
        z = np.array([r[2] for r in rows], int)
        kept = ~d
        return {
            "auroc": auroc(c, z),
            "ece": ece(c, z, 15),
            "selective_risk": float(1 - z[kept].mean()) if kept.any() else float("nan"),
            "defer_rate": float(d.mean()),
            "n": float(len(rows)),
        }
