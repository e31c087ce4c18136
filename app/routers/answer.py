"""POST /answer: JSON or multipart in, answer + confidence + defer flag out."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, Headers
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from app.deps import get_serving, media_type, request_id, require_json, require_key
from app.errors import InvalidInput, UnsupportedMediaType, explain
from app.routers.common import ERRORS, confidence
from app.schemas import (
    MAX_NEW_TOKENS,
    AnswerRequest,
    AnswerResponse,
    FeedbackRequest,
    FeedbackResponse,
    Timings,
)
from app.serving import AnswerItem, AnswerResult, Serving
from clients.schemas import ImageCheck, Novelty

router = APIRouter(tags=["answer"], dependencies=[Depends(require_key)])

MULTIPART_FIELDS = {"file", "question", "max_new_tokens"}
_INT = re.compile(r"^[0-9]{1,4}$")   # ASCII: int() would take "٨" as 8
BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": AnswerRequest.model_json_schema()},
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "question"], "additionalProperties": False,
        "properties": {"file": {"type": "string", "format": "binary"},
                       "question": {"type": "string", "minLength": 1},
                       "max_new_tokens": {"type": "integer", "minimum": 1,
                                          "maximum": MAX_NEW_TOKENS}}}}}}}


class _NotText(MultiPartException):
    pass


class _TextParts(MultiPartParser):
    """Starlette's multipart parser, except that a `question` part that is not valid in
    the charset the body names (UTF-8 when it names none) is refused: Starlette reads it
    as Latin-1 instead, silently (also under a charset it does not know), and the question
    would be answered as mojibake. Other text parts have checks of their own."""

    def __init__(self, headers: Headers, stream: AsyncGenerator[bytes, None],
                 **limits: Any) -> None:
        super().__init__(headers, stream, **limits)
        _, params = parse_options_header(headers.get("content-type", ""))
        named = params.get(b"charset", b"utf-8")
        self.named = named.decode("latin-1") if isinstance(named, bytes) else named

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None and part.field_name == "question":
            try:
                bytes(part.data).decode(self.named)
            except LookupError:
                raise _NotText("multipart body names a charset this server does not know; "
                               "send the question in UTF-8") from None
            except UnicodeDecodeError:
                raise _NotText(f"multipart part 'question' is not valid {self.named} text "
                               "(UTF-8 unless the body's content type names a charset)"
                               ) from None
        super().on_part_end()


async def _form(request: Request) -> FormData:
    """`request.form(max_files=1, max_fields=2)`, with the question checked (`_TextParts`):
    422 for one that is not text, 400 for a body the parser cannot read, as Starlette."""
    try:
        async with aclosing(request.stream()) as stream:
            return await _TextParts(request.headers, stream, max_files=1, max_fields=2).parse()
    except _NotText as e:
        raise InvalidInput(e.message) from None
    except MultiPartException as e:
        raise HTTPException(status_code=400, detail=e.message) from None


async def _multipart(request: Request, serving: Serving) -> AnswerItem:
    form = await _form(request)
    try:
        return await _read_form(form, serving)
    finally:
        await form.close()


async def _read_form(form: FormData, serving: Serving) -> AnswerItem:
    extra = set(form.keys()) - MULTIPART_FIELDS
    if extra:
        raise InvalidInput("multipart body has unexpected parts; send file, question and "
                           "optionally max_new_tokens")
    if any(len(form.getlist(k)) > 1 for k in MULTIPART_FIELDS):
        # the last would win, and a proxy that checked the first judged another request
        raise InvalidInput("multipart body repeats a part; send each of file, question and "
                           "max_new_tokens at most once")
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise InvalidInput("multipart body needs a 'file' part")
    raw_mnt = form.get("max_new_tokens")
    mnt = None
    if raw_mnt is not None:
        if not isinstance(raw_mnt, str) or not _INT.match(raw_mnt.strip()) or \
                not 1 <= int(raw_mnt) <= MAX_NEW_TOKENS:
            raise InvalidInput(f"max_new_tokens must be an integer from 1 to {MAX_NEW_TOKENS}")
        mnt = int(raw_mnt)
    q = form.get("question")
    question = serving.question(q if isinstance(q, str) else "")
    limit = serving.max_new_tokens(mnt)
    image = await serving.image(await upload.read())
    return AnswerItem(image, question, limit)


async def _json(request: Request, serving: Serving) -> AnswerItem:
    raw = await request.body()
    # a UTF-8 byte-order mark is ignored, as FastAPI's parser does on the other routes
    raw = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    try:
        body = AnswerRequest.model_validate_json(raw)
    except ValidationError as e:
        raise InvalidInput(explain(e.errors())) from None
    question = serving.question(body.question)
    limit = serving.max_new_tokens(body.max_new_tokens)
    return AnswerItem(await serving.image_b64(body.image), question, limit)


def response(serving: Serving, rid: str, res: AnswerResult, queued_s: float) -> AnswerResponse:
    backend = serving.backend
    c, t = res.confidence, res.timings
    return AnswerResponse(
        answer=res.answer, response=res.response,
        confidence=confidence(c),
        defer=res.defer, defer_reason=res.defer_reason, defer_threshold=backend.threshold,
        novelty=None if res.novelty is None else Novelty(
            score=res.novelty.score, p_value=res.novelty.p_value, novel=res.novelty.novel),
        image_check=None if res.image_check is None else ImageCheck(
            score=res.image_check.score, p_value=res.image_check.p_value,
            flagged=res.image_check.novel),
        model=backend.fingerprint, heads=backend.heads_id, request_id=rid,
        timings_ms=Timings(queue=round(queued_s * 1000, 3),
                           generate=round(t.generate * 1000, 3),
                           readout=round(t.readout * 1000, 3), heads=round(t.heads * 1000, 3)))


@router.post("/answer", response_model=AnswerResponse, responses=ERRORS, openapi_extra=BODY)
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


@router.post("/feedback", response_model=FeedbackResponse, responses=ERRORS,
             dependencies=[Depends(require_json)])
async def feedback(request: Request, body: FeedbackRequest) -> FeedbackResponse:
    """A clinician's verdict on an earlier answer (by its server-generated request_id);
    feeds the calibration monitor. O(1): the window statistics wait for /metrics."""
    hooks = request.app.state.hooks
    known = hooks.feedback(body.request_id, body.correct)
    reason = None if known else (
        "already_labelled" if hooks.monitor.already_labelled(body.request_id) else "unknown")
    return FeedbackResponse(accepted=known, window=len(hooks.monitor.window), reason=reason)
