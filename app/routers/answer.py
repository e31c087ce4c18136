"""POST /answer: JSON or multipart in, answer + confidence + defer flag out."""

from __future__ import annotations

import json
import re
import sys
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from app.deps import get_serving, media_type, request_id, require_json, require_key
from app.errors import InvalidInput, UnsupportedMediaType, explain, explain_json
from app.logs import LOG_REQUEST_ID
from app.routers.common import BODY_ERRORS, MODEL_ERRORS, confidence, error_responses
from app.schemas import (
    AnswerRequest,
    AnswerResponse,
    FeedbackRequest,
    FeedbackResponse,
    Timings,
)
from app.serving import AnswerItem, AnswerResult, Serving
from clients.schemas import DeferCode, Novelty

router = APIRouter(tags=["answer"], dependencies=[Depends(require_key)])

# The image part may be named `image` (as in the JSON body) or `file`; one of them.
IMAGE_PARTS = ("image", "file")
MULTIPART_FIELDS = {*IMAGE_PARTS, "question", "max_new_tokens"}
TWO_IMAGES = "multipart body has two image parts; send one, named 'image' or 'file'"
# A JSON number (RFC 8259), ASCII digits only (int() would take "٨" as 8): the grammar of
# a `max_new_tokens` part, whose declared content type is application/json
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
IMAGE_TYPES = "image/png, image/jpeg, application/dicom"


def _multipart_schema() -> dict:
    """The multipart form of `AnswerRequest`: the image as a file part, the other fields
    as in the JSON body (their constraints come from the one model)."""
    fields = AnswerRequest.model_json_schema()["properties"]
    mnt = next(b for b in fields["max_new_tokens"]["anyOf"] if b.get("type") == "integer")
    image = {"type": "string", "format": "binary", "minLength": 1,
             "description": f"a PNG, JPEG or DICOM file ({IMAGE_TYPES}; the server reads the "
                            "bytes, not the part's content type); name the part 'image' or "
                            "'file', not both"}
    question = fields["question"]
    mnt = {**mnt, "description": "an integer as a JSON number: 8, or 8.0 (a whole number)"}
    # One complete form per name of the image part (a oneOf of bare `required` lists beside
    # shared properties is read by some generators as "both may be sent"); the parts are
    # also listed at the top, where multipart encoders look for which part is a file.
    return {"type": "object", "properties": {
                **{part: image for part in IMAGE_PARTS}, "question": question,
                "max_new_tokens": mnt},
            "oneOf": [{"type": "object", "title": f"with an '{part}' part",
                       "required": [part, "question"], "additionalProperties": False,
                       "properties": {part: image, "question": question,
                                      "max_new_tokens": mnt}}
                      for part in IMAGE_PARTS]}


BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": AnswerRequest.model_json_schema()},
    "multipart/form-data": {"schema": _multipart_schema(), "encoding": {
        # its digits are a JSON integer (a part "8", or "[]" or "{}" when a generator
        # draws a list or an object there, which the server refuses)
        "max_new_tokens": {"contentType": "application/json"}}}}}}


# What a multipart body may name as its charset: these spellings, in any case. Others
# are refused before any part is read: Starlette reads a charset it does not know as
# Latin-1; some codecs Python knows are slow (punycode: quadratic) or raise what it does
# not catch; and `codecs.lookup`, which Starlette calls with the name as sent, keeps every
# name it is asked for, so only these few may reach it.
CHARSETS = frozenset({"utf-8", "utf8", "iso-8859-1", "iso8859-1", "latin-1", "latin1",
                      "us-ascii", "ascii"})


class _TextParts(MultiPartParser):
    """Starlette's multipart parser, except that a `question` part that is not valid in
    the body's charset is refused (Starlette reads it as Latin-1 instead, silently, and the
    question would be answered as mojibake), and so is a body that ends before its closing
    boundary (Starlette keeps the parts read so far). Other text parts have checks of
    their own."""

    ended = False
    image_parts = 0

    def on_headers_finished(self) -> None:
        # a second image part (`image` and `file`) is refused by name, before the parser's
        # own one-file limit would call it a 400 "too many files"
        _, options = parse_options_header(self._current_part.content_disposition)
        if b"filename" in options and options.get(b"name") in (b"image", b"file"):
            self.image_parts += 1
            if self.image_parts > 1:
                raise _Refused(TWO_IMAGES)
        super().on_headers_finished()

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None and part.field_name == "question":
            try:
                bytes(part.data).decode(self._charset)
            except UnicodeDecodeError:
                raise _Refused(f"multipart part 'question' is not valid {self._charset} text "
                               "(UTF-8 unless the body's content type names a charset)"
                               ) from None
        super().on_part_end()

    def on_end(self) -> None:
        self.ended = True
        super().on_end()


class _Refused(MultiPartException):
    """A multipart body refused with a 422 (the parser's own errors are 400s)."""


# Longest multipart Content-Type read: the parser walks it on the event loop (twice),
# about 1 µs a byte, and nothing else bounds a header's length
MAX_CONTENT_TYPE = 1024
MAX_BOUNDARY = 70            # RFC 2046 §5.1.1


def _check_charset(request: Request) -> None:
    """Refuse a content type too long to parse, with an empty or over-long boundary, or
    naming a charset not in `CHARSETS` (none means UTF-8)."""
    content_type = request.headers.get("content-type", "")
    if len(content_type) > MAX_CONTENT_TYPE:
        raise HTTPException(status_code=400, detail=f"Content-Type header over "
                                                    f"{MAX_CONTENT_TYPE} characters")
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if boundary is not None and not (1 <= len(boundary) <= MAX_BOUNDARY and boundary.isascii()):
        # an empty one was read as a boundary of two hyphens
        raise HTTPException(status_code=400, detail=f"multipart boundary must have 1 to "
                                                    f"{MAX_BOUNDARY} ASCII characters (RFC 2046)")
    named = params.get(b"charset", b"utf-8")
    named = named.decode("latin-1") if isinstance(named, bytes) else named
    if named.lower() not in CHARSETS:
        raise InvalidInput("multipart body names a charset other than UTF-8, ISO-8859-1 or "
                           "US-ASCII; send the question in UTF-8")


async def _form(request: Request) -> FormData:
    """`request.form(max_files=1, max_fields=2)`, checked (`_TextParts`, `CHARSETS`): 422
    for a question that is not text, 400 for a body the parser cannot read or that stops
    before its end, as Starlette."""
    _check_charset(request)
    # the parser's own warnings (python_multipart) name the request they are about
    logged = LOG_REQUEST_ID.set(request_id(request))
    try:
        async with aclosing(request.stream()) as stream:
            parser = _TextParts(request.headers, stream, max_files=1, max_fields=2)
            form = await parser.parse()
    except _Refused as e:
        raise InvalidInput(e.message) from None
    except MultiPartException as e:
        raise HTTPException(status_code=400, detail=e.message) from None
    finally:
        LOG_REQUEST_ID.reset(logged)
    if not parser.ended:
        # the parts read so far, and a file cut off mid-part (not among them)
        await form.close()
        for f in parser._files_to_close_on_error:
            f.close()
        raise HTTPException(status_code=400, detail="Invalid multipart data: the body ends "
                                                    "before its closing boundary.")
    return form


def _part_value(part: object) -> object:
    """What a text part holds as the JSON body's field would: a JSON number is read as one
    (ASCII blanks around it only: str.strip would also take U+3000 and the like); anything
    else stays text, which an integer field refuses as it refuses "8" in a JSON body."""
    if not isinstance(part, str):
        return part
    text = part.strip(" \t")
    # over Python's int digit limit json.loads raises; the text is refused as text instead
    if len(text) <= sys.get_int_max_str_digits() and _JSON_NUMBER.fullmatch(text):
        return json.loads(text)
    return text


def _part_field(name: str, part: object) -> object:
    """A multipart part validated by the JSON body's own field (`AnswerRequest`): one set of
    accepted values and one message for both encodings."""
    try:
        model = AnswerRequest.__pydantic_validator__.validate_assignment(
            AnswerRequest.model_construct(), name, _part_value(part))
    except ValidationError as e:
        raise InvalidInput(explain(e.errors())) from None
    return getattr(model, name)


async def _multipart(request: Request, serving: Serving) -> AnswerItem:
    form = await _form(request)
    try:
        return await _read_form(form, serving)
    finally:
        await form.close()


async def _read_form(form: FormData, serving: Serving) -> AnswerItem:
    extra = set(form.keys()) - MULTIPART_FIELDS
    if extra:
        raise InvalidInput("multipart body has unexpected parts; send image (or file), "
                           "question and optionally max_new_tokens")
    if any(len(form.getlist(k)) > 1 for k in MULTIPART_FIELDS):
        # the last would win, and a proxy that checked the first judged another request
        raise InvalidInput("multipart body repeats a part; send each of image (or file), "
                           "question and max_new_tokens at most once")
    given = [k for k in IMAGE_PARTS if k in form]
    if len(given) > 1:
        raise InvalidInput(TWO_IMAGES)
    upload = form.get(given[0]) if given else None
    if upload is None or isinstance(upload, str):
        raise InvalidInput("multipart body needs a 'file' part or an 'image' part, holding "
                           "a file (curl -F image=@x.png)")
    raw_mnt = form.get("max_new_tokens")
    mnt = None if raw_mnt is None else _part_field("max_new_tokens", raw_mnt)
    q = form.get("question")
    question = serving.question(q if isinstance(q, str) else "")
    limit = serving.max_new_tokens(mnt)
    image = await serving.image(await upload.read())
    return AnswerItem(image, question, limit)


def _validate_json(raw: bytes) -> AnswerRequest:
    try:
        return AnswerRequest.model_validate_json(raw)
    except ValidationError as e:
        raise InvalidInput(explain_json(e.errors(), raw, AnswerRequest)) from None


async def _json(request: Request, serving: Serving) -> AnswerItem:
    raw = await request.body()
    # a UTF-8 byte-order mark is ignored, as FastAPI's parser does on the other routes
    raw = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    # off the event loop: a 30 MB body of escapes takes pydantic 0.2 s to decode
    body = await run_in_threadpool(_validate_json, raw)
    question = serving.question(body.question)
    limit = serving.max_new_tokens(body.max_new_tokens)
    return AnswerItem(await serving.image_b64(body.image), question, limit)


def response(serving: Serving, rid: str, res: AnswerResult, queued_s: float) -> AnswerResponse:
    backend = serving.backend
    c, t, clock = res.confidence, res.timings, serving.clock()
    return AnswerResponse(
        answer=res.answer, response=res.response,
        confidence=None if c is None else confidence(c),
        defer=res.defer, defer_reason=res.defer_reason,
        defer_reasons=[DeferCode(code) for code in res.defer_codes],
        # τ and version of the rule that decided, not of one switched in since
        defer_threshold=backend.threshold if res.threshold is None else res.threshold,
        defer_rule_version=None if res.served is None else res.served.version,
        novelty=None if res.novelty is None else Novelty(
            score=res.novelty.score, p_value=res.novelty.p_value, novel=res.novelty.novel),
        calibrated=res.calibrated,
        model=backend.fingerprint, heads=backend.heads_id, request_id=rid,
        timings_ms=Timings(read=round((clock.read or 0.0) * 1000, 3),
                           decode_wait=round(clock.decode_wait * 1000, 3),
                           decode=round(clock.decode * 1000, 3),
                           queue=round(queued_s * 1000, 3),
                           generate=round(t.generate * 1000, 3),
                           readout=round(t.readout * 1000, 3), heads=round(t.heads * 1000, 3)))


@router.post("/answer", response_model=AnswerResponse, openapi_extra=BODY,
             responses=error_responses(*BODY_ERRORS, *MODEL_ERRORS))
async def answer(request: Request, serving: Serving = Depends(get_serving)) -> AnswerResponse:
    """Answer a visual question; confidence, defer flag and timings come with it."""
    serving.admit(request)
    kind = media_type(request)
    if kind == "multipart/form-data":
        item = await _multipart(request, serving)
    elif kind == "application/json":
        item = await _json(request, serving)
    else:
        raise UnsupportedMediaType("send application/json or multipart/form-data")
    rid = request_id(request)
    [served] = await serving.answer([item], request_id=rid, gone=request.is_disconnected)
    request.scope["state"]["batch_size"] = served.batch
    return response(serving, rid, served.result, served.queued_s)


async def operator_or_none(request: Request) -> str | None:
    # a dependency, run before the content type's, so a wrong operator key is answered
    # before the body's type and fields are judged, as on the operator routes (FastAPI runs
    # it once a request: its result is cached for the handler's `who`)
    return request.app.state.recert.operator(request)


@router.post("/feedback", response_model=FeedbackResponse, responses=error_responses(*BODY_ERRORS),
             dependencies=[Depends(operator_or_none), Depends(require_json)])
async def feedback(request: Request, body: FeedbackRequest,
                   who: str | None = Depends(operator_or_none)) -> FeedbackResponse:
    """A clinician's verdict on an earlier answer (by its server-generated request_id);
    feeds the calibration monitor. O(1): the window statistics wait for /metrics."""
    hooks = request.app.state.hooks
    # an operator's verdict (`who`) also counts toward re-certifying the defer rule, once
    # per id (app.recertify); anyone else's feeds the monitor only
    # both claims happen before the first await, so concurrent verdicts on one id cannot
    # each win one of them (the monitor's label and the certificate's count)
    labelled = hooks.feedback(body.request_id, body.correct)
    served = hooks.monitor.take_served(body.request_id) if who is not None else None
    count = {"counted": False} if served is None else await run_in_threadpool(
        request.app.state.recert.count, body.request_id, served, body.correct, who)
    counted = count["counted"]
    known = labelled or counted
    # accepted but an operator's verdict did not count: the store's why (a repeated input)
    reason = count.get("reason") if known else (
        "already_labelled" if hooks.monitor.already_labelled(body.request_id) else "unknown")
    return FeedbackResponse(accepted=known, window=len(hooks.monitor.window), reason=reason,
                            counted=counted)
