"""Prometheus metrics (prefix dualread_), one registry per app instance, fed by hooks.

The feedback-window statistics (AUROC, ECE, ...) are computed when /metrics is scraped,
and only when feedback arrived since the last scrape: a /feedback request does O(1) work.
Before any feedback they are absent rather than 0 (0 would read as a real value).
"""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily

from app.engine import BatcherHooks, Job
from app.serving import AnswerResult, ServingHooks
from clients.schemas import DeferCode
from heads.monitor import FeedbackMonitor

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FEEDBACK_GAUGES = {
    "auroc": ("dualread_feedback_auroc", "AUROC of confidence on the feedback window."),
    "ece": ("dualread_feedback_ece", "ECE-15 of confidence on the feedback window."),
    "selective_risk": ("dualread_feedback_selective_risk",
                       "Error rate among non-deferred answers (feedback window)."),
    "defer_rate": ("dualread_feedback_defer_rate", "Defer rate on the feedback window."),
    "n": ("dualread_feedback_window", "Answers with feedback in the window."),
}


# the label values of dualread_defer_reasons_total: the response's defer_reasons codes
DEFER_REASONS = tuple(c.value for c in DeferCode)


class FeedbackCollector:
    """Window statistics at scrape time, recomputed only after new feedback."""

    def __init__(self, monitor: FeedbackMonitor) -> None:
        self.monitor = monitor
        self.version = 0
        self.cached: tuple[int, dict[str, float]] = (-1, {})
        self.lock = threading.Lock()

    def changed(self) -> None:
        self.version += 1

    def stats(self) -> dict[str, float]:
        with self.lock:
            version = self.version
            if self.cached[0] != version:
                self.cached = (version, self.monitor.stats())
            return self.cached[1]

    def collect(self):
        stats = self.stats()
        for key, (name, doc) in FEEDBACK_GAUGES.items():
            # a NaN gauge (AUROC with one class so far, risk with nothing kept) breaks
            # alert arithmetic: such a statistic is absent until it is defined
            if key in stats and math.isfinite(stats[key]):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], stats[key])
                yield g


class Metrics:
    def __init__(self, monitor: FeedbackMonitor | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.request_duration = Histogram(
            "dualread_request_duration_seconds", "Request latency by route.", ["route"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("dualread_requests", "Requests by route and status.",
                                ["route", "status"], registry=r)
        self.stage_duration = Histogram(
            "dualread_stage_duration_seconds", "Time per pipeline stage.", ["stage"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("dualread_batch_size", "Items per model batch.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.queue_depth = Gauge("dualread_queue_depth", "Jobs waiting for the model.",
                                 registry=r)
        self.confidence = Histogram("dualread_confidence", "DualRead confidence of answers.",
                                    buckets=tuple(i / 10 for i in range(1, 11)), registry=r)
        self.defer = Counter("dualread_defer", "Answers flagged for deferral.", registry=r)
        self.defer_reasons = Counter(
            "dualread_defer_reasons", "Deferred answers by reason (the defer_reasons codes; "
            "an answer deferred for several reasons counts under each).",
            ["reason"], registry=r)
        for reason in DEFER_REASONS:     # every series exists from the start, at 0
            self.defer_reasons.labels(reason)
        self.feedback = Counter("dualread_feedback", "Feedback received.", ["known"],
                                registry=r)
        self.model_info = Info("dualread_model", "Loaded actor and heads.", registry=r)
        self.feedback_stats = FeedbackCollector(monitor or FeedbackMonitor())
        r.register(self.feedback_stats)


class MetricsHooks(ServingHooks, BatcherHooks):
    """Bookkeeping on the serving and batching hooks: metrics and the feedback monitor."""

    def __init__(self, metrics: Metrics, monitor: FeedbackMonitor) -> None:
        self.metrics = metrics
        self.monitor = monitor

    def batch_started(self, handler: str, jobs: list[Job]) -> None:
        self.metrics.batch_size.observe(len(jobs))
        for j in jobs:
            self.metrics.stage_duration.labels("queue").observe(j.queued_s)

    def depth_changed(self, depth: int) -> None:
        self.metrics.queue_depth.set(depth)

    def answered(self, request_id: str, result: AnswerResult, queued_s: float) -> None:
        m = self.metrics
        m.stage_duration.labels("generate").observe(result.timings.generate)
        m.stage_duration.labels("readout").observe(result.timings.readout)
        m.stage_duration.labels("heads").observe(result.timings.heads)
        if result.defer:
            m.defer.inc()
            for code in result.defer_codes:
                m.defer_reasons.labels(code).inc()
        if result.confidence is None:   # answer-only: no confidence to watch or calibrate
            return
        m.confidence.observe(result.confidence.dualread)
        self.monitor.record(request_id, result.confidence.dualread, result.defer,
                            getattr(result, "served", None))

    def feedback(self, request_id: str, correct: bool) -> bool:
        known = self.monitor.feedback(request_id, correct)
        self.metrics.feedback.labels(str(known).lower()).inc()
        if known:
            self.metrics.feedback_stats.changed()
        return known
