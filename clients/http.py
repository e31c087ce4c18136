"""Typed HTTP clients for a dualread deployment (any host: they speak HTTP only).

`DualReadClient` (sync) and `AsyncDualReadClient` (async, with a concurrency limit) share
one retry policy: 429, 503, a 408 that carries `Retry-After`, and connection errors are
retried with exponential backoff and jitter, and a `Retry-After` header, when the server
sends one, sets the wait instead. Everything else (other 4xx, 500, 504) is raised at once
with the server's reason. The service's own 408 (the body did not arrive in time, so
nothing ran) says `Retry-After`: it is what a request gets when Ray Serve re-routes it from
a replica that died under it to one that can no longer read its body. A 408 without it (a
proxy's own request timeout, when the request may have run) is not repeated.

The async client treats 429 as backpressure, not failure: its window of requests in flight
adapts (AIMD: halved on a 429, at most once per round of requests that saw the old window;
one wider after a window's worth of successes in a row, up to the `concurrency` it was given),
and with a `deadline` a 429 is retried, honouring `Retry-After`, until that moment rather
than a fixed number of times. An offline run (the probes) sets a deadline; a caller that
wants an answer now does not.

With a deadline, a 504 is backpressure too: the server admitted the request but its queue
held more work than it could finish inside its request deadline (the default 30 s on a
loaded CPU), so the request is repeated after a backoff and the window halves, as on a 429.
Only requests that change nothing are repeated this way (answers and scores are pure
reads; `/feedback` is not one of them). Without a deadline a 504 is raised at once: a
caller that wants an answer now decides itself.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from clients.schemas import (
    MAX_TRAJECTORIES,
    AnswerResponse,
    CounterfactualResponse,
    FeedbackResponse,
    ScoreBatchResponse,
    ScoreResponse,
    TrajectoryScore,
)

RETRY_STATUS = frozenset({429, 503})
# With a run deadline: the server is slower than the load offered (429 queue full, 504
# admitted but not finished in time); narrow the window and retry until the deadline.
OVERLOAD_STATUS = frozenset({429, 504})
ImageLike = bytes | str | Path


def retryable(r: httpx.Response) -> bool:
    """Whether the retry policy repeats a request answered with `r`."""
    return r.status_code in RETRY_STATUS or (r.status_code == 408
                                             and "retry-after" in r.headers)


def _b64(image: ImageLike) -> str:
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    return base64.b64encode(data).decode()


def retry_after(response: httpx.Response | None) -> float | None:
    """Seconds asked for by a `Retry-After` header (delta-seconds or an HTTP date)."""
    value = response.headers.get("retry-after") if response is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time()) if when else None


def backoff(attempt: int, response: httpx.Response | None, base: float, cap: float) -> float:
    asked = retry_after(response)
    if asked is not None:
        return min(asked, cap)
    # Full jitter keeps many clients that were refused together from retrying together.
    return random.uniform(0.5, 1.0) * min(cap, base * 2 ** attempt)


def _raise_for(r: httpx.Response, path: str) -> None:
    if r.status_code < 400:
        return
    try:
        detail = r.json().get("detail") if r.headers.get("content-type", "").startswith(
            "application/json") else r.text
    except ValueError:
        detail = r.text
    raise httpx.HTTPStatusError(f"{r.status_code} on {path}: {detail}",
                                request=r.request, response=r)


def _mask(mask: dict | None) -> dict | None:
    if mask is None:
        return None
    m = dict(mask)
    if isinstance(m.get("target"), tuple):
        m["target"] = list(m["target"])
    return m


def _answer_body(image: ImageLike, question: str, max_new_tokens: int | None) -> dict:
    body: dict[str, Any] = {"image": _b64(image), "question": question}
    if max_new_tokens:
        body["max_new_tokens"] = max_new_tokens
    return body


def _cf_body(image, question, counterfactual, reference, counterfactual_reference) -> dict:
    return {"image": _b64(image), "question": question,
            "counterfactual": "blank" if counterfactual is None else _b64(counterfactual),
            "reference_answer": reference,
            "counterfactual_reference_answer": counterfactual_reference}


def _trajectories(responses: Sequence[str], masks: Sequence[dict | None] | None) -> list[dict]:
    masks = list(masks) if masks is not None else [None] * len(responses)
    if len(masks) != len(responses):
        raise ValueError("one mask (or None) per trajectory")
    return [{"response": r, "mask": _mask(m)} for r, m in zip(responses, masks)]


BATCH_PATH = "/probe/score_batch"


def _batch_body(b64: str, question: str, chunk: list[dict]) -> dict:
    return {"image": b64, "question": question, "trajectories": chunk}


def _too_big(client: DualReadClient | AsyncDualReadClient, r: httpx.Response,
             chunk: list[dict]) -> bool:
    """Whether a batch was refused as too big (413: more jobs than the server's
    `--queue-limit`, or a body over its limit) and can be halved; the client then sends
    at most half as many trajectories a request from here on."""
    if r.status_code != 413 or len(chunk) < 2:
        return False
    client.batch_limit = min(client.batch_limit, len(chunk) // 2)
    return True


def _batch_results(client: DualReadClient | AsyncDualReadClient, r: httpx.Response
                   ) -> list[TrajectoryScore] | None:
    """The results of a batch-scoring reply, or None from a server without the route
    (404/405); either way the client remembers which kind of server it talks to."""
    client.batch_scoring = r.status_code not in (404, 405)
    if not client.batch_scoring:
        return None
    _raise_for(r, BATCH_PATH)
    return ScoreBatchResponse.model_validate(r.json()).results


class DualReadClient:
    """Blocking client; every method returns the typed response body."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 60.0, retries: int = 6, backoff_base: float = 0.25,
                 backoff_cap: float = 20.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout,
                                 transport=transport)
        self.retries, self.base, self.cap = retries, backoff_base, backoff_cap
        self.batch_scoring: bool | None = None     # None: not yet known for this server
        # trajectories a batch request holds; halved on a 413 (a server with a smaller
        # --queue-limit than the route's own bound of 64)
        self.batch_limit = MAX_TRAJECTORIES

    def __enter__(self) -> DualReadClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, json=body)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                time.sleep(backoff(attempt, None, self.base, self.cap))
                continue
            if not retryable(r) or attempt == self.retries:
                return r
            time.sleep(backoff(attempt, r, self.base, self.cap))
        raise AssertionError("unreachable")

    def _post(self, path: str, body: dict) -> dict:
        r = self._request("POST", path, body)
        _raise_for(r, path)
        return r.json()

    def answer(self, image: ImageLike, question: str,
               max_new_tokens: int | None = None) -> AnswerResponse:
        return AnswerResponse.model_validate(
            self._post("/answer", _answer_body(image, question, max_new_tokens)))

    def counterfactual(self, image: ImageLike, question: str,
                       counterfactual: ImageLike | None = None,
                       reference: str | None = None,
                       counterfactual_reference: str | None = None) -> CounterfactualResponse:
        """`counterfactual=None` uses the blank image (docs/method.md §5)."""
        body = _cf_body(image, question, counterfactual, reference, counterfactual_reference)
        return CounterfactualResponse.model_validate(self._post("/probe/counterfactual", body))

    def score(self, image: ImageLike, question: str, response: str,
              mask: dict | None = None) -> ScoreResponse:
        body = {"image": _b64(image), "question": question, "response": response,
                "mask": _mask(mask)}
        return ScoreResponse.model_validate(self._post("/probe/score", body))

    def score_batch(self, image: ImageLike, question: str, responses: Sequence[str],
                    masks: Sequence[dict | None] | None = None) -> list[TrajectoryScore]:
        """Several trajectories for one image and question, results in order (chunks of
        64 per request, fewer after a 413; one request per trajectory on a server without
        the batch route)."""
        trajs, b64 = _trajectories(responses, masks), _b64(image)
        out: list[TrajectoryScore] = []
        start = 0
        while start < len(trajs):
            chunk = trajs[start:start + self.batch_limit]
            start += len(chunk)
            if self.batch_scoring is not False:
                r = self._request("POST", BATCH_PATH, _batch_body(b64, question, chunk))
                if _too_big(self, r, chunk):
                    start -= len(chunk)         # again, in smaller requests
                    continue
                got = _batch_results(self, r)
                if got is not None:
                    out += got
                    continue
            out += [TrajectoryScore.model_validate(
                self.score(image, question, t["response"], t["mask"]).model_dump())
                for t in chunk]
        return out

    def feedback(self, request_id: str, correct: bool) -> FeedbackResponse:
        return FeedbackResponse.model_validate(
            self._post("/feedback", {"request_id": request_id, "correct": correct}))

    def ready(self) -> bool:
        return self.http.get("/health/ready").status_code == 200

    def models(self) -> dict:
        r = self._request("GET", "/v1/models")
        _raise_for(r, "/v1/models")
        return r.json()


class AdaptiveLimit:
    """How many requests may be in flight: AIMD on the server's 429s.

    `window` starts at `ceiling`. A 429 halves it (never below 1), but only for a request
    that was admitted under the current window: requests already in flight when it shrank
    were refused by the same crowd, so one burst of 429s halves it once, not to 1 at once.
    After `window` successes in a row it grows by one, up to `ceiling`."""

    def __init__(self, ceiling: int) -> None:
        if ceiling < 1:
            raise ValueError("concurrency must be at least 1")
        self.ceiling = self.window = self.smallest = ceiling
        self.in_flight = self.streak = self.epoch = 0
        self.throttled = 0                      # overload answers seen (429, or 504)
        self._wake = asyncio.Event()

    async def acquire(self) -> int:
        """Wait for a free place in the window; returns the epoch the request starts in."""
        while self.in_flight >= self.window:
            self._wake.clear()
            await self._wake.wait()
        self.in_flight += 1
        return self.epoch

    def release(self, epoch: int, overloaded: bool) -> None:
        """Give the place back; `overloaded`: the server answered 429 (or, for a client
        with a run deadline, 504)."""
        self.in_flight -= 1
        if overloaded:
            self.throttled += 1
            self.streak = 0
            if epoch == self.epoch:
                self.window = max(1, self.window // 2)
                self.smallest = min(self.smallest, self.window)
                self.epoch += 1
        else:
            self.streak += 1
            if self.streak >= self.window and self.window < self.ceiling:
                self.window += 1
                self.streak = 0
        self._wake.set()


class AsyncDualReadClient:
    """Async client: at most `concurrency` requests in flight (fewer while the server
    answers 429, see `AdaptiveLimit`), the same retry policy. With `deadline` (a
    `time.monotonic()` moment) a 429, and a 504 on a request that changes nothing, is
    retried until then, not `retries` times."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 120.0, concurrency: int = 8, retries: int = 8,
                 backoff_base: float = 0.25, backoff_cap: float = 20.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 deadline: float | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout,
                                      limits=limits, transport=transport)
        self.limit = AdaptiveLimit(concurrency)
        self.retries, self.base, self.cap = retries, backoff_base, backoff_cap
        self.deadline = deadline
        self.batch_scoring: bool | None = None
        self.batch_limit = MAX_TRAJECTORIES        # halved on a 413, as the blocking client's
        self.retried = 0                           # how many times a request was retried
        self.timed_out = 0                         # 504s retried as backpressure

    def _retry_429(self) -> bool:
        """Whether a 429 is retried regardless of the retry count: before the deadline."""
        return self.deadline is not None and time.monotonic() < self.deadline

    def _overloaded(self, r: httpx.Response | None, safe: bool) -> bool:
        """Whether `r` says the server is over its capacity: a 429, or, for a request that
        changes nothing sent by a client with a run deadline, a 504."""
        if r is None or r.status_code not in OVERLOAD_STATUS:
            return False
        return r.status_code == 429 or (safe and self.deadline is not None)

    async def __aenter__(self) -> AsyncDualReadClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, path: str, body: dict | None = None,
                       safe: bool = True) -> httpx.Response:
        """`safe`: the request changes nothing on the server, so a 504 may be repeated."""
        attempt = 0      # tries that count against `retries`
        throttled = 0    # overload answers retried before the deadline: they only lengthen
        alone = 0        # the wait; 504s of this request while nothing else was in flight:
        late = 0         # one slower than the server's deadline on its own fails after
        while True:      # `retries`; any request after 4 × `retries` 504s (each may cost the
                         # server a whole deadline of model time)
            r = None
            epoch = await self.limit.acquire()   # the wait between tries holds no slot
            started_alone = self.limit.in_flight == 1
            try:
                r = await self.http.request(method, path, json=body)
            except httpx.TransportError:
                if attempt >= self.retries:
                    raise
                attempt += 1
            else:
                overloaded = self._overloaded(r, safe)
                if not overloaded and not retryable(r):
                    return r
                if r.status_code == 504:
                    late += 1
                    alone += started_alone and self.limit.in_flight == 1
                if overloaded and self._retry_429() and alone <= self.retries \
                        and late <= 4 * self.retries:
                    throttled += 1
                    self.timed_out += r.status_code == 504
                elif attempt >= self.retries or r.status_code == 504:
                    return r
                else:
                    attempt += 1
            finally:   # also when cancelled: the place in the window is given back
                self.limit.release(epoch, self._overloaded(r, safe))
            self.retried += 1
            wait = backoff(min(attempt + throttled, 16), r, self.base, self.cap)
            if self.deadline is not None:
                wait = min(wait, max(0.0, self.deadline - time.monotonic()))
            await asyncio.sleep(wait)

    async def _post(self, path: str, body: dict, safe: bool = True) -> dict:
        r = await self._request("POST", path, body, safe)
        _raise_for(r, path)
        return r.json()

    async def answer(self, image: ImageLike, question: str,
                     max_new_tokens: int | None = None) -> AnswerResponse:
        return AnswerResponse.model_validate(
            await self._post("/answer", _answer_body(image, question, max_new_tokens)))

    async def counterfactual(self, image: ImageLike, question: str,
                             counterfactual: ImageLike | None = None,
                             reference: str | None = None,
                             counterfactual_reference: str | None = None
                             ) -> CounterfactualResponse:
        body = _cf_body(image, question, counterfactual, reference, counterfactual_reference)
        return CounterfactualResponse.model_validate(
            await self._post("/probe/counterfactual", body))

    async def score(self, image: ImageLike, question: str, response: str,
                    mask: dict | None = None) -> ScoreResponse:
        body = {"image": _b64(image), "question": question, "response": response,
                "mask": _mask(mask)}
        return ScoreResponse.model_validate(await self._post("/probe/score", body))

    async def score_batch(self, image: ImageLike, question: str, responses: Sequence[str],
                          masks: Sequence[dict | None] | None = None
                          ) -> list[TrajectoryScore]:
        """Several trajectories for one image and question, results in order (chunks of
        64 per request, fewer after a 413; one request per trajectory on a server without
        the batch route)."""
        trajs, b64 = _trajectories(responses, masks), _b64(image)
        out: list[TrajectoryScore] = []
        start = 0
        while start < len(trajs):
            chunk = trajs[start:start + self.batch_limit]
            start += len(chunk)
            if self.batch_scoring is not False:
                r = await self._request("POST", BATCH_PATH, _batch_body(b64, question, chunk))
                if _too_big(self, r, chunk):
                    start -= len(chunk)         # again, in smaller requests
                    continue
                got = _batch_results(self, r)
                if got is not None:
                    out += got
                    continue
            done = await asyncio.gather(*(self.score(image, question, t["response"], t["mask"])
                                          for t in chunk))
            out += [TrajectoryScore.model_validate(d.model_dump()) for d in done]
        return out

    async def feedback(self, request_id: str, correct: bool) -> FeedbackResponse:
        return FeedbackResponse.model_validate(
            await self._post("/feedback", {"request_id": request_id, "correct": correct},
                             safe=False))

    async def ready(self) -> bool:
        return (await self.http.get("/health/ready")).status_code == 200

    async def models(self) -> dict:
        r = await self._request("GET", "/v1/models")
        _raise_for(r, "/v1/models")
        return r.json()
