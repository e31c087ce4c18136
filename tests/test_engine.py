"""The micro-batcher alone, driven by fake handlers (no model, milliseconds).

Every wait on the batcher is bounded by GUARD_S, so a batcher that deadlocks (a lost
wake-up, a dead loop task) fails its test within seconds instead of hanging it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from app.engine import Batcher, BatcherHooks
from app.errors import DeadlineExceeded, EngineError, QueueFull, ShuttingDown, TooManyItems

FAR = 3600.0   # a deadline no test reaches
# A ceiling on each wait, never a measurement: a correct run needs milliseconds, and no
# assertion depends on how long anything took.
GUARD_S = 5.0

T = TypeVar("T")


class Recorder:
    """A handler that records each batch it is given and echoes payloads doubled."""

    def __init__(self, fail_on=None, gate: threading.Event | None = None) -> None:
        self.batches: list[list] = []
        self.deadlines: list[list[float]] = []
        self.fail_on = fail_on
        self.gate = gate

    def __call__(self, payloads: list, deadlines: list[float]) -> list:
        if self.gate is not None:
            self.gate.wait(GUARD_S)
        self.batches.append(list(payloads))
        self.deadlines.append(list(deadlines))
        if self.fail_on is not None and self.fail_on in payloads:
            raise ValueError("bad item")
        return [2 * p for p in payloads]


def named_handlers(calls: list, *names: str, gate: threading.Event | None = None) -> dict:
    """One handler per name; each model call is recorded in `calls` as (name, payloads),
    in order, after `gate` (when given) is set; payloads come back doubled."""
    def named(name: str):
        def handler(payloads: list, deadlines: list[float]) -> list:
            if gate is not None:
                gate.wait(GUARD_S)
            calls.append((name, list(payloads)))
            return [2 * p for p in payloads]
        return handler
    return {name: named(name) for name in names}


def run(coro):
    return asyncio.run(coro)


async def within(aw: Awaitable[T]) -> T:
    """`aw`'s result; TimeoutError (a failed test) once the guard has passed."""
    return await asyncio.wait_for(aw, GUARD_S)


async def until(cond: Callable[[], object]) -> None:
    """Let the batcher run until `cond()` holds; TimeoutError if it never does."""
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.001)

    await within(poll())


async def _with(batcher: Batcher, body):
    batcher.start()
    try:
        return await within(body())
    finally:
        await within(batcher.stop())


def deadline() -> float:
    return time.monotonic() + FAR


def test_one_result_per_job_in_order():
    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=50, queue_limit=16)
        jobs = b.submit_many("x", [1, 2, 3], deadline())
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs)))

    assert run(body()) == [2, 4, 6]
    assert h.batches == [[1, 2, 3]]


def test_mixed_kinds_never_share_a_batch():
    a, s = Recorder(), Recorder()

    async def body():
        b = Batcher({"answer": a, "score": s}, max_batch=8, wait_ms=50, queue_limit=32)
        jobs = [b.submit("answer", 1, deadline(), key=8), b.submit("score", 10, deadline()),
                b.submit("answer", 2, deadline(), key=16), b.submit("answer", 3, deadline(), key=8),
                b.submit("score", 20, deadline())]
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs)))

    assert run(body()) == [2, 20, 4, 6, 40]
    # handler and key both separate batches: answer@8 {1, 3}, answer@16 {2}, score {10, 20}
    assert sorted(a.batches) == [[1, 3], [2]]
    assert s.batches == [[10, 20]]


def test_a_batch_fills_up_with_its_own_group_past_other_kinds():
    """With room for two, answers 1 and 2 share one batch although a score job sits between
    them in the queue; the score job runs after, alone. (A batch that took the next job of
    any kind would hold 1 and 10 and leave 2 to run alone.)"""
    calls: list[tuple[str, list]] = []            # every model call, in order

    async def body():
        b = Batcher(named_handlers(calls, "answer", "score"),
                    max_batch=2, wait_ms=50, queue_limit=16)
        jobs = [b.submit("answer", 1, deadline()), b.submit("score", 10, deadline()),
                b.submit("answer", 2, deadline())]
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs)))

    assert run(body()) == [2, 20, 4]
    assert calls == [("answer", [1, 2]), ("score", [10])]


def test_kinds_take_turns_when_both_are_queued():
    """Six score jobs (three batches of two) queued before one answer: the answer runs
    after the first score batch, not after all three; then the scores go on."""
    calls: list[tuple[str, list]] = []
    gate = threading.Event()                 # holds the first batch until all are queued

    async def body():
        b = Batcher(named_handlers(calls, "answer", "score", gate=gate),
                    max_batch=2, wait_ms=0, queue_limit=16)
        b.start()
        try:
            jobs = b.submit_many("score", [1, 2, 3, 4, 5, 6], deadline())
            await until(lambda: b.depth <= 4)          # the first score batch has started
            jobs.append(b.submit("answer", 10, deadline()))
            gate.set()
            return await within(asyncio.gather(*(j.future for j in jobs)))
        finally:
            await within(b.stop())

    assert run(body()) == [2, 4, 6, 8, 10, 12, 20]
    assert calls == [("score", [1, 2]), ("answer", [10]), ("score", [3, 4]),
                     ("score", [5, 6])]


def test_batch_is_capped_at_max_batch():
    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=2, wait_ms=50, queue_limit=16)
        jobs = b.submit_many("x", [1, 2, 3, 4, 5], deadline())
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs)))

    assert run(body()) == [2, 4, 6, 8, 10]
    assert h.batches == [[1, 2], [3, 4], [5]]


def test_queue_full_is_refused_whole():
    async def body():
        b = Batcher({"x": Recorder()}, max_batch=8, wait_ms=0, queue_limit=3)
        b.submit_many("x", [1, 2], deadline())
        with pytest.raises(QueueFull):
            b.submit_many("x", [3, 4], deadline())     # would need 4 slots of 3
        assert b.depth == 2                             # nothing of the refused request queued
        b.submit("x", 3, deadline())
        with pytest.raises(QueueFull):
            b.submit("x", 4, deadline())
        await within(b.stop())

    run(body())


def test_jobs_of_gone_callers_do_not_fill_the_queue():
    async def body():
        b = Batcher({"x": Recorder()}, max_batch=8, wait_ms=0, queue_limit=3)
        gone = b.submit_many("x", [1, 2], deadline())
        late = b.submit("x", 3, time.monotonic() - 1)       # its deadline has passed
        gone[0].future.cancel()                             # its caller has gone
        with pytest.raises(QueueFull):
            b.submit_many("x", [4, 5, 6], deadline())       # one live job is queued
        assert b.depth == 1 and isinstance(late.future.exception(), DeadlineExceeded)
        b.submit_many("x", [4, 5], deadline())              # room for two: admitted
        assert b.depth == 3
        await within(b.stop())

    run(body())


def test_the_queue_holds_a_counterfactual():
    from app.settings import Settings

    with pytest.raises(ValueError, match="queue_limit"):
        Settings(queue_limit=1)                  # a counterfactual's two jobs never fit
    assert Settings(queue_limit=2).queue_limit == 2


def test_a_request_larger_than_the_queue_is_413_not_a_429_to_retry():
    """Four items can never fit a queue of three, however long the client waits."""
    async def body():
        b = Batcher({"x": Recorder()}, max_batch=8, wait_ms=0, queue_limit=3)
        with pytest.raises(TooManyItems, match="needs 4 model jobs.*queue-limit 3\\)") as e:
            b.submit_many("x", [1, 2, 3, 4], deadline())
        assert e.value.status == 413 and b.depth == 0
        b.submit_many("x", [1, 2, 3], deadline())           # the whole queue: admitted
        await within(b.stop())

    run(body())


def test_one_failing_item_fails_alone():
    h = Recorder(fail_on=3)

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=50, queue_limit=16)
        jobs = b.submit_many("x", [1, 2, 3, 4], deadline())
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs),
                                                     return_exceptions=True))

    out = run(body())
    assert out[0] == 2 and out[1] == 4 and out[3] == 8
    assert isinstance(out[2], ValueError)
    # the batch failed once, then each item ran alone
    assert h.batches == [[1, 2, 3, 4], [1], [2], [3], [4]]


def test_handler_can_fail_one_item_by_returning_an_exception():
    def handler(payloads, deadlines):
        return [KeyError("no") if p == 2 else p for p in payloads]

    async def body():
        b = Batcher({"x": handler}, max_batch=8, wait_ms=50, queue_limit=16)
        jobs = b.submit_many("x", [1, 2, 3], deadline())
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs),
                                                     return_exceptions=True))

    out = run(body())
    assert out[0] == 1 and out[2] == 3 and isinstance(out[1], KeyError)


@pytest.mark.parametrize("returned", [lambda p: p[:-1], lambda p: p + p, lambda p: None])
def test_wrong_number_of_results_fails_the_batch(returned):
    def handler(payloads, deadlines):
        return returned(list(payloads))

    async def body():
        b = Batcher({"x": handler}, max_batch=8, wait_ms=50, queue_limit=16)
        jobs = b.submit_many("x", [1, 2, 3], deadline())
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs),
                                                     return_exceptions=True))

    out = run(body())
    assert all(isinstance(o, EngineError) for o in out), out


def test_cancelled_jobs_are_skipped():
    gate = threading.Event()
    h = Recorder(gate=gate)

    async def body():
        b = Batcher({"x": h}, max_batch=1, wait_ms=0, queue_limit=16)
        b.start()
        try:
            first = b.submit("x", 1, deadline())
            await until(lambda: b.inflight)          # the worker holds job 1 at the gate
            gone = b.submit("x", 2, deadline())
            kept = b.submit("x", 3, deadline())
            gone.future.cancel()                     # its caller timed out
            gate.set()
            return await within(asyncio.gather(first.future, kept.future))
        finally:
            gate.set()                               # never leave the worker at the gate
            await within(b.stop())

    assert run(body()) == [2, 6]
    assert h.batches == [[1], [3]]


def test_expired_jobs_are_not_run():
    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=0, queue_limit=16)
        late = b.submit("x", 1, time.monotonic() - 1)
        ok = b.submit("x", 2, deadline())
        return await _with(b, lambda: asyncio.gather(late.future, ok.future,
                                                     return_exceptions=True))

    late, ok = run(body())
    assert isinstance(late, DeadlineExceeded) and ok == 4
    assert h.batches == [[2]]


def test_deadlines_reach_the_handler():
    h = Recorder()
    when = time.monotonic() + 123.0

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=20, queue_limit=16)
        jobs = b.submit_many("x", [1, 2], when)
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs)))

    run(body())
    assert h.deadlines == [[when, when]]


def test_stop_refuses_queued_and_new_jobs():
    gate = threading.Event()
    h = Recorder(gate=gate)

    async def body():
        b = Batcher({"x": h}, max_batch=1, wait_ms=0, queue_limit=16)
        b.start()
        try:
            running = b.submit("x", 1, deadline())
            await until(lambda: b.inflight)
            queued = b.submit("x", 2, deadline())
            stopping = asyncio.ensure_future(b.stop())
            await asyncio.sleep(0)
            gate.set()
            await within(stopping)
            assert running.future.done()      # stop() returned only after the batch ended
            with pytest.raises(ShuttingDown):
                b.submit("x", 3, deadline())
            return await within(asyncio.gather(running.future, queued.future,
                                               return_exceptions=True))
        finally:
            gate.set()

    done, refused = run(body())
    assert done == 2                                   # the running batch finished
    assert isinstance(refused, ShuttingDown)


def test_hooks_see_every_batch():
    seen = []

    class Hooks(BatcherHooks):
        def batch_started(self, handler, jobs):
            seen.append((handler, [j.payload for j in jobs], [j.batch for j in jobs]))

    async def body():
        b = Batcher({"x": Recorder()}, max_batch=2, wait_ms=20, queue_limit=16, hooks=Hooks())
        jobs = b.submit_many("x", [1, 2, 3], deadline())
        return await _with(b, lambda: asyncio.gather(*(j.future for j in jobs)))

    run(body())
    assert seen == [("x", [1, 2], [2, 2]), ("x", [3], [1])]


def test_a_hook_that_raises_is_logged_and_every_job_is_still_answered(caplog):
    """Metrics hooks are not the batcher's business: one that raises must not end the loop
    (every later caller would wait until its timeout)."""
    class Broken(BatcherHooks):
        def batch_started(self, handler, jobs):
            raise RuntimeError("metrics down")

        def batch_finished(self, handler, jobs, seconds):
            raise RuntimeError("metrics down")

        def depth_changed(self, depth):
            raise RuntimeError("metrics down")

    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=2, wait_ms=20, queue_limit=16, hooks=Broken())
        b.start()
        try:
            first = b.submit_many("x", [1, 2, 3], deadline())
            got = await within(asyncio.gather(*(j.future for j in first)))
            later = b.submit_many("x", [4], deadline())      # the loop is still alive
            return got + await within(asyncio.gather(*(j.future for j in later)))
        finally:
            await within(b.stop())

    with caplog.at_level("ERROR", logger="dualread.engine"):
        assert run(body()) == [2, 4, 6, 8]
    records = [r for r in caplog.records if r.name == "dualread.engine"]
    assert {r.getMessage().split()[2] for r in records} == \
        {"batch_started", "batch_finished", "depth_changed"}
    # every failure is logged, its traceback once per hook
    assert len(records) > 3 and sum(r.exc_info is not None for r in records) == 3


# A window no test waits out: a batch that waited for it would trip the guard instead.
HUGE_WAIT_MS = 3_600_000


def test_a_lone_job_does_not_wait_for_the_window():
    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=HUGE_WAIT_MS, queue_limit=16)
        b.start()
        try:
            job = b.submit("x", 5, deadline())
            return await within(job.future)
        finally:
            await within(b.stop())

    assert run(body()) == 10
    assert h.batches == [[5]]


def test_window_waits_for_as_many_callers_as_the_last_batch():
    """After a batch of two, a lone job waits for company, and a second arrival (not the
    window) ends the wait: both run as one batch."""
    h = Recorder()

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=HUGE_WAIT_MS, queue_limit=16)
        b.start()
        try:
            pair = b.submit_many("x", [1, 2], deadline())
            await within(asyncio.gather(*(j.future for j in pair)))
            third = b.submit("x", 3, deadline())
            await until(lambda: not b.depth)    # the batcher has taken job 3 and waits
            assert not third.future.done() and not b.inflight
            fourth = b.submit("x", 4, deadline())
            return await within(asyncio.gather(third.future, fourth.future))
        finally:
            await within(b.stop())

    assert run(body()) == [6, 8]
    assert h.batches == [[1, 2], [3, 4]]


def test_company_expected_in_one_group_does_not_delay_another():
    """A batch of two score jobs does not make a lone answer job wait for company."""
    a, s = Recorder(), Recorder()

    async def body():
        b = Batcher({"answer": a, "score": s}, max_batch=8, wait_ms=HUGE_WAIT_MS,
                    queue_limit=16)
        b.start()
        try:
            pair = b.submit_many("score", [1, 2], deadline())
            await within(asyncio.gather(*(j.future for j in pair)))
            lone = b.submit("answer", 3, deadline())
            return await within(lone.future)
        finally:
            await within(b.stop())

    assert run(body()) == 6
    assert s.batches == [[1, 2]] and a.batches == [[3]]


class Gated(Recorder):
    """A Recorder whose first call waits at a gate (the later ones run at once)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.first_gate = gate

    def __call__(self, payloads: list, deadlines: list[float]) -> list:
        if not self.batches:
            self.first_gate.wait(GUARD_S)
        return super().__call__(payloads, deadlines)


# Long enough that a client's next request (one event-loop turn away) always lands inside
# it; only the final lone job waits it out.
WINDOW_MS = 200


def test_staggered_clients_coalesce_after_the_first_batch():
    """Client B arrives while A's first job runs. Counting only the previous batch's size
    (1) ran every later job alone, A and B alternating; counting B's arrival as well makes
    the next batch wait for A's next request, and from then on both share each batch."""
    gate = threading.Event()
    h = Gated(gate)
    n = 8

    async def client(b: Batcher, tag: str) -> None:
        for k in range(n):
            await b.submit("x", f"{tag}{k}", deadline()).future

    async def body():
        # a window long beside an event-loop turn (a slow machine must not make A miss it),
        # short enough that B's last job, which waits it out alone, stays inside the guard
        b = Batcher({"x": h}, max_batch=8, wait_ms=1000, queue_limit=16)
        b.start()
        try:
            a = asyncio.ensure_future(client(b, "a"))
            await until(lambda: b.inflight)     # A's first job holds the worker at the gate
            c = asyncio.ensure_future(client(b, "b"))
            await until(lambda: b.depth)        # B's first job waits in the queue
            gate.set()
            await within(asyncio.gather(a, c))
        finally:
            gate.set()
            await within(b.stop())

    run(body())
    sizes = [len(x) for x in h.batches]
    assert sum(sizes) == 2 * n
    assert sizes[0] == 1 and h.batches[0] == ["a0"]
    # after the first batch only B's last job (A has finished) may run alone
    assert sizes[1:].count(1) <= 1, sizes
    assert sizes[1:-1] == [2] * (n - 1), sizes


def test_jobs_abandoned_during_a_failed_batch_are_not_retried():
    """A batch that raises is retried item by item; an item whose caller left meanwhile
    (its future cancelled) is dropped, not run again."""
    gate = threading.Event()
    h = Recorder(fail_on=3, gate=gate)

    async def body():
        b = Batcher({"x": h}, max_batch=8, wait_ms=0, queue_limit=16)
        jobs = b.submit_many("x", [1, 2, 3, 4], deadline())
        b.start()
        try:
            await until(lambda: b.inflight)
            jobs[1].future.cancel()               # its caller gave up (504) while it ran
            gate.set()
            return await within(asyncio.gather(
                *(jobs[k].future for k in (0, 2, 3)), return_exceptions=True))
        finally:
            gate.set()
            await within(b.stop())

    one, three, four = run(body())
    assert (one, four) == (2, 8) and isinstance(three, ValueError)
    assert h.batches == [[1, 2, 3, 4], [1], [3], [4]]


def test_dispatch_drops_a_job_abandoned_while_an_earlier_group_ran():
    """`_dispatch` (the Ray path) may get several groups: one whose caller leaves while
    an earlier group runs is dropped before its own call, not run."""
    gate = threading.Event()
    a, s = Recorder(gate=gate), Recorder()

    async def body():
        b = Batcher({"answer": a, "score": s}, max_batch=8, wait_ms=0, queue_limit=16)
        jobs = [b.submit("answer", 1, deadline()), b.submit("score", 10, deadline()),
                b.submit("score", 20, deadline())]
        try:
            task = asyncio.ensure_future(b._dispatch(jobs))
            await until(lambda: b.inflight)          # the answer group holds the worker
            jobs[1].future.cancel()
            gate.set()
            await within(task)
            return [jobs[0].future.result(), jobs[2].future.result()]
        finally:
            gate.set()
            await within(b.stop())

    assert run(body()) == [2, 40]
    assert a.batches == [[1]] and s.batches == [[20]]


def test_a_job_whose_client_has_gone_is_dropped_before_it_runs(caplog):
    """While the worker is busy, a waiting request whose client disconnects gets
    ClientGone and its job never reaches a handler (a client that times out and retries
    adds no model work); nothing is logged as an error on the way."""
    import gc
    import logging
    from types import SimpleNamespace

    from app.errors import ClientGone
    from app.serving import Serving

    gate = threading.Event()
    h = Recorder(gate=gate)
    batcher = Batcher({"answer": h}, max_batch=1, wait_ms=0, queue_limit=8)
    serving = Serving.__new__(Serving)
    serving.settings = SimpleNamespace(request_timeout_s=FAR)
    polls = []

    async def gone() -> bool:
        polls.append(1)
        return len(polls) >= 2          # the client leaves after the first poll

    async def body():
        busy = batcher.submit("answer", 1, deadline())          # holds the worker
        await until(lambda: h.gate is not None and batcher.inflight >= 1)
        [left] = batcher.submit_many("answer", [2], deadline())
        with pytest.raises(ClientGone):
            await serving._await([left], gone)
        assert left.future.cancelled()
        gate.set()
        assert await within(busy.future) == 2
        still = batcher.submit("answer", 3, deadline())         # the worker goes on
        assert await within(still.future) == 6

    with caplog.at_level(logging.WARNING):
        run(_with(batcher, body))
        gc.collect()                    # an unread cancelled wrapper would log here
    assert [p for b in h.batches for p in b] == [1, 3]       # 2 never ran
    assert len(polls) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_timed_out_request_is_a_deadline_error_and_logs_nothing(caplog):
    import gc
    import logging
    from types import SimpleNamespace

    from app.serving import Serving

    gate = threading.Event()
    h = Recorder(gate=gate)
    batcher = Batcher({"answer": h}, max_batch=1, wait_ms=0, queue_limit=8)
    serving = Serving.__new__(Serving)
    serving.settings = SimpleNamespace(request_timeout_s=0.05)

    async def never_gone() -> bool:
        return False

    async def body():
        busy = batcher.submit("answer", 1, deadline())
        jobs = batcher.submit_many("answer", [2, 3], deadline())
        with pytest.raises(DeadlineExceeded):
            await serving._await(jobs, never_gone)
        assert all(j.future.cancelled() for j in jobs)
        gate.set()
        assert await within(busy.future) == 2

    with caplog.at_level(logging.WARNING):
        run(_with(batcher, body))
        gc.collect()
    assert [p for b in h.batches for p in b] == [1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_limits_share_a_batch_within_a_power_of_two():
    """Answers whose limits differ by a token share a batch; a short one never waits for a
    row over twice its length."""
    from app.serving import limit_bucket

    assert [limit_bucket(n) for n in (1, 2, 3, 4, 5, 8, 57, 64, 65, 1024)] == \
        [1, 2, 4, 4, 8, 8, 64, 64, 128, 1024]
    for n in range(1, 1025):
        assert n <= limit_bucket(n) < 2 * n
