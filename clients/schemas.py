"""Request and response bodies of the HTTP API (the OpenAPI contract).

Only pydantic and the standard library, so a client can use them without the model stack.
Request bodies forbid unknown fields: a misspelt field is an error, not a silent default.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

B64_EXAMPLE = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/"
               "pLvAAAAAElFTkSuQmCC")
MAX_RESPONSE_CHARS = 20000
MAX_TRAJECTORIES = 64
MAX_NEW_TOKENS = 1024
MAX_REFERENCE_CHARS = 500
# Base64 as the server decodes it (`base64.b64decode(..., validate=True)`): the standard
# alphabet, padded to a multiple of 4, one line. Stated here once: pydantic enforces it and
# the OpenAPI document shows it.
B64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
# A field whose limit is a service setting carries `x-limit` (the setting's meaning); the
# service writes the configured value into its document as `maxLength` (`maxItems` for a
# list), so the document shows the limit the server enforces (`app.openapi`).
LIMIT = "x-limit"



def _image_string(value: object) -> object:
    # a value of another type is refused as what an image field takes (in a union with
    # "blank", pydantic's "a string" would read as though 'blank' were not one)
    if not isinstance(value, str):
        raise PydanticCustomError("image_type", "must be a base64 string of a PNG, JPEG or "
                                                "DICOM file")
    return value


# An image in a JSON body. The decoded bytes must be a PNG, JPEG or DICOM file within the
# service's size limits (413) that decodes (422): JSON Schema cannot say that, so `format`
# names it and the description says it.
Image64 = Annotated[str, Field(
    min_length=4, pattern=B64_PATTERN,
    description="a PNG, JPEG or DICOM file, base64 (standard alphabet, padded, one line)",
    json_schema_extra={"format": "image-base64", "contentEncoding": "base64", LIMIT: "image"}),
    BeforeValidator(_image_string)]
# Characters refused in questions and trajectories (as a regular-expression class): C0
# and C1 controls but tab, newline and carriage return; DEL; bidi embeddings, overrides and
# isolates. The service reads them from here (app.text.CONTROL); escapes that ECMA-262 and
# Python read alike.
CONTROL_CHARS = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
# Letters that render as nothing (Hangul fillers): the service drops them with the other
# invisible characters before it looks for a letter or digit (app.text.plain_question).
FILLERS = r"\u115f\u1160\u3164\uffa0"
# A letter or digit of any script: Unicode's categories L and N, which are what Python's
# `str.isalnum` takes (a test checks every code point). ECMA-262 and JSON Schema
# validators read `\p{..}` from their own Unicode tables: a letter newer than the
# server's Python (Unicode 14 for 3.11) is one to them and not to the server.
LETTER_OR_DIGIT = r"[\p{L}\p{N}]"
# ... but for a Hangul filler (a lookahead: JSON Schema patterns have no class subtraction)
VISIBLE_LETTER_OR_DIGIT = f"(?![{FILLERS}]){LETTER_OR_DIGIT}"


def _question_schema(schema: dict) -> None:
    # what Service.check_question refuses before the model: a control character; no letter
    # or digit once invisible characters are dropped (its messages say which)
    chars = f"[^{CONTROL_CHARS}]*"
    schema.update({"format": "question", LIMIT: "question",
                   "pattern": f"^{chars}{VISIBLE_LETTER_OR_DIGIT}{chars}$"})


# A question. The service also refuses a letter of another script inside a Latin word, and
# a question over its token limit (422): rules of the words and of the model's tokenizer.
Question = Annotated[str, Field(
    min_length=1, description="the question, plain text: no control character, at least "
                              "one letter or digit (any script; not a Hangul filler, which "
                              "renders as nothing and is dropped), at most the service's "
                              "length; also (422) within its token limit, and no letter of "
                              "another script posing as a Latin one",
    json_schema_extra=_question_schema)]


def integer(lo: int, hi: int) -> Any:
    """An integer field from `lo` to `hi`: a JSON integer, or a number with no fraction
    (`8.0`: JSON Schema's `integer`, and so the OpenAPI document's, admits it); never "8" or
    true (a client bug, not a request for 8 or 1). Every refusal has one message, which
    names the range (NaN is no integer, not a value past a bound)."""
    def check(value: object) -> object:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise PydanticCustomError("integer_range", "must be an integer " + (
                "equal to {lo}" if lo == hi else "from {lo} to {hi}"), {"lo": lo, "hi": hi})
        return value
    return Annotated[int, Field(ge=lo, le=hi, strict=True), BeforeValidator(check)]


def number(lo: float, hi: float) -> Any:
    """A number field from `lo` to `hi` (an integer is a number); never "0.5", true, NaN or
    an infinity, each refused as not a number (pydantic's own message called NaN "not less
    than or equal to 1")."""
    def check(value: object) -> object:
        # NaN and the infinities fail the comparison (math.isfinite would overflow on a
        # 4,000-digit integer)
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not lo <= value <= hi:
            raise PydanticCustomError("number_range", "must be a number from {lo} to {hi}",
                                      {"lo": lo, "hi": hi})
        return float(value)
    return Annotated[float, Field(ge=lo, le=hi, strict=True), BeforeValidator(check)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AnswerRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"image": B64_EXAMPLE, "question": "what color is the shape?"}]})
    image: Image64
    question: Question
    max_new_tokens: integer(1, MAX_NEW_TOKENS) | None = None


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
    novel: bool = Field(..., description="p_value < alpha (the heads card's novelty.alpha: "
                                         "0.02 for the embedded heads): the answer is "
                                         "deferred")


class DeferCode(StrEnum):
    """Why an answer is deferred, as a stable code (`defer_reasons`); the one list."""

    low_confidence = "low_confidence"
    novel_states = "novel_states"
    # the retired pixel image check's code: no longer emitted, kept so that responses
    # stored by earlier versions still parse
    image_flagged = "image_flagged"
    no_answer_tag = "no_answer_tag"
    empty_answer = "empty_answer"
    degenerate_repetition = "degenerate_repetition"
    truncated = "truncated"
    unusable_response = "unusable_response"
    no_heads = "no_heads"


# What each code means (docs and the OpenAPI description; a test keeps one per code).
DEFER_CODES: dict[DeferCode, str] = {
    DeferCode.low_confidence: "confidence.dualread is below defer_threshold (every answer "
                              "when the heads have no defer policy)",
    DeferCode.novel_states: "the actor's states are unlike the fitting data (novelty "
                            "p < alpha)",
    DeferCode.image_flagged: "retired, no longer emitted: the pixel image check of earlier "
                             "versions flagged the image (image-check p < alpha)",
    DeferCode.no_answer_tag: "the response has no <answer> tag",
    DeferCode.empty_answer: "the answer is empty",
    DeferCode.degenerate_repetition: "the response repeats itself",
    DeferCode.truncated: "the response was cut off at max_new_tokens",
    DeferCode.unusable_response: "the response is not usable for a reason without a code "
                                 "of its own (defer_reason names it)",
    DeferCode.no_heads: "the service runs answer-only: no heads for this model "
                        "(heads_mismatch = answer-only)",
}


class Timings(BaseModel):
    """Milliseconds per stage of one answer, in order: together the request's time in the
    server but for writing the response."""

    read: float = Field(
        0.0, description="from the request's arrival to its image's decoding: receiving "
                         "the body, its JSON or multipart parsing and the question's checks")
    decode_wait: float = Field(
        0.0, description="waiting for a decode slot (the service decodes at most "
                         "max_decodes images at once): other requests' large images held "
                         "this one before it was queued; 0 when a slot was free")
    decode: float = Field(
        0.0, description="decoding the image: base64, the file's checks and its pixels "
                         "(a large PNG's can take over a second)")
    queue: float = Field(..., description="queued for the model, until its batch started")
    generate: float = Field(..., description="the batch's generation")
    readout: float = Field(..., description="the batch's readout of the actor's states")
    heads: float = Field(..., description="the batch's heads (confidences, novelty)")


class AnswerResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "answer": "red", "response": "<think>I see a red circle. ...</think><answer>red</answer>"
        "<confidence>9</confidence>", "confidence": {"dualread": 0.97, "psr": 0.95,
                                                     "per": 0.98, "verbalized": 0.88},
        "defer": False, "defer_reason": None, "defer_reasons": [], "defer_threshold": 0.71,
        "novelty": {"score": -2.3, "p_value": 0.41, "novel": False},
        "model": "3f2a...",
        "heads": "9c1b...", "request_id": "5b0e...",
        "timings_ms": {"read": 0.6, "decode_wait": 0.0, "decode": 1.1, "queue": 1.2,
                       "generate": 80.1, "readout": 3.0, "heads": 0.4}}]})
    answer: str
    response: str
    confidence: Confidence | None = Field(
        ..., description="null only in answer-only mode (no heads for this model)")
    defer: bool = Field(..., description="route to a clinician: confidence below threshold, "
                                         "the input unlike the fitting data (novelty), the "
                                         "response did not parse, or no heads (answer-only "
                                         "mode)")
    defer_reason: str | None = Field(
        None, description="why the response itself is not trusted (no answer tag, empty "
                          "answer, repetition, truncated) and/or that the input is unlike "
                          "the fitting data (novelty p < alpha), or "
                          "\"no heads for this model\"; null when only confidence decides")
    defer_reasons: list[DeferCode] = Field(
        default_factory=list, description="why the answer is deferred, as stable codes "
        "(empty when it is not): " + "; ".join(f"{c.value}: {t}" for c, t in DEFER_CODES.items()))
    defer_threshold: float | None = Field(
        ..., description="τ of the heads' defer policy; null in answer-only mode")
    defer_rule_version: str | None = Field(
        None, description="the defer rule that decided `defer`: \"shipped\" (the heads' "
                          "own) or a version re-certified on operator feedback (GET "
                          "/calibration); null when the heads cannot say")
    novelty: Novelty | None = Field(
        None, description="the novelty detector's reading; null when the heads have none")
    calibrated: bool = Field(
        True, description="whether confidence.dualread is inside its calibrated range: "
                          "false when the defer rule's novelty detector flags the input, "
                          "where the number stays but its calibration, "
                          "measured on inputs like the fitting data, does not hold")
    model: str = Field(..., description="actor fingerprint")
    heads: str | None = Field(..., description="heads artefact id; null in answer-only mode")
    request_id: str = Field(..., description="server-generated; the key for /feedback")
    timings_ms: Timings




def _reference_schema(schema: dict) -> None:
    # the grader keeps letters and digits only (models.canon): without one nothing is left
    # to compare, and the service refuses the reference (422)
    schema["pattern"] = LETTER_OR_DIGIT


Reference = Annotated[str, Field(
    max_length=MAX_REFERENCE_CHARS, json_schema_extra=_reference_schema,
    description="the expected answer, graded by its letters and digits (at least one)")]


class CounterfactualRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "question": "what color is the shape?", "image": B64_EXAMPLE,
        "counterfactual": "blank", "reference_answer": "red"}]})
    question: Question
    image: Image64
    counterfactual: Literal["blank"] | Image64 = Field(
        ..., description='another image (base64) or "blank"')
    # Bounded: grading runs on the event loop, and a reference is a short answer.
    reference_answer: Reference | None = None
    counterfactual_reference_answer: Reference | None = None
    max_new_tokens: integer(1, MAX_NEW_TOKENS) | None = None


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
    defer_reasons: list[DeferCode] | None = None


class CounterfactualResponse(BaseModel):
    real: Run
    counterfactual: Run
    confidence_difference: Confidence = Field(..., description="real minus counterfactual")
    answer_changed: bool
    decisive: bool | None = Field(None, description="z_real = 1 and z_cf = 0 (docs/method.md §2)")
    strict: bool | None = Field(None, description="decisive and the same canonical answer")
    request_id: str


# A trajectory to score: the service also refuses control characters, reserved template
# tokens and more tokens than its limit (422).
ResponseText = Annotated[str, Field(
    min_length=1, max_length=MAX_RESPONSE_CHARS,
    description="the response to score, as the actor would write it: no control "
                "character; also (422) no reserved template token, within the service's "
                "token limit",
    json_schema_extra={"format": "trajectory", "pattern": f"^[^{CONTROL_CHARS}]*$"})]


SpanEnd = integer(0, MAX_RESPONSE_CHARS)


class MaskRequest(_Request):
    # strict, as max_new_tokens: `true` read as ratio 1.0 or "3" as a span end is a bug
    target: Literal["think", "answer", "response"] | tuple[SpanEnd, SpanEnd] = Field(
        "think", description="a tag's content, or a [start, end) character span of the "
                             "response before its confidence cue, read as the slice "
                             "text[start:end]: cut at the text's end, and an empty slice "
                             "(start >= end, or past the end) masks nothing "
                             "(masked_tokens 0)")
    ratio: number(0, 1) = 1.0
    seed: integer(0, 2**31 - 1) = 0


class ScoreRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "image": B64_EXAMPLE, "question": "what color is the shape?",
        "response": "<think>I see a red circle. The question asks for the colour, so the "
                    "answer is red.</think><answer>red</answer>",
        "mask": {"target": "think", "ratio": 1.0, "seed": 0}}]})
    image: Image64
    question: Question
    response: ResponseText
    mask: MaskRequest | None = None


class TrajectoryScore(BaseModel):
    confidence: Confidence
    mu_c: float | None = Field(None, description="verbalized μ(C) after the trajectory")
    answer: str
    masked_tokens: int
    digits: list[float] | None = Field(
        None, description="P(C = 0..10) after the trajectory, renormalised over the digit "
                          "tokens (what μ(C) averages); null without a confidence cue")


class ScoreResponse(TrajectoryScore):
    request_id: str


class Trajectory(_Request):
    response: ResponseText
    mask: MaskRequest | None = None


class ScoreBatchRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "image": B64_EXAMPLE, "question": "what color is the shape?",
        "trajectories": [
            {"response": "<think>I see a red circle.</think><answer>red</answer>",
             "mask": None},
            {"response": "<think>I see a red circle.</think><answer>red</answer>",
             "mask": {"target": "think", "ratio": 1.0, "seed": 0}}]}]})
    image: Image64
    question: Question
    trajectories: list[Trajectory] = Field(..., min_length=1, max_length=MAX_TRAJECTORIES,
                                           json_schema_extra={LIMIT: "jobs"})


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
    reason: Literal["unknown", "already_labelled", "duplicate_input", "already_counted",
                    "not_counting"] | None = Field(
        None, description="why a verdict was not accepted: no answer with this request_id "
                          "is remembered (never issued, issued by another replica, or too "
                          "long ago), or that answer already has its verdict. On an accepted "
                          "operator verdict that does not count toward re-certification, "
                          "why not: the same image and question is already in the window "
                          "(duplicate_input), this request id already counted "
                          "(already_counted), or the server counts no verdicts now "
                          "(not_counting; GET /calibration says why). Null otherwise")
    counted: bool = Field(False, description="whether this verdict counts toward "
                          "re-certifying the defer rule: only with the operator key, on a "
                          "server that has one (`X-Operator-Key` sent to a server without one "
                          "counts nothing, and this says so)")


class ErrorResponse(BaseModel):
    detail: str
    request_id: str
