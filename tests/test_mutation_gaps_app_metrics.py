"""The Prometheus metrics and their hooks by hand (mutation gaps of app/metrics.py): what
each hook observes and under which label, the histogram buckets, the feedback statistics
recomputed only after new feedback, and the answer-only path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.metrics import LATENCY_BUCKETS, FeedbackCollector, Metrics, MetricsHooks
from app.serving import AnswerResult, Confidences, StageTimes
from heads.monitor import FeedbackMonitor


def _result(defer: bool, codes: tuple[str, ...] = (), dualread: float | None = 0.4,
            served: object = None) -> AnswerResult:
    conf = Confidences(dualread, 0.5, 0.6, 0.7) if dualread is not None else None
    return AnswerResult("red", "red", "r", conf, defer, None, StageTimes(0.2, 0.03, 0.004),
                        defer_codes=codes, served=served)


def _value(m: Metrics, name: str, labels: dict | None = None) -> float | None:
    return m.registry.get_sample_value(name, labels or {})


def _buckets(m: Metrics, name: str, labels: dict | None = None) -> list[float]:
    return [float(s.labels["le"]) for fam in m.registry.collect() for s in fam.samples
            if s.name == name + "_bucket"
            and all(s.labels.get(k) == v for k, v in (labels or {}).items())]


def test_buckets_of_every_histogram():
    m = Metrics()
    m.request_duration.labels("/answer").observe(0.3)
    m.stage_duration.labels("queue").observe(0.3)
    m.batch_size.observe(3)
    m.confidence.observe(0.55)
    inf = float("inf")
    assert _buckets(m, "dualread_request_duration_seconds") == [*LATENCY_BUCKETS, inf]
    assert _buckets(m, "dualread_stage_duration_seconds") == [*LATENCY_BUCKETS, inf]
    assert _buckets(m, "dualread_batch_size") == [1, 2, 4, 8, 16, 32, 64, 128, inf]
    assert _buckets(m, "dualread_confidence") == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, inf])
    assert _value(m, "dualread_request_duration_seconds_bucket",
                  {"route": "/answer", "le": "0.25"}) == 0
    assert _value(m, "dualread_request_duration_seconds_bucket",
                  {"route": "/answer", "le": "0.5"}) == 1
    assert _value(m, "dualread_confidence_bucket", {"le": "0.6"}) == 1
    assert _value(m, "dualread_confidence_bucket", {"le": "0.5"}) == 0


def test_the_registry_is_the_instance_s_own_and_lists_every_family():
    a, b = Metrics(), Metrics()
    a.requests.labels("/answer", "200").inc()
    assert _value(a, "dualread_requests_total", {"route": "/answer", "status": "200"}) == 1
    assert _value(b, "dualread_requests_total", {"route": "/answer", "status": "200"}) is None
    a.model_info.info({"actor": "x"})
    assert _value(a, "dualread_model_info", {"actor": "x"}) == 1
    a.queue_depth.set(3)
    assert _value(a, "dualread_queue_depth") == 3
    fams = {f.name: f.type for f in a.registry.collect()}
    assert {k: fams.get(k) for k in (
        "dualread_request_duration_seconds", "dualread_requests", "dualread_stage_duration_seconds",
        "dualread_batch_size", "dualread_queue_depth", "dualread_confidence", "dualread_defer",
        "dualread_defer_reasons", "dualread_feedback", "dualread_model")} == {
        "dualread_request_duration_seconds": "histogram", "dualread_requests": "counter",
        "dualread_stage_duration_seconds": "histogram", "dualread_batch_size": "histogram",
        "dualread_queue_depth": "gauge", "dualread_confidence": "histogram",
        "dualread_defer": "counter", "dualread_defer_reasons": "counter",
        "dualread_feedback": "counter", "dualread_model": "info"}
    assert all(f.documentation for f in a.registry.collect())


def test_batches_queue_depth_and_stage_times():
    monitor = FeedbackMonitor(50)
    m = Metrics(monitor)
    hooks = MetricsHooks(m, monitor)
    hooks.batch_started("answer", [SimpleNamespace(queued_s=0.5), SimpleNamespace(queued_s=2.0)])
    assert _value(m, "dualread_batch_size_count") == 1
    assert _value(m, "dualread_batch_size_sum") == 2
    assert _value(m, "dualread_stage_duration_seconds_count", {"stage": "queue"}) == 2
    assert _value(m, "dualread_stage_duration_seconds_sum", {"stage": "queue"}) == 2.5
    hooks.depth_changed(7)
    assert _value(m, "dualread_queue_depth") == 7
    hooks.answered("a", _result(False), 0.0)
    for stage, want in (("generate", 0.2), ("readout", 0.03), ("heads", 0.004)):
        assert _value(m, "dualread_stage_duration_seconds_sum", {"stage": stage}) == \
            pytest.approx(want)
        assert _value(m, "dualread_stage_duration_seconds_count", {"stage": stage}) == 1


def test_an_answer_is_watched_with_its_served_record():
    monitor = FeedbackMonitor(50)
    m = Metrics(monitor)
    hooks = MetricsHooks(m, monitor)
    rec = object()
    hooks.answered("a", _result(True, ("low_confidence",), 0.3, served=rec), 0.0)
    hooks.answered("b", _result(False, (), 0.8), 0.0)
    assert _value(m, "dualread_confidence_count") == 2
    assert _value(m, "dualread_confidence_sum") == pytest.approx(1.1)
    assert _value(m, "dualread_defer_total") == 1
    assert monitor.pending == {"a": (0.3, True), "b": (0.8, False)}
    assert monitor.take_served("a") is rec and monitor.take_served("b") is None


def test_an_answer_only_result_counts_its_deferral_and_nothing_else():
    monitor = FeedbackMonitor(50)
    m = Metrics(monitor)
    hooks = MetricsHooks(m, monitor)
    hooks.answered("a", _result(True, ("truncated",), None), 0.0)
    assert _value(m, "dualread_defer_total") == 1
    assert _value(m, "dualread_defer_reasons_total", {"reason": "truncated"}) == 1
    assert _value(m, "dualread_confidence_count") == 0
    assert monitor.pending == {}


def test_feedback_is_counted_by_whether_the_answer_was_known():
    monitor = FeedbackMonitor(50)
    m = Metrics(monitor)
    hooks = MetricsHooks(m, monitor)
    hooks.answered("a", _result(False, (), 0.9), 0.0)
    v0 = m.feedback_stats.version
    assert hooks.feedback("zzz", True) is False
    assert m.feedback_stats.version == v0                 # nothing new to compute
    assert hooks.feedback("a", True) is True
    assert m.feedback_stats.version == v0 + 1
    assert monitor.window[-1] == (0.9, False, True)       # the verdict as given
    hooks.answered("b", _result(True, ("low_confidence",), 0.2), 0.0)
    assert hooks.feedback("b", False) is True
    assert m.feedback_stats.version == v0 + 2               # each new verdict counts
    assert monitor.window[-1] == (0.2, True, False)
    assert _value(m, "dualread_feedback_total", {"known": "true"}) == 2
    assert _value(m, "dualread_feedback_total", {"known": "false"}) == 1
    assert _value(m, "dualread_feedback_window") == 2


class _Counting:
    def __init__(self) -> None:
        self.calls, self.n = 0, 0

    def stats(self) -> dict[str, float]:
        self.calls += 1
        return {"n": float(self.n), "auroc": float("inf"), "ece": 0.25, "defer_rate": 0.0}


def test_statistics_are_recomputed_only_after_new_feedback():
    mon = _Counting()
    col = FeedbackCollector(mon)
    assert col.stats() == {"n": 0.0, "auroc": float("inf"), "ece": 0.25, "defer_rate": 0.0}
    col.stats()
    assert mon.calls == 1
    mon.n = 5
    assert col.stats()["n"] == 0.0                       # cached until told
    col.changed()
    assert col.stats()["n"] == 5.0 and mon.calls == 2
    col.stats()
    assert mon.calls == 2
    mon.n = 6
    col.changed()                                        # a second change is seen too
    assert col.stats()["n"] == 6.0 and mon.calls == 3
    got = {g.name: (g.documentation, g.samples[0].value, g.samples[0].labels)
           for g in col.collect()}
    # an infinite statistic is left out like a NaN; 0 is a real value and is kept
    assert set(got) == {"dualread_feedback_window", "dualread_feedback_ece",
                        "dualread_feedback_defer_rate"}
    assert got["dualread_feedback_ece"][1:] == (0.25, {})
    assert got["dualread_feedback_defer_rate"][1] == 0.0
    assert got["dualread_feedback_window"][0] == "Answers with feedback in the window."


def test_feedback_before_the_first_scrape_is_reported_by_it():
    # the cache starts at a version no count of changes can reach: one verdict that
    # arrives before /metrics is first read still shows on that first read
    monitor = FeedbackMonitor(50)
    m = Metrics(monitor)
    hooks = MetricsHooks(m, monitor)
    hooks.answered("a", _result(False, (), 0.9), 0.0)
    assert hooks.feedback("a", True) is True
    assert _value(m, "dualread_feedback_window") == 1
    assert _value(m, "dualread_feedback_defer_rate") == 0.0
