"""Request and response bodies (the OpenAPI contract)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

B64_EXAMPLE = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/"
               "pLvAAAAAElFTkSuQmCC")


class AnswerRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"image": B64_EXAMPLE, "question": "what color is the shape?"}]})
    image: str = Field(..., description="PNG, JPEG or DICOM bytes, base64")
    question: str = Field(..., min_length=1)
    max_new_tokens: int | None = Field(None, ge=1, le=1024)


class Confidence(BaseModel):
    dualread: float = Field(..., ge=0, le=1, description="fused DualRead confidence")
    psr: float = Field(..., ge=0, le=1, description="pre-answer branch (PSR)")
    per: float = Field(..., ge=0, le=1, description="post-answer branch (P-State + P-Visual)")
    verbalized: float = Field(..., ge=0, le=1, description="the actor's own μ(C)")


class ConfidenceDifference(BaseModel):
    dualread: float
    psr: float
    per: float
    verbalized: float


class Timings(BaseModel):
    queue: float
    generate: float
    readout: float
    heads: float


class AnswerResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "answer": "red", "response": "<think>I see a red circle. ...</think><answer>red</answer>"
        "<confidence>9</confidence>", "confidence": {"dualread": 0.97, "psr": 0.95,
                                                     "per": 0.98, "verbalized": 0.88},
        "defer": False, "defer_threshold": 0.71, "model": "3f2a...", "heads": "9c1b...",
        "request_id": "5b0e...", "timings_ms": {"queue": 1.2, "generate": 80.1,
                                                "readout": 3.0, "heads": 0.4}}]})
    answer: str
    response: str
    confidence: Confidence
    defer: bool = Field(..., description="route to a clinician: confidence below threshold")
    defer_threshold: float
    model: str = Field(..., description="actor fingerprint")
    heads: str = Field(..., description="heads artefact id")
    request_id: str
    timings_ms: Timings


class CounterfactualRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "question": "what color is the shape?", "image": B64_EXAMPLE,
        "counterfactual": "blank", "reference_answer": "red"}]})
    question: str = Field(..., min_length=1)
    image: str = Field(..., description="the real image, base64")
    counterfactual: str = Field(..., description='another image (base64) or "blank"')
    reference_answer: str | None = None
    counterfactual_reference_answer: str | None = None
    max_new_tokens: int | None = Field(None, ge=1, le=1024)


class Run(BaseModel):
    answer: str
    canonical: str
    response: str
    confidence: Confidence
    correct: bool | None = None


class CounterfactualResponse(BaseModel):
    real: Run
    counterfactual: Run
    confidence_difference: ConfidenceDifference = Field(
        ..., description="real minus counterfactual")
    answer_changed: bool
    decisive: bool | None = Field(None, description="z_real = 1 and z_cf = 0 (SPEC §2)")
    strict: bool | None = Field(None, description="decisive and the same canonical answer")
    request_id: str


class MaskRequest(BaseModel):
    target: Literal["think", "answer", "response"] | tuple[int, int] = "think"
    ratio: float = Field(1.0, ge=0, le=1)
    seed: int = 0


class ScoreRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "image": B64_EXAMPLE, "question": "what color is the shape?",
        "response": "<think>I see a red circle. The question asks for the colour, so the "
                    "answer is red.</think><answer>red</answer>",
        "mask": {"target": "think", "ratio": 1.0, "seed": 0}}]})
    image: str
    question: str = Field(..., min_length=1)
    response: str = Field(..., min_length=1, max_length=20000)
    mask: MaskRequest | None = None


class ScoreResponse(BaseModel):
    confidence: Confidence
    mu_c: float | None = Field(None, description="verbalized μ(C) after the trajectory")
    answer: str
    masked_tokens: int
    request_id: str


class FeedbackRequest(BaseModel):
    request_id: str
    correct: bool


class FeedbackResponse(BaseModel):
    accepted: bool
    window: int


class ErrorResponse(BaseModel):
    detail: str
