"""The serving layer: typed jobs in, typed results out, between the routers and the Batcher.

Routers decode HTTP into `AnswerItem` / `ScoreItem` through `Serving.answer_item` /
`score_item` (every check that can be made before queueing: image bytes, pixels and
geometry, question and trajectory tokens, mask spans), then await results here. Metrics
and the feedback monitor hang on `ServingHooks`; nothing here computes a confidence.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, make_dataclass
from typing import Any, Protocol

from PIL import Image
from starlette.concurrency import run_in_threadpool

from app.engine import Batcher, BatcherHooks, Job
from app.errors import (
    ClientGone,
    DeadlineExceeded,
    InvalidInput,
    NotReady,
    ShuttingDown,
    TrajectoryInvalid,
)
from app.settings import Settings
from clients.schemas import SERVED_CONFIDENCES
from models.images import ImageError, ImageTooLarge, open_image
from models.masking import MaskSpec, char_span


# ---------------------------------------------------------------------------- typed data
@dataclass(frozen=True)
class AnswerItem:
    image: Image.Image
    question: str
    max_new_tokens: int


@dataclass(frozen=True)
class ScoreItem:
    image: Image.Image
    question: str
    response: str
    mask: MaskSpec | None


def _minus(self: Confidences, other: Confidences) -> Confidences:
    """Field by field, self minus other (`confidence_difference`)."""
    return type(self)(**{n: getattr(self, n) - getattr(other, n) for n in SERVED_CONFIDENCES})


def _from_scores(cls: type[Confidences], scores: dict[str, float]) -> Confidences:
    """The served fields of a method → score mapping (`Heads.confidence`); a missing one is
    a KeyError naming it."""
    return cls(**{n: scores[n] for n in SERVED_CONFIDENCES})


# One float per field of `/answer`'s confidence, in the same order: built from the one list
# (`clients.schemas.SERVED_CONFIDENCES`) rather than written out again.
Confidences = make_dataclass(
    "Confidences", [(n, float) for n in SERVED_CONFIDENCES], frozen=True,
    namespace={"minus": _minus, "from_scores": classmethod(_from_scores)})
Confidences.__module__ = __name__    # pickles by name (Ray passes results between processes)


@dataclass(frozen=True)
class StageTimes:
    """Seconds per stage of the batch an answer ran in (queue time is per request)."""

    generate: float
    readout: float
    heads: float


@dataclass(frozen=True)
class NoveltyResult:
    """The novelty detector's reading of one answer (`heads.novelty`)."""

    score: float
    p_value: float
    novel: bool            # p_value < α: defers the answer


@dataclass(frozen=True)
class AnswerResult:
    answer: str
    canonical: str
    response: str
    confidence: Confidences | None           # None: answer-only, no heads
    defer: bool
    defer_reason: str | None
    timings: StageTimes
    novelty: NoveltyResult | None = None     # None: the heads have no novelty detector
    defer_codes: tuple[str, ...] = ()        # clients.schemas.DeferCode values
    # what re-certification keeps of this answer (heads.recert.Served: the deciding rule's
    # version, branch log-odds, detector scores; no request content)
    served: Any = None
    calibrated: bool = True    # False: a detector flags the input (confidence uncalibrated)
    threshold: float | None = None   # τ of the rule that decided (None: the backend's)


@dataclass(frozen=True)
class ScoreResult:
    confidence: Confidences
    mu_c: float | None
    answer: str
    masked_tokens: int
    digits: list[float] | None = None   # P(C = 0..10), what μ(C) averages


@dataclass(frozen=True)
class Served:
    """A result with what the request spent waiting and the size of its batch."""

    result: Any
    queued_s: float
    batch: int


class Backend(Protocol):
    """What the serving layer needs from the model side (`app.service.Service`)."""

    fingerprint: str
    heads_id: str | None                     # None: answer-only, no heads
    threshold: float | None

    def info(self) -> dict[str, str]: ...
    def cards(self) -> dict[str, Any]: ...

    def check_question(self, question: str, max_chars: int, max_tokens: int) -> str: ...
    def check_response(self, response: str, max_tokens: int) -> str: ...
    def answer_batch(self, items: list[AnswerItem], deadlines: list[float]
                     ) -> Sequence[AnswerResult | Exception]: ...
    def score_batch(self, items: list[ScoreItem], deadlines: list[float]
                    ) -> Sequence[ScoreResult | Exception]: ...


def limit_bucket(max_new_tokens: int) -> int:
    """The batch key of an answer's generation limit: the next power of two. Limits in one
    bucket share a batch, each row stopping at its own (`Actor.answer`): a client varying
    its limit by a token no longer splits every batch, while a short request waits at most
    for a row under twice its length, not for one of 1024 tokens."""
    return 1 << (max(1, max_new_tokens) - 1).bit_length()


class ServingHooks:
    """Cross-cutting callbacks; the defaults do nothing."""

    def answered(self, request_id: str, result: AnswerResult, queued_s: float) -> None:
        pass


def b64_limit(max_bytes: int) -> int:
    """Longest base64 text (padded) of at most `max_bytes` bytes."""
    return 4 * -(-max_bytes // 3)


# ---------------------------------------------------------------------------- serving
# The request being served in this task: its deadline (time.monotonic) and how to tell
# whether its client has gone. Set by `Serving.admit`; (None, None) outside a request.
_REQUEST: ContextVar[tuple[float | None, Gone | None]] = ContextVar(
    "dualread_request", default=(None, None))


@dataclass
class RequestClock:
    """Where the request in this task has spent its time before its job is queued
    (seconds; updated in place, so the task's own context holds it). Set by `admit`."""

    arrived: float                    # time.monotonic() the app received it
    read: float | None = None         # arrival to its first image: body, parsing, checks
    decode_wait: float = 0.0          # waiting for decode slots
    decode: float = 0.0               # decoding its images (base64, pixels, checks)

    def image_started(self) -> None:
        if self.read is None:
            self.read = time.monotonic() - self.arrived


_CLOCK: ContextVar[RequestClock | None] = ContextVar("dualread_clock", default=None)


class Serving:
    def __init__(self, settings: Settings, hooks: ServingHooks | None = None,
                 batcher_hooks: BatcherHooks | None = None) -> None:
        self.settings = settings
        self.hooks = hooks or ServingHooks()
        self.batcher_hooks = batcher_hooks
        self.backend: Backend | None = None
        self.batcher: Batcher | None = None
        self.load_error: str | None = None
        self.draining = False
        # What queues and batches jobs; a Ray Serve replica swaps in its @serve.batch
        # version (app.ray_deploy) before the model is attached.
        self.new_batcher: type[Batcher] = Batcher
        # Decoding runs before a job is queued, so the queue limit does not bound it.
        self.decode_slots = asyncio.Semaphore(settings.max_decodes)

    # ----------------------------------------------------------------- lifecycle
    def attach(self, backend: Backend) -> None:
        s = self.settings
        self.backend = backend
        self.batcher = self.new_batcher(
            {"answer": backend.answer_batch, "score": backend.score_batch},
            s.max_batch_size, s.batch_wait_ms, s.queue_limit, self.batcher_hooks)
        self.batcher.start()

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.batcher is not None and not self.draining

    def drain(self) -> None:
        self.draining = True

    async def stop(self) -> None:
        self.drain()
        if self.batcher is not None:
            await self.batcher.stop()

    def admit(self, request: Any) -> None:
        """A request that arrived after SIGTERM is refused; one already in is served.
        Its deadline starts here: decoding, waiting for a decode slot and queueing all
        count against it (each request runs in its own task, so the context is its own)."""
        if request.scope["state"].get("late"):
            raise ShuttingDown()
        self.require_backend()
        _REQUEST.set((time.monotonic() + self.settings.request_timeout_s,
                      getattr(request, "is_disconnected", None)))
        # from when the app received it (the middleware's mark), else from now
        arrived = request.scope["state"].get("arrived")
        _CLOCK.set(RequestClock(time.monotonic() if arrived is None else arrived))

    @staticmethod
    def clock() -> RequestClock:
        """Where the current request spent its time before its job was queued
        (`timings_ms.read`, `decode_wait`, `decode`); a fresh one outside a request."""
        clock = _CLOCK.get()
        return RequestClock(time.monotonic(), 0.0) if clock is None else clock

    @staticmethod
    def decode_wait_s() -> float:
        """Seconds the current request waited for a decode slot (`--max-decodes`), over all
        its images: large images decoding for others hold small requests here, before
        any queue (`timings_ms.decode_wait`)."""
        clock = _CLOCK.get()
        return 0.0 if clock is None else clock.decode_wait

    def require_backend(self) -> Backend:
        if self.backend is None or self.batcher is None:
            raise NotReady(self.load_error or "loading model")
        return self.backend

    # ----------------------------------------------------------------- decoding
    async def image(self, raw: bytes, what: str = "image") -> Image.Image:
        """Decode off the event loop; size limits before any pixel is decoded."""
        limit = self.settings.max_image_bytes
        if len(raw) > limit:
            raise ImageTooLarge(f"{what}: {len(raw)} bytes, over the limit of {limit}")
        clock = _CLOCK.get()
        if clock is not None:
            clock.image_started()
        # waiting for a slot counts against the request's deadline like queueing does
        waiting = time.monotonic()
        try:
            left = self._deadline() - time.monotonic()
            if left <= 0:
                # past its deadline (a slow upload): no decode, free slot or not
                raise TimeoutError
            if self.decode_slots.locked():
                await asyncio.wait_for(self.decode_slots.acquire(), left)
            else:
                # a free slot is taken at once (wait_for's task would cost ~0.1 ms)
                await self.decode_slots.acquire()
        except TimeoutError:
            raise DeadlineExceeded(f"{what}: deadline passed waiting to be decoded") from None
        finally:
            if clock is not None:
                clock.decode_wait += time.monotonic() - waiting
        started = False
        decoding = time.monotonic()
        try:
            gone = _REQUEST.get()[1]
            if gone is not None and await gone():     # nobody to decode for any more
                raise ClientGone()
            # The slot goes back when the decode thread ends, not when this task stops
            # waiting: a cancelled request (Ray Serve cancels on disconnect) would
            # otherwise free its slot while its decode still runs.
            fut = asyncio.get_running_loop().run_in_executor(
                None, open_image, raw, self.settings.max_image_pixels)
            started = True
            fut.add_done_callback(lambda _: self.decode_slots.release())
            return await asyncio.shield(fut)
        except ImageError as e:   # ImageTooLarge / ImageInvalid keep their type
            raise type(e)(f"{what}: {e}") from None
        finally:
            if not started:
                self.decode_slots.release()
            if clock is not None:
                clock.decode += time.monotonic() - decoding

    async def image_b64(self, b64: str, what: str = "image") -> Image.Image:
        # The encoded size bounds the decoded one: refuse before decoding a huge string.
        if len(b64) > b64_limit(self.settings.max_image_bytes):
            raise ImageTooLarge(f"{what}: over the limit of {self.settings.max_image_bytes} "
                                "bytes")
        clock = _CLOCK.get()
        if clock is not None:
            clock.image_started()
        decoding = time.monotonic()
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(f"{what}: not valid base64 (one line, no wrapping; "
                               "use `base64 < file | tr -d '\\n'`)") from None
        finally:
            if clock is not None:      # a 10 MB image's base64: ~0.2 s (its check's regex)
                clock.decode += time.monotonic() - decoding
        return await self.image(raw, what)

    def max_new_tokens(self, asked: int | None) -> int:
        if asked is not None and asked < 1:
            raise InvalidInput("max_new_tokens must be at least 1")
        limit = self.settings.max_new_tokens
        return limit if asked is None else min(asked, limit)

    def question(self, question: str) -> str:
        s = self.settings
        return self.require_backend().check_question(question, s.max_question_chars,
                                                     s.max_question_tokens)

    def chat_question(self, texts: Sequence[tuple[str, str]]) -> str:
        """The OpenAI route's question: its text parts (each with its field's path) joined
        by newlines, each part within the question length as sent (the document states the
        length per part), the whole checked as `question` is but for that length (the
        token limit still holds)."""
        s = self.settings
        for where, text in texts:
            if len(text) > s.max_question_chars:
                raise InvalidInput(f"{where}: longer than {s.max_question_chars} characters")
        joined = "\n".join(text for _, text in texts)
        return self.require_backend().check_question(
            joined, max(len(joined), s.max_question_chars), s.max_question_tokens)

    def _score_items(self, image: Image.Image, question: str,
                     trajectories: Sequence[tuple[str, MaskSpec | None]], batch: bool
                     ) -> list[ScoreItem]:
        backend = self.require_backend()
        out = []
        for k, (response, mask) in enumerate(trajectories):
            # the request's own field: a batch of one still has its response in a list
            where = f"trajectories.{k}." if batch else ""
            try:
                text = backend.check_response(response, self.settings.max_response_tokens)
            except TrajectoryInvalid as e:
                raise TrajectoryInvalid(f"{where}response: {e.detail}") from None
            try:
                if mask is not None:
                    char_span(text, mask.target)   # a span must lie inside what is scored
            except ValueError as e:
                raise TrajectoryInvalid(f"{where}mask.target: {e}") from None
            out.append(ScoreItem(image, question, response, mask))
        return out

    async def score_items(self, image: Image.Image, question: str,
                          trajectories: Sequence[tuple[str, MaskSpec | None]],
                          batch: bool = False) -> list[ScoreItem]:
        """Checked score jobs (token budget, reserved tokens, mask spans); tokenising up to
        64 long trajectories runs off the event loop."""
        return await run_in_threadpool(self._score_items, image, question, trajectories,
                                      batch)

    # ----------------------------------------------------------------- running
    def _deadline(self) -> float:
        """The current request's deadline (set by `admit`), else one from now."""
        deadline = _REQUEST.get()[0]
        return deadline if deadline is not None else \
            time.monotonic() + self.settings.request_timeout_s

    async def _await(self, jobs: list[Job], gone: Gone | None = None) -> list[Served]:
        """The jobs' results; on timeout, on cancellation, or when `gone()` says the client
        has closed the connection, their futures are cancelled, so the worker drops the
        jobs still queued (a client that times out and retries adds no model work)."""
        timeout = self.settings.request_timeout_s
        futures = [j.future for j in jobs]
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time()
                                          + max(0.0, self._deadline() - time.monotonic())):
                await _settled(futures, gone)
            results = [f.result() for f in futures]   # raises a failed job's error
        except TimeoutError:
            for j in jobs:          # the worker skips them, or stops decoding at the deadline
                j.future.cancel()
            raise DeadlineExceeded(f"no answer within {timeout} s") from None
        except BaseException:
            for j in jobs:
                j.future.cancel()
            raise
        return [Served(r, j.queued_s, j.batch) for r, j in zip(results, jobs)]

    async def answer(self, items: list[AnswerItem], request_id: str | None = None,
                     gone: Gone | None = None) -> list[Served]:
        """Answers for one request's items (1, or 2 for a counterfactual), in order.
        `gone`: tells whether the client has disconnected (polled while waiting)."""
        self.require_backend()
        jobs = self.batcher.submit_many("answer", items, self._deadline(),
                                        limit_bucket(items[0].max_new_tokens))
        served = await self._await(jobs, gone)
        if request_id is not None:
            for s in served:
                self.hooks.answered(request_id, s.result, s.queued_s)
        return served

    async def score(self, items: list[ScoreItem], gone: Gone | None = None) -> list[Served]:
        self.require_backend()
        jobs = self.batcher.submit_many("score", items, self._deadline())
        return await self._await(jobs, gone)


# How often a waiting request checks that its client is still connected.
GONE_POLL_S = 0.1
Gone = Callable[[], Awaitable[bool]]


async def _settled(futures: list[asyncio.Future], gone: Gone | None) -> None:
    """Wait until every future is done or one has failed; ClientGone once `gone()` is
    true while some are pending. The futures are waited on, never wrapped (a wrapper
    nobody reads logs "exception was never retrieved" when it is cancelled)."""
    pending = set(futures)
    while pending:
        done, pending = await asyncio.wait(
            pending, timeout=None if gone is None else GONE_POLL_S,
            return_when=asyncio.FIRST_EXCEPTION)
        if any(not f.cancelled() and f.exception() is not None for f in done):
            return
        if pending and gone is not None and await gone():
            raise ClientGone()
