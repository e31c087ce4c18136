"""POST /v1/chat/completions: the OpenAI chat API over `/answer`'s serving path.

One user message with one image part (a data URI) and its text (the question) in; the
answer as the assistant message out, with `/answer`'s whole response (confidence, `defer`,
`defer_reason`, novelty, ids, timings) in the extension field `dualread`.
Decoding, limits and the model path are `/answer`'s (`Serving`); errors on this route
leave in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` (`OpenAIErrors`).

The request models read OpenAI's whole request (a system message or a string content get a
422 that names them); the document states the request this route serves: one user message
whose content holds exactly one image (a base64 data URI of a PNG, JPEG or DICOM file) and
the question as text parts, with the limits `/answer` has (`app.openapi`).
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.deps import get_serving, request_id, require_json, require_key
from app.errors import (
    REQUEST_ID,
    InvalidInput,
    detail_of,
    explained_json,
    joined,
    status_of,
)
from app.routers.answer import response
from app.routers.common import BODY_ERRORS, MODEL_ERRORS, error_responses
from app.schemas import MAX_NEW_TOKENS, AnswerResponse
from app.serving import AnswerItem, Serving
from clients.schemas import (
    B64_EXAMPLE,
    CONTROL_CHARS,
    LIMIT,
    VISIBLE_LETTER_OR_DIGIT,
    DeferCode,
    integer,
    number,
)
from models.images import ImageInvalid, ImageTooLarge

PATH = "/v1/chat/completions"
# The one model this service serves, by the name /v1/models lists; a request may name any
# model (there is no other to route to), the response names this one.
MODEL_ID = "dualread"
MAX_MESSAGES = 8
MAX_PARTS = 8
MAX_DATA_URI_HEADER = 128     # "data:image/png;base64": the part before the comma
# The files the decoder reads, by the media type a data URI names them with (the server
# still reads the bytes, not the name).
MEDIA_TYPES = ("image/png", "image/jpeg", "application/dicom")
_HEAD = "data:(?:" + "|".join(re.escape(t) for t in MEDIA_TYPES) + ");base64"
DATA_URI_HEAD = re.compile(_HEAD)
# The whole URI as the document states it: one of those heads, then base64 as
# `clients.schemas.B64_PATTERN` has it (standard alphabet, padded, one line), not empty.
DATA_URI_PATTERN = ("^" + _HEAD + ",(?:[A-Za-z0-9+/]{4})*"
                    "(?:[A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)$")
# The longest head with its comma: a URI is that and the image's base64 at most (the
# `x-limit` "data_uri" of `app.openapi`).
DATA_URI_HEAD_CHARS = len("data:;base64,") + max(len(t) for t in MEDIA_TYPES)
# The served message's content, as a 422's detail names a field (one user message)
CONTENT = "messages.0.content"


# ---------------------------------------------------------------------------- request
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(..., description="the question, or one line of it: the text parts, "
                                       "joined by newlines, are the question, with "
                                       "/answer's rules (no control character, a letter "
                                       "or digit in one of the parts, "
                                       "each part within the length limit, the question "
                                       "within the token limit; 422)",
                      json_schema_extra={"format": "question", LIMIT: "question",
                                         "pattern": f"^[^{CONTROL_CHARS}]*$"})


class ImageURL(_Strict):
    url: str = Field(..., description="a base64 data URI of a PNG, JPEG or DICOM file "
                                      "(`data:image/png;base64,...`; image/jpeg, "
                                      "application/dicom); the server fetches no URL and "
                                      "reads the bytes, not the media type. The bytes must "
                                      "decode as an image (422) within the service's size "
                                      "limits (413)",
                      json_schema_extra={"pattern": DATA_URI_PATTERN,
                                         "format": "image-data-uri", LIMIT: "data_uri"})
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted and ignored: the actor's processor sets the resolution")


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _user_only(schema: dict) -> None:
    """The one role served (the others are read, to be refused by name)."""
    schema["enum"] = ["user"]


def _one_image(schema: dict) -> None:
    """Content as served: a list of parts, exactly one of them an image, one or more text
    (a string content has no image; it is read, to be refused with that reason)."""
    [parts] = [s for s in schema.pop("anyOf") if s.get("type") == "array"]
    schema.update(parts)
    schema["allOf"] = [
        {"contains": {"type": "object", "properties": {"type": {"const": "image_url"}},
                      "required": ["type"]}, "minContains": 1, "maxContains": 1},
        # a text part, and one with a letter or digit (the joined question needs one)
        {"contains": {"type": "object", "properties": {"type": {"const": "text"}},
                      "required": ["type"]}, "minContains": 1},
        {"contains": {"type": "object", "properties": {
            "type": {"const": "text"}, "text": {"type": "string",
                                                "pattern": VISIBLE_LETTER_OR_DIGIT}},
                      "required": ["type", "text"]}}]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        ..., description="user: the actor's prompt is fixed (a system, developer or "
                         "assistant message is refused, 422)",
        json_schema_extra=_user_only)
    content: str | Annotated[list[Part], Field(max_length=MAX_PARTS)] = Field(
        ..., description="one image_url part and the question as one or more text parts",
        json_schema_extra=_one_image)
    name: str | None = Field(None, max_length=64)


class ChatRequest(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "model": MODEL_ID, "max_tokens": 64, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + B64_EXAMPLE}},
            {"type": "text", "text": "what color is the shape?"}]}]}],
        # the generation limit by one name: not both (null counts as not sent)
        "not": {"required": ["max_tokens", "max_completion_tokens"], "properties": {
            "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}})
    model: str = Field(..., min_length=1, max_length=256,
                       description=f"any name: the service serves one model ({MODEL_ID!r})")
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES,
                                        description="exactly one user message: one image_url "
                                                    "part and the question as text",
                                        json_schema_extra={"maxItems": 1})
    max_tokens: integer(1, MAX_NEW_TOKENS) | None = Field(
        None, description="the generation limit (at most the service's); not with "
                          "max_completion_tokens (422)")
    max_completion_tokens: integer(1, MAX_NEW_TOKENS) | None = Field(
        None, description="max_tokens' newer name; not with max_tokens (422)")
    n: integer(1, 1) | None = Field(None, description="one choice only")
    stream: bool | None = Field(None, strict=True, description="false only: no streaming",
                                json_schema_extra={"anyOf": [{"type": "boolean",
                                                              "const": False},
                                                             {"type": "null"}]})
    temperature: number(0, 2) | None = Field(
        None, description="accepted and ignored: decoding is greedy, so the confidence describes "
                    "the answer that is returned")
    user: str | None = Field(None, max_length=256, description="accepted and ignored")


# ---------------------------------------------------------------------------- response
class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    # "length": the response was cut at the token limit (OpenAI's meaning; `dualread` then
    # defers with `truncated`), so a client reading only the standard fields sees it
    finish_reason: Literal["stop", "length"] = "stop"
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str = Field(..., description="chatcmpl- and the request id (the key for /feedback "
                                     "is `dualread.request_id`)")
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    dualread: AnswerResponse = Field(..., description="DualRead's reading of the answer: "
                                                      "the same object POST /answer returns "
                                                      "(confidence, defer, defer_reason, ...)")


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


# OpenAI's error `type` and a short `code` per status this route can answer with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error"}
ERROR_CODES = {400: "bad_request", 401: "invalid_api_key", 404: "not_found",
               405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large",
               415: "unsupported_media_type", 422: "invalid_value", 429: "queue_full",
               500: "internal_error", 503: "not_ready", 504: "deadline_exceeded"}


def _errors(*codes: int) -> dict[int | str, dict]:
    """The route's `responses=`: the service's statuses, meanings and headers, in OpenAI's
    error shape. 401 is the document's to add, when a key is configured (`app.openapi`)."""
    out = error_responses(*codes)
    for entry in out.values():
        entry["model"] = OpenAIError
        entry["description"] = entry["description"].replace("`detail`", "`error.message`")
    return out


# A JSON body read whole and the model's statuses; the 400 is the framing's (Content-Length
# with Transfer-Encoding, a broken chunked body): an unreadable JSON body is a 422
ERRORS = _errors(*BODY_ERRORS, *MODEL_ERRORS)
ERRORS[400]["description"] = ("the body is framed two ways (Content-Length with "
                              "Transfer-Encoding) or its chunked framing is broken, or a "
                              "credential header (Authorization) is sent twice")


# a request path in a message, as the service writes it (`messages.0.content.1.text`)
# (ASCII names of `_IDENT`'s length only, ending where a name ends: `_param` converts all
# of what it matches, and no text is dropped)
_PATH_IN_TEXT = re.compile(r"(?<![A-Za-z0-9_.\[])messages"
                           r"(?:\.(?:[0-9]+|[A-Za-z_][A-Za-z0-9_]{0,40}))+(?![A-Za-z0-9_])")


def _openai_paths(message: str) -> str:
    """The request paths a message names, as `param` writes them (`messages[0].content`)."""
    return _PATH_IN_TEXT.sub(lambda m: _param(m.group(0)) or m.group(0), message)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": _openai_paths(message),
                      "type": ERROR_TYPES.get(status, "server_error" if status >= 500
                                              else "invalid_request_error"),
                      "param": param, "code": ERROR_CODES.get(status)}}


class _Refused(Exception):
    """A client error on this route, with the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# ---------------------------------------------------------------------------- decoding
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")


def _param(where: str) -> str | None:
    """A field's path as a 422's detail names it (`messages.0.content.1.text`) as OpenAI
    writes `param` (`messages[0].content[1].text`), up to a name that is not a plain
    identifier (none is: the path holds the request's own field names)."""
    out = ""
    for x in where.split(".") if where else ():
        if x.isascii() and x.isdecimal():
            out += f"[{x}]"
        elif _IDENT.match(x):
            out += f".{x}" if out else x
        else:
            break
    return out or None


def _parse(raw: bytes) -> ChatRequest:
    raw = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    try:
        return ChatRequest.model_validate_json(raw)
    except ValidationError as e:
        # `param`: the first field the detail names, content parts by their index
        parts = explained_json(e.errors(), raw, ChatRequest)
        param = _param(".".join(parts[0][0])) if parts else None
        raise _Refused(422, joined(parts), param) from None


def _question_and_image(body: ChatRequest) -> tuple[list[tuple[str, str]], str, str]:
    """The one user message's text parts (each with its field's path), its image's base64
    and the path of the image's url (messages name the route's own fields)."""
    for k, m in enumerate(body.messages):
        if m.role != "user":
            raise _Refused(422, f"messages[{k}]: only one user message is served (the "
                                "actor's prompt is fixed: no system, developer or assistant "
                                "messages)", f"messages[{k}].role")
    if len(body.messages) != 1:
        raise _Refused(422, "send exactly one user message: one image and its question",
                       "messages")
    content = body.messages[0].content
    parts = [TextPart(type="text", text=content)] if isinstance(content, str) else content
    images = [(k, p) for k, p in enumerate(parts) if isinstance(p, ImagePart)]
    if len(images) != 1:
        raise _Refused(422, "the user message needs exactly one image_url part (a data URI)",
                       "messages[0].content")
    texts = [(f"{CONTENT}.{k}.text", p.text) for k, p in enumerate(parts)
             if isinstance(p, TextPart)]
    [(k, image)] = images
    where = f"{CONTENT}.{k}.image_url.url"
    return texts, _data_uri(image.image_url.url, where), where


def _data_uri(url: str, where: str) -> str:
    """The base64 payload of `data:<type>;base64,<payload>`, `<type>` one the document
    names (`MEDIA_TYPES`); it is not trusted past that (the decoder reads the bytes)."""
    head, comma, _ = url[: MAX_DATA_URI_HEADER + 1].partition(",")
    if not comma or not DATA_URI_HEAD.fullmatch(head):
        raise _Refused(422, f"{where}: must be a base64 data URI of a PNG, JPEG or DICOM "
                            "file (data:image/png;base64,...; image/jpeg, "
                            "application/dicom): the server fetches no URL", _param(where))
    return url[len(head) + 1:]


def _content_question(detail: str) -> str:
    """A question's refusal as this route's: it has no `question` field; its text parts,
    joined, are the question."""
    if not detail.startswith("question "):
        return detail
    return f"{CONTENT}: the question (its text parts, joined) {detail[len('question '):]}"


async def _item(request: Request, serving: Serving) -> AnswerItem:
    """The answer job, checked as `/answer` checks its JSON body."""
    # off the event loop, as /answer's body: a 30 MB body of escapes held the loop 383 ms
    body = await run_in_threadpool(_parse, await request.body())
    if body.stream:
        raise _Refused(422, "stream: streaming is not supported; the answer and its "
                            "confidence come in one response", "stream")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        # one of the two, as the document says (JSON Schema cannot say "equal")
        raise _Refused(422, "send max_tokens or max_completion_tokens, not both",
                       "max_completion_tokens")
    asked = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    texts, b64, where = _question_and_image(body)
    try:
        question = serving.chat_question(texts)
    except InvalidInput as e:
        # one text part's refusal names it (its length), the joined question's the content
        part = next((w for w, _ in texts if e.detail.startswith(f"{w}: ")), CONTENT)
        raise _Refused(e.status, _content_question(e.detail), _param(part)) from None
    limit = serving.max_new_tokens(asked)
    try:
        image = await serving.image_b64(b64, where)
    except (InvalidInput, ImageInvalid, ImageTooLarge) as e:
        raise _Refused(status_of(e), detail_of(e), _param(where)) from None
    return AnswerItem(image, question, limit)


# ---------------------------------------------------------------------------- route
router = APIRouter(tags=["openai"], dependencies=[Depends(require_key)])


def _inlined(schema: dict) -> dict:
    """A model's JSON schema with its `$defs` written in place (the OpenAPI document
    resolves `#/$defs/...` from its own root, where they are not). A discriminator goes
    too: its mapping names those `$defs`, and each part's `type` (a const) already tells
    the parts apart."""
    defs = schema.pop("$defs", {})

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                return walk(defs[x["$ref"].rsplit("/", 1)[-1]])
            return {k: walk(v) for k, v in x.items() if k != "discriminator"}
        return [walk(v) for v in x] if isinstance(x, list) else x
    return walk(schema)


BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inlined(ChatRequest.model_json_schema())}}}}


@router.post(PATH, response_model=ChatCompletion, responses=ERRORS, openapi_extra=BODY,
             dependencies=[Depends(require_json)])
async def chat_completions(request: Request, serving: Serving = Depends(get_serving)
                           ) -> ChatCompletion | JSONResponse:
    """OpenAI's chat completion for one image and its question; DualRead's confidence and
    defer flag in `dualread`."""
    serving.admit(request)
    rid = request_id(request)
    try:
        item = await _item(request, serving)
    except _Refused as e:
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status,
                            headers={REQUEST_ID: rid})
    [served] = await serving.answer([item], request_id=rid, gone=request.is_disconnected)
    request.scope["state"]["batch_size"] = served.batch
    res = response(serving, rid, served.result, served.queued_s)
    return ChatCompletion(id=f"chatcmpl-{rid}", created=int(time.time()), model=MODEL_ID,
                          choices=[Choice(message=AssistantMessage(content=res.answer),
                                          finish_reason="length" if DeferCode.truncated
                                          in res.defer_reasons else "stop")],
                          dualread=res)


def model_list() -> dict:
    """OpenAI's `GET /v1/models` fields, for the route that already answers there."""
    return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
                                        "owned_by": "dualread"}]}


# ---------------------------------------------------------------------------- errors
class OpenAIErrors:
    """Every error answered on `PATH`, in OpenAI's shape: the service's own
    `{"detail", "request_id"}` (from the middleware's pre-checks, auth, the queue, the
    deadline) is rewritten; `_Refused` becomes it directly, with its `param`. The request
    id stays in the `x-request-id` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != PATH:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    await send(message)
                else:
                    start = message          # held until the body is whole
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = openai_error(start["status"], b"".join(chunks))
            headers = MutableHeaders(scope=start)
            headers["content-length"] = str(len(body))
            headers["content-type"] = "application/json"
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def openai_error(status: int, body: bytes) -> bytes:
    """An error body of the service's shape in OpenAI's (one already in it is kept)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return body                                   # already in this shape
    detail = doc.get("detail") if isinstance(doc, dict) else None
    message = detail if isinstance(detail, str) else "error"
    # compact, as the route's own errors (starlette's JSONResponse) are written
    return json.dumps(error_body(status, message), ensure_ascii=False,
                      separators=(",", ":")).encode()
