"""Typed HTTP clients for a dualread deployment (any host: they speak HTTP only).

`DualReadClient` (sync) and `AsyncDualReadClient` (async, with a concurrency limit) share
one retry policy: 429, 503, a 408 that carries `Retry-After`, and connection errors are
retried with exponential backoff and jitter, and a `Retry-After` header, when the server
sends one, sets the wait instead. Everything else (other 4xx, 500, 504) is raised at once
with the server's reason. The service's own 408 (the body did not arrive in time, so
nothing ran) says `Retry-After`: it is what a request gets when Ray Serve re-routes it from
a replica that died under it to one that can no longer read its body. A 408 without it (a
proxy's own request timeout, when the request may have run) is not repeated.
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
        """Several trajectories for one image and question, results in order. A server
        without `/probe/score_batch` is asked once per trajectory instead."""
        trajs, b64 = _trajectories(responses, masks), _b64(image)
        out: list[TrajectoryScore] = []
        for start in range(0, len(trajs), MAX_TRAJECTORIES):
            chunk = trajs[start:start + MAX_TRAJECTORIES]
            if self.batch_scoring is not False:
                got = _batch_results(self, self._request(
                    "POST", BATCH_PATH, _batch_body(b64, question, chunk)))
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


class AsyncDualReadClient:
    """Async client: at most `concurrency` requests in flight, the same retry policy."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 120.0, concurrency: int = 8, retries: int = 8,
                 backoff_base: float = 0.25, backoff_cap: float = 20.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout,
                                      limits=limits, transport=transport)
        self.limit = asyncio.Semaphore(concurrency)
        self.retries, self.base, self.cap = retries, backoff_base, backoff_cap
        self.batch_scoring: bool | None = None
        self.retried = 0                           # how many times a request was retried

    async def __aenter__(self) -> AsyncDualReadClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, path: str, body: dict | None = None
                       ) -> httpx.Response:
        for attempt in range(self.retries + 1):
            r = None
            try:
                async with self.limit:   # the wait between tries does not hold a slot
                    r = await self.http.request(method, path, json=body)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            else:
                if not retryable(r) or attempt == self.retries:
                    return r
            self.retried += 1
            await asyncio.sleep(backoff(attempt, r, self.base, self.cap))
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: dict) -> dict:
        r = await self._request("POST", path, body)
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
        64 per request; one request per trajectory on a server without the batch route)."""
        trajs, b64 = _trajectories(responses, masks), _b64(image)
        out: list[TrajectoryScore] = []
        for start in range(0, len(trajs), MAX_TRAJECTORIES):
            chunk = trajs[start:start + MAX_TRAJECTORIES]
            if self.batch_scoring is not False:
                got = _batch_results(self, await self._request(
                    "POST", BATCH_PATH, _batch_body(b64, question, chunk)))
                if got is not None:
                    out += got
                    continue
            done = await asyncio.gather(*(self.score(image, question, t["response"], t["mask"])
                                          for t in chunk))
            out += [TrajectoryScore.model_validate(d.model_dump()) for d in done]
        return out

    async def feedback(self, request_id: str, correct: bool) -> FeedbackResponse:
        return FeedbackResponse.model_validate(
            await self._post("/feedback", {"request_id": request_id, "correct": correct}))

    async def ready(self) -> bool:
        return (await self.http.get("/health/ready")).status_code == 200

    async def models(self) -> dict:
        r = await self._request("GET", "/v1/models")
        _raise_for(r, "/v1/models")
        return r.json()
