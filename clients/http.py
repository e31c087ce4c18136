"""Typed HTTP client for a dualread deployment (any host: it speaks HTTP only)."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx

from app.schemas import (
    AnswerResponse,
    CounterfactualResponse,
    FeedbackResponse,
    ScoreResponse,
)


def _b64(image: bytes | str | Path) -> str:
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    return base64.b64encode(data).decode()


class DualReadClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def __enter__(self) -> DualReadClient:
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            detail = r.json().get("detail") if r.headers.get("content-type", "").startswith(
                "application/json") else r.text
            raise httpx.HTTPStatusError(f"{r.status_code} on {path}: {detail}",
                                        request=r.request, response=r)
        return r.json()

    def answer(self, image: bytes | str | Path, question: str,
               max_new_tokens: int | None = None) -> AnswerResponse:
        body = {"image": _b64(image), "question": question}
        if max_new_tokens:
            body["max_new_tokens"] = max_new_tokens
        return AnswerResponse.model_validate(self._post("/answer", body))

    def counterfactual(self, image: bytes | str | Path, question: str,
                       counterfactual: bytes | str | Path | None = None,
                       reference: str | None = None,
                       counterfactual_reference: str | None = None) -> CounterfactualResponse:
        """`counterfactual=None` uses the blank image (SPEC §5)."""
        body = {"image": _b64(image), "question": question,
                "counterfactual": "blank" if counterfactual is None else _b64(counterfactual),
                "reference_answer": reference,
                "counterfactual_reference_answer": counterfactual_reference}
        return CounterfactualResponse.model_validate(self._post("/probe/counterfactual", body))

    def score(self, image: bytes | str | Path, question: str, response: str,
              mask: dict | None = None) -> ScoreResponse:
        body = {"image": _b64(image), "question": question, "response": response, "mask": mask}
        return ScoreResponse.model_validate(self._post("/probe/score", body))

    def feedback(self, request_id: str, correct: bool) -> FeedbackResponse:
        return FeedbackResponse.model_validate(
            self._post("/feedback", {"request_id": request_id, "correct": correct}))

    def ready(self) -> bool:
        return self.http.get("/health/ready").status_code == 200

    def models(self) -> dict:
        return self.http.get("/v1/models").json()
