"""The model worker: one thread owns the model; compatible jobs coalesce into micro-batches.

Jobs with the same key (handler name + an optional compatibility key; for answers, the
generation limit's power-of-two bucket: each row stops at its own limit) run as one call,
up to the max batch, in a single worker thread, so the event loop never blocks on the model.
Jobs with different keys never share a batch. The queue is bounded: a full queue is
refused at once (429) rather than growing latency.

A batch starts with the oldest job of another group than the batch before it, when one
is queued (groups take turns), else with the oldest job; it takes every compatible job
already queued (those that arrived while the previous batch ran). It then waits up to the
wait window for more only while it holds fewer jobs than its group's previous batch held
plus the group's jobs that arrived while that batch ran: that many callers were recently
active and are likely about to send again. A lone
caller therefore never pays the window, concurrent callers meet in one batch, and a caller
that arrives while a batch runs is waited for next time (counting only the previous batch
locked staggered callers into batches of one). Jobs whose caller has gone (future done)
or whose deadline passed are dropped right before each model call, never run.

Contract with a handler: it receives the payloads and deadlines of one batch and returns
one entry per job, in order: a result, or an exception instance for that job alone. If it
raises instead, each job of the batch is retried alone, so one bad item fails only
itself. A handler that returns the wrong number of entries fails the whole batch with
EngineError (a bug, not a client error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app.errors import (
    DeadlineExceeded,
    EngineError,
    QueueFull,
    ShuttingDown,
    TooManyItems,
)

log = logging.getLogger("dualread.engine")

Handler = Callable[[list[Any], list[float]], Sequence[Any]]


@dataclass(eq=False)
class Job:
    handler: str
    key: Hashable
    payload: Any
    deadline: float                    # time.monotonic() seconds
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    batch: int = 0

    @property
    def group(self) -> tuple[str, Hashable]:
        return self.handler, self.key

    @property
    def queued_s(self) -> float:
        return queued_seconds(self.enqueued, self.started)


def queued_seconds(enqueued: float, started: float) -> float:
    """Time a job waited in the queue; 0 before it starts (a plain function, not the
    property, so that mutation testing reaches it)."""
    return max(0.0, started - enqueued)


class BatcherHooks:
    """Callbacks for cross-cutting work (metrics); the defaults do nothing."""

    def batch_started(self, handler: str, jobs: list[Job]) -> None:
        pass

    def batch_finished(self, handler: str, jobs: list[Job], seconds: float) -> None:
        pass

    def depth_changed(self, depth: int) -> None:
        pass


class Batcher:
    def __init__(self, handlers: dict[str, Handler], max_batch: int, wait_ms: float,
                 queue_limit: int, hooks: BatcherHooks | None = None) -> None:
        self.handlers = handlers
        self.max_batch = max_batch
        self.wait = wait_ms / 1000
        self.queue_limit = queue_limit
        self.hooks = hooks or BatcherHooks()
        self.failed_hooks: set[str] = set()
        self.queue: deque[Job] = deque()
        self.arrived = asyncio.Event()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.task: asyncio.Task | None = None
        self.inflight = 0
        self.closed = False
        # how many callers each group's window waits for: its previous batch plus the
        # jobs that arrived while that batch ran
        self.expect: dict[tuple[str, Hashable], int] = {}
        # jobs submitted per group so far (arrivals during a run are a difference of two)
        self.seen: dict[tuple[str, Hashable], int] = {}
        # the group of the batch that ran last: the next batch starts with another's job
        self.last_group: tuple[str, Hashable] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    def refuse_queued(self) -> None:
        """Close to new jobs and fail every queued one with ShuttingDown (503)."""
        self.closed = True
        for job in self.queue:
            if not job.future.done():
                job.future.set_exception(ShuttingDown())
        self.queue.clear()

    async def stop(self) -> None:
        """Refuse queued jobs, let the running batch end (its deadlines bound it), close."""
        self.refuse_queued()
        self.arrived.set()
        if self.task:
            await asyncio.gather(self.task, return_exceptions=True)
        self.pool.shutdown(wait=False)

    @property
    def depth(self) -> int:
        return len(self.queue)

    def idle(self) -> bool:
        return not self.queue and self.inflight == 0

    # ------------------------------------------------------------------ submitting
    def submit(self, handler: str, payload: Any, deadline: float, key: Hashable = None) -> Job:
        return self.submit_many(handler, [payload], deadline, key)[0]

    def submit_many(self, handler: str, payloads: Sequence[Any], deadline: float,
                    key: Hashable = None) -> list[Job]:
        """Queue all payloads or none (a request's jobs are admitted together)."""
        if self.closed:
            raise ShuttingDown()
        if handler not in self.handlers:
            raise EngineError(f"no handler {handler!r}")
        if len(payloads) > self.queue_limit:
            raise TooManyItems(f"request needs {len(payloads)} model jobs, more than this "
                               f"server queues at once (--queue-limit {self.queue_limit})")
        if len(self.queue) + len(payloads) > self.queue_limit:
            # jobs whose callers have gone (or whose deadline passed) would be dropped
            # unrun; they hold no one's place (after a burst of 504s a lone request got 429)
            self.queue = deque(job for job in self.queue if self._usable(job))
            self._hook("depth_changed", self.depth)
            if len(self.queue) + len(payloads) > self.queue_limit:
                raise QueueFull()
        loop = asyncio.get_running_loop()
        jobs = [Job(handler, key, p, deadline, loop.create_future()) for p in payloads]
        self.queue.extend(jobs)
        group = (handler, key)
        self.seen[group] = self.seen.get(group, 0) + len(jobs)
        self.arrived.set()
        self._hook("depth_changed", self.depth)
        return jobs

    # ------------------------------------------------------------------ the loop
    def _usable(self, job: Job) -> bool:
        """Drop jobs whose caller has gone or whose deadline has passed."""
        if job.future.done():
            return False
        if time.monotonic() > job.deadline:
            job.future.set_exception(DeadlineExceeded("deadline passed while queued"))
            return False
        return True

    def _take(self, group: tuple[str, Hashable] | None, other: bool = False) -> Job | None:
        """The oldest usable job (of `group`, when given; of any other group with
        `other`); others keep their order."""
        for job in list(self.queue):
            if group is not None and (job.group == group) == other:
                continue
            self.queue.remove(job)
            if self._usable(job):
                return job
        return None

    async def _first(self) -> Job | None:
        """The next batch's first job: the oldest of another group than the batch just run
        when there is one (so one request's 64 score jobs, four batches, do not hold every
        answer queued behind them for all four), else the oldest."""
        while not self.closed:
            job = self._take(self.last_group, other=True) if self.last_group else None
            job = job or self._take(None)
            if job is not None:
                return job
            self.arrived.clear()
            await self.arrived.wait()
        return None

    async def _gather(self, first: Job) -> list[Job]:
        loop = asyncio.get_running_loop()
        batch = [first]
        until = loop.time() + self.wait
        while len(batch) < self.max_batch and not self.closed:   # stop() ends a wait
            job = self._take(first.group)
            if job is not None:
                batch.append(job)
                continue
            if len(batch) >= self.expect.get(first.group, 1):   # nobody else is coming
                break
            left = until - loop.time()
            if left <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                break
        return batch

    async def _loop(self) -> None:
        while True:
            first = await self._first()
            if first is None:      # closed
                return
            batch = await self._gather(first)
            self.last_group = first.group
            before = self.seen.get(first.group, 0)
            await self._dispatch(batch)
            during = self.seen.get(first.group, 0) - before
            self.expect[first.group] = min(self.max_batch, len(batch) + during)

    async def _dispatch(self, jobs: list[Job]) -> None:
        """Run jobs taken off the queue: still-usable ones, one model call per group.

        `_loop` passes one group; `app.ray_deploy.ServeBatcher` passes what
        `@serve.batch` gathered, which may mix groups and still sit in the queue.
        """
        for job in jobs:
            if job in self.queue:         # stop() may have refused it already
                self.queue.remove(job)
        self._hook("depth_changed", self.depth)
        groups: dict[tuple[str, Hashable], list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.group, []).append(job)
        for group in groups.values():
            # checked right before the call: a caller may leave while an earlier group runs
            live = [j for j in group if self._usable(j)]
            if live:
                await self._run(live)

    async def _run(self, batch: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for j in batch:
            j.started, j.batch = now, len(batch)
        name = batch[0].handler
        fn = self.handlers[name]
        self.inflight = len(batch)
        self._hook("batch_started", name, batch)
        t = time.perf_counter()
        try:
            outcomes = await self._call(loop, fn, batch)
            retry = isinstance(outcomes, BaseException) and not isinstance(outcomes, EngineError)
            if len(batch) > 1 and retry:
                # isolate the failure: each job alone, so only the bad one fails
                outcomes = [await self._alone(loop, fn, j) for j in batch]
            elif isinstance(outcomes, BaseException):
                outcomes = [outcomes] * len(batch)
            for job, outcome in zip(batch, outcomes):
                if job.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    job.future.set_exception(outcome)
                else:
                    job.future.set_result(outcome)
        finally:
            self.inflight = 0
            self._hook("batch_finished", name, batch, time.perf_counter() - t)

    def _hook(self, name: str, *args: Any) -> None:
        """Call a hook; one that raises is logged, not fatal: an exception here would end
        the batcher's loop and leave every queued caller waiting."""
        try:
            getattr(self.hooks, name)(*args)
        except Exception as e:
            # the traceback once per hook: one failing on every call must not flood the log
            first = name not in self.failed_hooks
            self.failed_hooks.add(name)
            log.error("batcher hook %s failed: %s", name, type(e).__name__,
                      exc_info=e if first else None)

    async def _alone(self, loop: asyncio.AbstractEventLoop, fn: Handler, job: Job) -> Any:
        """One job's outcome on its own; None, without a call, when its caller has gone
        or its deadline passed while the batch ran (its future is settled already)."""
        if not self._usable(job):
            return None
        out = await self._call(loop, fn, [job])
        return out if isinstance(out, BaseException) else out[0]

    async def _call(self, loop: asyncio.AbstractEventLoop, fn: Handler, jobs: list[Job]
                    ) -> list[Any] | BaseException:
        """Run the handler in the worker thread: its outcomes, or the exception it raised
        (EngineError when it broke the one-entry-per-job contract)."""
        try:
            out = await loop.run_in_executor(self.pool, fn, [j.payload for j in jobs],
                                             [j.deadline for j in jobs])
        except Exception as e:
            return e
        if not isinstance(out, Sequence) or len(out) != len(jobs):
            n = len(out) if isinstance(out, Sequence) else type(out).__name__
            return EngineError(f"handler returned {n} results for {len(jobs)} jobs")
        return list(out)
