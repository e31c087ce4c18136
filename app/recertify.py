"""The service side of re-certification (heads.recert) and drift (heads.drift): who may
count a verdict, where the rule state lives, what the drift gauges export.

Only a request that presents the operator key (`X-Operator-Key`, setting `operator_key`)
counts toward a certificate; with no operator key configured nothing counts and the
pin/rollback routes are not served. The state file sits next to the heads
(`recert_state.json`) unless `recert_state` names another path; the heads' own files are
never written.
"""

from __future__ import annotations

import fcntl
import json
import logging
from pathlib import Path
from typing import Any

from fastapi import Request
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from app.deps import key_matches, one_header
from app.errors import WrongOperatorKey
from app.metrics import MetricsHooks
from app.serving import AnswerResult
from app.settings import Settings
from heads.drift import DriftWindow
from heads.recert import SHIPPED, DeferRule, RuleStore, Served, detectors_of
from heads.recert import Settings as RecertSettings

log = logging.getLogger("dualread.service")
OPERATOR_HEADER = "x-operator-key"
STATE_FILE = "recert_state.json"
LOADING = "loading model"
ANSWER_ONLY = ("answer-only: the service runs without heads (every answer is deferred), so "
               "there is no defer rule to certify")


def drift_reference(rule: DeferRule, base: Any) -> dict:
    """The fitting distribution drift is measured against while `rule` is active."""
    if rule.drift_reference:
        return rule.drift_reference
    clean = {name: getattr(det, "clean_scores", lambda: None)()
             for name, (det, _) in detectors_of(base).items()}
    return {name: scores for name, scores in clean.items() if scores is not None}


class Recertification:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.drift = DriftWindow(getattr(settings, "drift_window", 500))
        self.store: RuleStore | None = None
        self.service: Any = None
        self.blocked: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.settings.operator_key)

    def attach(self, service: Any) -> None:
        """Bind to the loaded service: restore a persisted rule, set the drift reference."""
        self.service = service
        base = getattr(service, "base_heads", None)
        if base is None:          # a backend without heads of its own: nothing to certify
            self.blocked = ANSWER_ONLY
            return
        if self.enabled:
            s = self.settings
            path = Path(s.recert_state) if s.recert_state else \
                Path(s.heads or _embedded()) / STATE_FILE
            try:
                if not self._lock(path):
                    return
                self.store = RuleStore(path, base, service.heads_id, RecertSettings(
                    window=s.recert_window, max_window=s.recert_max_window,
                    min_per_class=s.recert_min_per_class),
                    on_switch=self._switched)
            except OSError as e:
                # a state file this process cannot write (read-only heads folder, say)
                # stops re-certification, not the service
                self.blocked = f"the state file {path.name} cannot be used " \
                               f"({type(e).__name__}); set DUALREAD_RECERT_STATE to a " \
                               "writable path"
                log.warning(json.dumps({"event": "recert_disabled", "why": self.blocked}))
                return
            if self.store.active.version != SHIPPED:
                service.use_rule(self.store.active)
                log.info(json.dumps({"event": "defer_rule_restored",
                                     "version": self.store.active.version}))
            self.drift.set_reference(drift_reference(self.store.active, base))
        else:
            self.drift.set_reference(drift_reference(DeferRule(SHIPPED, {}, None), base))

    def _lock(self, path: Path) -> bool:
        """Hold `<state>.lock` for the life of the process: a second process (another
        replica, another worker) on the same state file would overwrite this one's
        windows, so it counts nothing and says why."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self.blocked = f"the state file {path.name} is held by another process; give " \
                           "each replica its own DUALREAD_RECERT_STATE"
            log.warning(json.dumps({"event": "recert_disabled", "why": self.blocked}))
            return False
        return True

    def close(self) -> None:
        """Release the state file (at shutdown)."""
        f = getattr(self, "_lock_file", None)
        if f is not None and not f.closed:
            f.close()          # closing the descriptor drops its lock

    def _switched(self, rule: DeferRule) -> None:
        self.service.use_rule(rule)
        self.drift.set_reference(drift_reference(rule, self.service.base_heads))

    # ---------------------------------------------------------------- who
    def operator(self, request: Request) -> str | None:
        """The operator's identity when the request presents the operator key; None when
        it presents none, or when no operator key is configured (nothing counts then). A
        wrong key is 401: a client that means to count must learn that it does not."""
        if not self.enabled:
            return None
        given = one_header(request, OPERATOR_HEADER, "X-Operator-Key")
        if given is None:
            return None
        if not key_matches(given, self.settings.operator_key):
            raise WrongOperatorKey()
        # one shared key: "operator" is all it can say (a hash of the key, shown on
        # /calibration, would let any API client test guesses of it offline)
        return "operator"

    # ---------------------------------------------------------------- verdicts
    def count(self, request_id: str, served: Served, correct: bool, who: str) -> dict:
        """Count one operator verdict (blocking: certification runs when it closes a
        window); the caller runs it off the event loop."""
        if self.store is None:
            return {"counted": False, "reason": "not_counting"}      # /calibration says why
        return self.store.add(request_id, served, correct, who)

    def reason(self) -> str:
        """Why no verdict counts toward a certificate (while `store` is None)."""
        if self.service is None:
            return LOADING
        if self.blocked:
            return self.blocked
        if not self.enabled:
            return "no operator key configured: verdicts do not count toward a certificate"
        return LOADING

    def view(self, operator: bool = False) -> dict:
        """What `/calibration` shows. The open window's live tallies (counted, correct,
        wrong, opened_at) are the operator's only: they tell how close a switch is, and a
        client that knows that can time a burst of inputs; anyone else sees its size."""
        drift = self.drift.stats()
        out: dict[str, Any] = {"counting": self.store is not None,
                               "drift": drift or None}
        if self.store is not None:
            out.update(self.store.view())
            if not operator:
                out["window"] = {k: out["window"][k] for k in ("needed", "max")}
        else:
            svc = self.service
            base = getattr(svc, "base_heads", None)
            out["reason"] = self.reason()
            if base is not None:
                from heads.recert import shipped_rule

                out["active"] = shipped_rule(base).summary()
        return out


def _embedded() -> Path:
    from heads.dualread import EMBEDDED_HEADS

    return EMBEDDED_HEADS


class RecertHooks(MetricsHooks):
    """The metrics hooks, plus every answer's scores into the drift window."""

    def __init__(self, metrics, monitor, drift: DriftWindow) -> None:
        super().__init__(metrics, monitor)
        self.drift = drift

    def answered(self, request_id: str, result: AnswerResult, queued_s: float) -> None:
        super().answered(request_id, result, queued_s)
        if result.confidence is None:   # answer-only: no heads, no scores to watch
            return
        served = result.served
        scores = {"dualread": result.confidence.dualread}
        if served is not None:
            scores.update(served.scores)
        flagged = result.novelty is not None and result.novelty.novel
        self.drift.record(scores, flagged, getattr(served, "key", ""))


class DriftCollector:
    """`dualread_drift{score}`: the KS statistic of the served scores in the rolling window
    against the active rule's fitting distribution; its p-value; the share of the window
    the detectors flag; the window's size; the active rule's version. Absent until the
    window holds enough answers."""

    def __init__(self, recert: Recertification) -> None:
        self.recert = recert
        self.cached: tuple[int, dict] = (-1, {})

    def collect(self):
        drift = self.recert.drift
        if self.cached[0] != drift.version:
            self.cached = (drift.version, drift.stats())
        stats = self.cached[1]
        svc = self.recert.service
        # answer-only (no heads): no rule decides, so none is claimed
        if svc is not None and hasattr(svc, "rule_version") and \
                getattr(svc, "heads", None) is not None:
            i = InfoMetricFamily("dualread_defer_rule", "The defer rule being served.")
            i.add_metric([], {"version": svc.rule_version})
            yield i
        # declared always (an alert on a renamed gauge would fail its test), sampled only
        # once the window holds enough answers: absent, not 0, before then
        d = GaugeMetricFamily("dualread_drift", "KS statistic of served scores (rolling "
                              "window) against the active rule's fitting distribution.",
                              labels=["score"])
        p = GaugeMetricFamily("dualread_drift_p_value", "p-value of that KS test.",
                              labels=["score"])
        f = GaugeMetricFamily("dualread_drift_flagged_share",
                              "Share of the drift window flagged by the novelty detectors.")
        n = GaugeMetricFamily("dualread_drift_window", "Answers in the drift window.")
        if stats:
            for name, (stat, pv) in sorted(stats["ks"].items()):
                d.add_metric([name], stat)
                p.add_metric([name], pv)
            f.add_metric([], stats["flagged_share"])
            n.add_metric([], stats["n"])
        yield from (d, p, f, n)
