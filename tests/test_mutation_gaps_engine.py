"""Edges of the micro-batcher that mutation testing found untested: idleness, retries of
small batches, jobs cancelled while their batch runs, what the hooks are told, the worker
thread (one, even for two dispatches at once), the error messages and the hook failure's
log line, the sweep of gone jobs at a full queue, a deadline that is exactly now, and
`stop()` after the loop was cancelled mid-batch.

No timing thresholds: waits are ceilings the tests never reach (a full batch ends them),
and durations are only checked against the elapsed time around them. Every wait on the
batcher is bounded by the guard of `tests.test_engine`, so a deadlocked batcher fails fast.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.engine import Batcher, BatcherHooks, queued_seconds
from app.errors import DeadlineExceeded, EngineError, QueueFull
from tests.test_engine import FAR, GUARD_S, Recorder, run, until, within

LONG_WAIT_MS = 600_000     # never reached: each batch below fills before it


def deadline() -> float:
    return time.monotonic() + FAR


async def _outcomes(b: Batcher, payloads: list) -> list:
    """Submit `payloads` as one kind, run the batcher, and return each job's result or
    exception, in order."""
    jobs = b.submit_many("x", payloads, deadline())
    b.start()
    try:
        return await within(asyncio.gather(*(j.future for j in jobs), return_exceptions=True))
    finally:
        await within(b.stop())


def test_queued_seconds_by_hand():
    assert queued_seconds(1.0, 3.5) == 2.5
    assert queued_seconds(5.0, 3.0) == 0.0       # not started yet (started = 0)


def test_idle_only_with_an_empty_queue_and_nothing_running():
    gate = threading.Event()
    h = Recorder(gate=gate)

    async def body():
        b = Batcher({"x": h}, max_batch=1, wait_ms=0, queue_limit=8)
        states = [b.idle()]                       # fresh
        b.submit("x", 1, deadline())
        states.append(b.idle())                   # queued, not started
        b.start()
        try:
            await until(lambda: b.inflight)
            states.append((b.depth, b.inflight, b.idle()))   # running, queue empty
            gate.set()
            await until(lambda: b.inflight == 0)
            states.append(b.idle())
            return states
        finally:
            gate.set()                                # never leave the worker at the gate
            await within(b.stop())

    assert run(body()) == [True, False, (0, 1, False), True]


@pytest.mark.parametrize("payloads, batches", [
    ([1], [[1]]),                        # a lone failing job is not retried
    ([5, 1], [[5, 1], [5], [1]]),        # a failing pair is retried item by item
])
def test_retries_isolate_a_failure_only_in_a_batch_of_several(payloads, batches):
    h = Recorder(fail_on=1)

    out = run(_outcomes(Batcher({"x": h}, max_batch=2, wait_ms=0, queue_limit=8), payloads))
    assert isinstance(out[-1], ValueError)
    assert out[:-1] == [10] * (len(payloads) - 1)
    assert h.batches == batches


def test_a_job_cancelled_while_its_batch_runs_does_not_stop_the_others():
    gate = threading.Event()
    h = Recorder(gate=gate)

    async def body():
        b = Batcher({"x": h}, max_batch=3, wait_ms=LONG_WAIT_MS, queue_limit=8)
        jobs = b.submit_many("x", [1, 2, 3], deadline())
        b.start()
        try:
            await until(lambda: b.inflight)
            jobs[1].future.cancel()                   # its caller gave up mid-batch
            gate.set()
            return await within(asyncio.gather(jobs[0].future, jobs[2].future))
        finally:
            gate.set()
            await within(b.stop())

    assert run(body()) == [2, 6]
    assert h.batches == [[1, 2, 3]]


def test_hooks_see_depths_finished_batches_and_queue_times():
    depths, finished = [], []

    class Hooks(BatcherHooks):
        def depth_changed(self, depth):
            depths.append(depth)

        def batch_finished(self, handler, jobs, seconds):
            finished.append((handler, [j.payload for j in jobs], seconds))

    async def body():
        b = Batcher({"x": Recorder()}, max_batch=2, wait_ms=0, queue_limit=8, hooks=Hooks())
        jobs = b.submit_many("x", [1, 2, 3], deadline())
        t0 = time.perf_counter()
        b.start()
        try:
            await within(asyncio.gather(*(j.future for j in jobs)))
            return jobs, time.perf_counter() - t0
        finally:
            await within(b.stop())

    jobs, elapsed = run(body())
    # submitted 3; after the first batch is gathered 1 is left, after the second none
    assert depths == [3, 1, 0]
    assert [(n, p) for n, p, _ in finished] == [("x", [1, 2]), ("x", [3])]
    assert all(0 <= s <= elapsed for _, _, s in finished)
    assert [j.batch for j in jobs] == [2, 2, 1]
    assert all(0 <= j.queued_s <= elapsed for j in jobs)
    assert jobs[0].started == jobs[1].started <= jobs[2].started


def test_the_handler_runs_in_the_model_thread():
    names = []

    def handler(payloads, deadlines):
        names.append(threading.current_thread().name)
        return payloads

    async def body():
        b = Batcher({"x": handler}, max_batch=8, wait_ms=0, queue_limit=8)
        job = b.submit("x", 1, deadline())
        b.start()
        try:
            await within(job.future)
        finally:
            await within(b.stop())

    run(body())
    assert len(names) == 1 and names[0].startswith("model")


@pytest.mark.parametrize("returned, says", [
    (lambda p: p[:-1], "handler returned 2 results for 3 jobs"),
    (lambda p: None, "handler returned NoneType results for 3 jobs"),
    (lambda p: {"rows": p}, "handler returned dict results for 3 jobs"),   # not a Sequence
])
def test_wrong_number_of_results_says_what_came_back(returned, says):
    b = Batcher({"x": lambda p, d: returned(list(p))}, max_batch=8, wait_ms=0, queue_limit=8)
    out = run(_outcomes(b, [1, 2, 3]))
    assert all(isinstance(o, EngineError) and str(o) == says for o in out), out


def test_error_messages_name_the_cause():
    async def body():
        b = Batcher({"x": Recorder()}, max_batch=8, wait_ms=0, queue_limit=8)
        with pytest.raises(EngineError, match="no handler 'nope'"):
            b.submit("nope", 1, deadline())
        late = b.submit("x", 1, time.monotonic() - 1)
        b.start()
        try:
            out = await within(asyncio.gather(late.future, return_exceptions=True))
        finally:
            await within(b.stop())
        return out[0]

    late = run(body())
    assert isinstance(late, DeadlineExceeded)
    assert str(late) == "deadline passed while queued"


def test_gone_jobs_are_swept_only_for_a_request_that_would_not_fit():
    """The sweep of gone callers' jobs runs when a request would overflow the queue (not
    when it fits exactly), and reports the depth it leaves, whether the request is then
    refused or fills the queue exactly."""
    depths: list[int] = []

    class Hooks(BatcherHooks):
        def depth_changed(self, depth):
            depths.append(depth)

    async def body():
        b = Batcher({"x": Recorder()}, max_batch=8, wait_ms=0, queue_limit=3, hooks=Hooks())
        try:
            gone = b.submit_many("x", [1, 2], deadline())
            gone[0].future.cancel()
            b.submit("x", 3, deadline())            # 2 + 1 fits exactly: no sweep
            assert b.depth == 3
            with pytest.raises(QueueFull):
                b.submit_many("x", [4, 5], deadline())  # swept to 2; 2 + 2 is too many
            b.queue[0].future.cancel()
            b.submit_many("x", [4, 5], deadline())  # swept to 1; 1 + 2 fits exactly
            return b.depth
        finally:
            await within(b.stop())

    assert run(body()) == 3
    assert depths == [2, 3, 2, 1, 3]


def test_a_failing_hook_is_logged_with_its_name_and_the_exception_type(caplog):
    class Broken(BatcherHooks):
        def depth_changed(self, depth):
            raise KeyError("gauge")

    async def body():
        b = Batcher({"x": Recorder()}, max_batch=8, wait_ms=0, queue_limit=8, hooks=Broken())
        b.submit("x", 1, deadline())
        await within(b.stop())

    with caplog.at_level("ERROR", logger="dualread.engine"):
        run(body())
    messages = [r.getMessage() for r in caplog.records if r.name == "dualread.engine"]
    assert messages and set(messages) == {"batcher hook depth_changed failed: KeyError"}


def test_a_job_at_exactly_its_deadline_still_runs(monkeypatch):
    """Passed means strictly after, as for the actor's DeadlineCriteria (it stops a row
    once now > deadline): with the module's clock frozen, a job whose deadline is now is
    run, one a microsecond earlier is refused."""
    from types import SimpleNamespace

    import app.engine as engine

    now = 1000.0
    monkeypatch.setattr(engine, "time", SimpleNamespace(
        monotonic=lambda: now, perf_counter=time.perf_counter))
    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=0, queue_limit=8)
        jobs = [b.submit("x", 1, now), b.submit("x", 2, now - 1e-6)]
        b.start()
        try:
            return await within(asyncio.gather(*(j.future for j in jobs),
                                               return_exceptions=True))
        finally:
            await within(b.stop())

    at, before = run(body())
    assert at == 2 and isinstance(before, DeadlineExceeded)
    assert h.batches == [[1]]


def test_model_calls_never_overlap_even_from_two_dispatches():
    """One thread owns the model: a second `_dispatch` (two `@serve.batch` calls at once)
    queues its call behind the running one, in the same thread, instead of starting it
    beside it in another."""
    gate = threading.Event()
    names: list[str] = []
    started: list[str] = []

    def handler(payloads, deadlines):
        gate.wait(GUARD_S)
        names.append(threading.current_thread().name)
        return payloads

    class Hooks(BatcherHooks):
        def batch_started(self, handler, jobs):
            started.append(handler)

    async def body():
        b = Batcher({"x": handler}, max_batch=8, wait_ms=0, queue_limit=8, hooks=Hooks())
        one, two = b.submit("x", 1, deadline()), b.submit("x", 2, deadline())
        try:
            first = asyncio.ensure_future(b._dispatch([one]))
            second = asyncio.ensure_future(b._dispatch([two]))
            await until(lambda: len(started) == 2)    # both calls handed to the pool
            gate.set()
            await within(asyncio.gather(first, second))
            return [one.future.result(), two.future.result()]
        finally:
            gate.set()
            await within(b.stop())

    assert run(body()) == [1, 2]
    assert len(names) == 2 and names[0] == names[1], names


def test_stop_after_the_loop_was_cancelled_mid_batch_returns_at_once():
    """A loop task cancelled while the model runs (its thread cannot be): `stop()` neither
    raises the cancellation nor blocks the event loop until the model call ends."""
    gate = threading.Event()
    h = Recorder(gate=gate)

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=0, queue_limit=8)
        b.submit("x", 1, deadline())
        b.start()
        try:
            await until(lambda: b.inflight)
            b.task.cancel()
            await within(b.stop())
            return list(h.batches)                  # the model call is still at the gate
        finally:
            gate.set()

    assert run(body()) == []
