"""Prometheus metrics (prefix dualread_), one registry per app instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
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
        self.feedback = Counter("dualread_feedback", "Feedback received.", ["known"],
                                registry=r)
        self.feedback_auroc = Gauge("dualread_feedback_auroc",
                                    "AUROC of confidence on the feedback window.", registry=r)
        self.feedback_ece = Gauge("dualread_feedback_ece",
                                  "ECE-15 of confidence on the feedback window.", registry=r)
        self.feedback_risk = Gauge("dualread_feedback_selective_risk",
                                   "Error rate among non-deferred answers (feedback window).",
                                   registry=r)
        self.feedback_defer_rate = Gauge("dualread_feedback_defer_rate",
                                         "Defer rate on the feedback window.", registry=r)
        self.model_info = Info("dualread_model", "Loaded actor and heads.", registry=r)

    def set_feedback(self, stats: dict[str, float]) -> None:
        if not stats:
            return
        self.feedback_auroc.set(stats["auroc"])
        self.feedback_ece.set(stats["ece"])
        self.feedback_risk.set(stats["selective_risk"])
        self.feedback_defer_rate.set(stats["defer_rate"])
