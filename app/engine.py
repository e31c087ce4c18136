"""The model worker: one task owns the actor; requests coalesce into micro-batches.

Jobs of the same kind that arrive within the wait window (up to the max batch) run as one
batched call in a single worker thread, so the event loop never blocks on the model. The
queue is bounded: a full queue is refused at once (429) rather than growing latency.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    pass


@dataclass
class Job:
    kind: str
    payload: Any
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    batch: int = 0


BatchFn = Callable[[list[Any]], list[Any]]


class Batcher:
    def __init__(self, handlers: dict[str, BatchFn], max_batch: int, wait_ms: float,
                 queue_limit: int, on_batch: Callable[[str, int], None] | None = None) -> None:
        self.handlers = handlers
        self.max_batch = max_batch
        self.wait = wait_ms / 1000
        self.queue: asyncio.Queue[Job] = asyncio.Queue(maxsize=queue_limit)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.on_batch = on_batch
        self.task: asyncio.Task | None = None
        self.held: deque[Job] = deque()
        self.inflight = 0

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)

    @property
    def depth(self) -> int:
        return self.queue.qsize() + len(self.held)

    def submit(self, kind: str, payload: Any) -> Job:
        job = Job(kind, payload, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise QueueFull() from None
        return job

    async def _next(self) -> Job:
        return self.held.popleft() if self.held else await self.queue.get()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next()
            batch = [first]
            deadline = loop.time() + self.wait
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if self.held:
                    job = self.held.popleft()
                elif timeout <= 0:
                    try:
                        job = self.queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                else:
                    try:
                        job = await asyncio.wait_for(self.queue.get(), timeout)
                    except TimeoutError:
                        break
                if job.kind == first.kind:
                    batch.append(job)
                else:
                    self.held.append(job)
                    break
            live = [j for j in batch if not j.future.cancelled()]
            if not live:
                continue
            now = time.perf_counter()
            for j in live:
                j.started, j.batch = now, len(live)
            self.inflight = len(live)
            if self.on_batch:
                self.on_batch(first.kind, len(live))
            try:
                results = await loop.run_in_executor(
                    self.pool, self.handlers[first.kind], [j.payload for j in live])
                for j, r in zip(live, results):
                    if not j.future.done():
                        j.future.set_result(r)
            except Exception as e:  # the whole batch failed: every caller hears why
                for j in live:
                    if not j.future.done():
                        j.future.set_exception(e)
            finally:
                self.inflight = 0

    def idle(self) -> bool:
        return self.depth == 0 and self.inflight == 0
