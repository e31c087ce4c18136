"""Request and response bodies of the HTTP API (the OpenAPI contract).

Only pydantic and the standard library, so a client can use them without the model stack.
Request bodies forbid unknown fields: a misspelt field is an error, not a silent default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model

B64_EXAMPLE = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/"
               "pLvAAAAAElFTkSuQmCC")
MAX_RESPONSE_CHARS = 20000
MAX_TRAJECTORIES = 64
MAX_NEW_TOKENS = 1024
MAX_REFERENCE_CHARS = 500


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AnswerRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"image": B64_EXAMPLE, "question": "what color is the shape?"}]})
    image: str = Field(..., description="PNG, JPEG or DICOM bytes, base64 (one line)")
    question: str = Field(..., min_length=1)
    # strict: `true` or "8" is a client bug, not a request for 1 or 8 tokens
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, strict=True)


# The confidence fields of `/answer` (and of the probe routes), in response order, with
# their OpenAPI descriptions: the one list. `Confidence` below and the serving layer's
# `Confidences` are built from it, and the method registry refuses a method marked `served`
# that is not here (heads/registry.py), so a new served method is one line here too.
SERVED_CONFIDENCES: dict[str, str] = {
    "dualread": "fused DualRead confidence",
    "psr": "pre-answer branch (PSR)",
    "per": "post-answer branch (P-State + P-Visual)",
    "verbalized": "the actor's own μ(C)",
}

Confidence = create_model(
    "Confidence",
    __doc__="Confidences of one run, or (in `confidence_difference`) real minus "
            "counterfactual.",
    __module__=__name__,
    **{name: (float, Field(..., description=text))
       for name, text in SERVED_CONFIDENCES.items()},
)


# One schema: a difference of confidences has the same fields.
ConfidenceDifference = Confidence


class Novelty(BaseModel):
    """How unlike the heads' fitting data the input is (a conformal novelty p-value)."""

    score: float = Field(..., description="novelty score on the actor's states (larger = "
                                          "more unusual; for a composite detector "
                                          "-log10 of p_value)")
    p_value: float = Field(..., description="(1 + #{calibration scores >= score}) / (n + 1) "
                                            "over the clean calibration items (the "
                                            "temperature and defer splits); for a composite "
                                            "detector min(1, m * the smallest part's)")
    novel: bool = Field(..., description="p_value < alpha (the heads card's novelty.alpha, "
                                         "0.01): the answer is deferred")


class ImageCheck(BaseModel):
    """How unlike the fitting images the input's image-quality statistics are (blur, noise,
    JPEG blocking, contrast, ...; a conformal p-value of a one-class detector)."""

    score: float = Field(..., description="distance of the image's standardised quality "
                                          "statistics to the 5th nearest fitting image "
                                          "(larger = more unusual)")
    p_value: float = Field(..., description="(1 + #{calibration scores >= score}) / (n + 1) "
                                            "over the clean calibration images")
    flagged: bool = Field(..., description="p_value < alpha (the heads card's "
                                           "image_check.alpha, 0.01): the answer is deferred")


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
        "defer": False, "defer_reason": None, "defer_threshold": 0.71,
        "novelty": {"score": -2.3, "p_value": 0.41, "novel": False},
        "image_check": {"score": 3.1, "p_value": 0.52, "flagged": False}, "model": "3f2a...",
        "heads": "9c1b...", "request_id": "5b0e...",
        "timings_ms": {"queue": 1.2, "generate": 80.1, "readout": 3.0, "heads": 0.4}}]})
    answer: str
    response: str
    confidence: Confidence
    defer: bool = Field(..., description="route to a clinician: confidence below threshold, "
                                         "the image unlike the fitting data (novelty or "
                                         "image check), or the response did not parse")
    defer_reason: str | None = Field(
        None, description="why the response itself is not trusted (no answer tag, empty "
                          "answer, repetition, truncated) and/or that the image is unlike "
                          "the fitting data (novelty p < alpha, image-check p < alpha); null "
                          "when only confidence decides")
    defer_threshold: float
    novelty: Novelty | None = Field(
        None, description="the novelty detector's reading; null when the heads have none")
    image_check: ImageCheck | None = Field(
        None, description="the image check's reading; null when the heads have none")
    calibrated: bool = Field(
        True, description="whether confidence.dualread is inside its calibrated range: "
                          "false when a detector of the defer rule flags the input (novelty "
                          "or image check), where the number stays but its calibration, "
                          "measured on inputs like the fitting data, does not hold")
    model: str = Field(..., description="actor fingerprint")
    heads: str = Field(..., description="heads artefact id")
    request_id: str = Field(..., description="server-generated; the key for /feedback")
    timings_ms: Timings




class CounterfactualRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "question": "what color is the shape?", "image": B64_EXAMPLE,
        "counterfactual": "blank", "reference_answer": "red"}]})
    question: str = Field(..., min_length=1)
    image: str = Field(..., description="the real image, base64")
    counterfactual: str = Field(..., description='another image (base64) or "blank"')
    # Bounded: grading runs on the event loop, and a reference is a short answer.
    reference_answer: str | None = Field(None, max_length=MAX_REFERENCE_CHARS)
    counterfactual_reference_answer: str | None = Field(None, max_length=MAX_REFERENCE_CHARS)
    # strict: `true` or "8" is a client bug, not a request for 1 or 8 tokens
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, strict=True)


class Run(BaseModel):
    answer: str
    canonical: str
    response: str
    confidence: Confidence
    correct: bool | None = None
    # what /answer would decide for this run: `correct` compares the answer alone, so a
    # truncated or untagged response can match its reference; the reason says so
    defer: bool | None = None
    defer_reason: str | None = None


class CounterfactualResponse(BaseModel):
    real: Run
    counterfactual: Run
    confidence_difference: Confidence = Field(..., description="real minus counterfactual")
    answer_changed: bool
    decisive: bool | None = Field(None, description="z_real = 1 and z_cf = 0 (SPEC §2)")
    strict: bool | None = Field(None, description="decisive and the same canonical answer")
    request_id: str


class MaskRequest(_Request):
    # strict, as max_new_tokens: `true` read as ratio 1.0 or "3" as a span end is a bug
    target: Literal["think", "answer", "response"] | tuple[StrictInt, StrictInt] = Field(
        "think", description='a tag\'s content or a [start, end) character span')
    ratio: float = Field(1.0, ge=0, le=1, strict=True)
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True)


class ScoreRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "image": B64_EXAMPLE, "question": "what color is the shape?",
        "response": "<think>I see a red circle. The question asks for the colour, so the "
                    "answer is red.</think><answer>red</answer>",
        "mask": {"target": "think", "ratio": 1.0, "seed": 0}}]})
    image: str
    question: str = Field(..., min_length=1)
    response: str = Field(..., min_length=1, max_length=MAX_RESPONSE_CHARS)
    mask: MaskRequest | None = None


class TrajectoryScore(BaseModel):
    confidence: Confidence
    mu_c: float | None = Field(None, description="verbalized μ(C) after the trajectory")
    answer: str
    masked_tokens: int


class ScoreResponse(TrajectoryScore):
    request_id: str


class Trajectory(_Request):
    response: str = Field(..., min_length=1, max_length=MAX_RESPONSE_CHARS)
    mask: MaskRequest | None = None


class ScoreBatchRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "image": B64_EXAMPLE, "question": "what color is the shape?",
        "trajectories": [
            {"response": "<think>I see a red circle.</think><answer>red</answer>",
             "mask": None},
            {"response": "<think>I see a red circle.</think><answer>red</answer>",
             "mask": {"target": "think", "ratio": 1.0, "seed": 0}}]}]})
    image: str
    question: str = Field(..., min_length=1)
    trajectories: list[Trajectory] = Field(..., min_length=1, max_length=MAX_TRAJECTORIES)


class ScoreBatchResponse(BaseModel):
    results: list[TrajectoryScore] = Field(..., description="in the order of the request")
    request_id: str


class FeedbackRequest(_Request):
    request_id: str = Field(..., min_length=1, max_length=64,
                            description="the request_id of an earlier /answer response")
    correct: bool = Field(..., strict=True, description="true or false (not 1 or \"yes\")")


class FeedbackResponse(BaseModel):
    accepted: bool
    window: int
    reason: Literal["unknown", "already_labelled"] | None = Field(
        None, description="why a verdict was not accepted: no answer with this request_id "
                          "is remembered (never issued, issued by another replica, or too "
                          "long ago), or that answer already has its verdict; null when "
                          "accepted")


class ErrorResponse(BaseModel):
    detail: str
    request_id: str
