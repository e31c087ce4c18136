"""Typed errors and the one mapping from exception to HTTP status.

Every error leaves the service as JSON `{"detail": str, "request_id": str}` with the
`x-request-id` header. Details are written here or by the validators: they never quote the
request (image bytes, question text and field values may be patient data).
"""

from __future__ import annotations

import functools
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException

from clients.schemas import B64_PATTERN
from heads.dualread import FingerprintMismatch
from models.images import ImageInvalid, ImageTooLarge

log = logging.getLogger("dualread.errors")
REQUEST_ID = "x-request-id"


class ServiceError(Exception):
    """Base of the service's own errors; `status` is the HTTP status it maps to."""

    status = 500
    headers: dict[str, str] = {}

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidInput(ServiceError):
    status = 422


class QuestionInvalid(InvalidInput):
    pass


class TrajectoryInvalid(InvalidInput):
    pass


class UnsupportedMediaType(ServiceError):
    status = 415


class BodyTooLarge(ServiceError):
    status = 413


class Unauthorized(ServiceError):
    status = 401
    headers = {"WWW-Authenticate": "Bearer"}

    def __init__(self, detail: str = "missing or invalid credentials") -> None:
        super().__init__(detail)


class WrongOperatorKey(Unauthorized):
    """A wrong `X-Operator-Key`: its challenge names that header, not the API key's
    Bearer scheme (the client's API key may well be right)."""

    headers = {"WWW-Authenticate": 'OperatorKey header="X-Operator-Key"'}

    def __init__(self) -> None:
        super().__init__("wrong operator key")


class RepeatedHeader(ServiceError):
    """Two credential headers of one name: refused rather than one picked, so that what a
    proxy appends never decides which key is checked."""

    status = 400

    def __init__(self, name: str) -> None:
        super().__init__(f"send one {name} header, not several")


class QueueFull(ServiceError):
    status = 429
    headers = {"Retry-After": "1"}

    def __init__(self, detail: str = "queue full, retry shortly") -> None:
        super().__init__(detail)


class TooManyItems(ServiceError):
    """More jobs in one request than the queue can ever hold: a 429 would be retried
    forever."""
    status = 413


class NotReady(ServiceError):
    status = 503


class ShuttingDown(NotReady):
    def __init__(self, detail: str = "shutting down") -> None:
        super().__init__(detail)


class NoHeads(ServiceError):
    """Answer-only mode (`heads_mismatch`): no heads, so no confidence to compute."""

    status = 503

    def __init__(self, detail: str = "no heads for this model: the service runs answer-only "
                                     "(heads_mismatch), so it computes no confidence") -> None:
        super().__init__(detail)


class DeadlineExceeded(ServiceError):
    status = 504


class ClientGone(ServiceError):
    """The client closed the connection before its answer was ready (nginx's 499; nobody
    receives it, but logs and metrics count it)."""

    status = 499

    def __init__(self, detail: str = "client closed the connection") -> None:
        super().__init__(detail)


class ModelFailure(ServiceError):
    """The model raised on this item (alone): a server-side fault, reported without a trace."""

    status = 500


class EngineError(ServiceError):
    """The batch loop broke its own contract (e.g. a handler returned the wrong count)."""

    status = 500


# Exceptions from outside app/ that have a fixed meaning for a client.
FOREIGN = {ImageTooLarge: 413, ImageInvalid: 422, FingerprintMismatch: 503}


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ServiceError):
        return exc.status
    for kind, status in FOREIGN.items():
        if isinstance(exc, kind):
            return status
    return 500


def detail_of(exc: BaseException) -> str:
    if isinstance(exc, ServiceError):
        return exc.detail
    if status_of(exc) < 500 or isinstance(exc, FingerprintMismatch):
        return str(exc)
    return "internal error"


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def error_response(status: int, detail: str, request_id: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "request_id": request_id}, status_code=status,
                        headers={**(headers or {}), REQUEST_ID: request_id})


def respond(request: Request, exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    if status >= 500 and not isinstance(exc, ServiceError | FingerprintMismatch):
        log.error("unhandled %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
    headers = exc.headers if isinstance(exc, ServiceError) else None
    return error_response(status, detail_of(exc), request_id_of(request), headers)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")
B64_HELP = ("not valid base64 (standard alphabet, padded to a multiple of 4, one line; use "
            "`base64 < file | tr -d '\\n'`)")
# pydantic's names for the choices of a union, which it puts in an error's location
# (`str`, `constrained-str`, `literal['blank']`, `tuple[...]`, a model's class name)
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "bytes",
                         "none"})
_NO_BODY = object()
# A value of the wrong type, said plainly (what it must be); in a union, one per choice.
_KINDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
          "bool_type": "true or false", "bool_parsing": "true or false",
          "list_type": "an array", "tuple_type": "an array", "iterable_type": "an array",
          "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object", "is_instance_of": "an object",
          "image_type": "a base64 string of a PNG, JPEG or DICOM file"}
# The service's own errors (`clients.schemas`): their messages are written there.
_OWN = frozenset({"integer_range", "number_range", "image_type"})
# Every other error pydantic can report on a request, in the service's words: pydantic's
# own quote the value or its types ("Tuple should have at most 2 items after validation,
# not 3", "Unable to extract tag using discriminator 'type'"). Those the request models
# can raise are listed here (a test walks the models for the rest); one not listed is
# answered "invalid value" and logged by type.
_PLAIN = {
    "missing": "required",
    "string_too_short": "must have at least {min_length} {characters}",
    "string_too_long": "must have at most {max_length} {characters}",
    "string_pattern_mismatch": "is not in the accepted form",
    "string_unicode": "must be valid Unicode text",
    "too_short": "must have at least {min_length} {items}",
    "too_long": "must have at most {max_length} {items}",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
    "greater_than": "must be over {gt}",
    "less_than": "must be under {lt}",
    "finite_number": "must be a finite number",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "json_invalid": "not valid JSON",
    "json_type": "not valid JSON",
    "extra_forbidden": "unexpected field",
    "literal_error": "must be {expected}",
    "union_tag_invalid": "must be {expected_tags}",
    "union_tag_not_found": "required",
    "value_error": "invalid value",
    "assertion_error": "invalid value",
    "recursion_loop": "nested too deeply",
}


def _is_tag(node: object, x: str, unions: dict[str, frozenset[str]]) -> bool:
    """Whether `x`, in an error's location at `node`, is the tag pydantic names a
    discriminated union's choice by: the value of the object's discriminator (`{"type":
    "text", "text": ...}` is at `...text.text`), read off the model's unions (`_unions`),
    never guessed from the body's other values. Exact while a union's choices are used in
    it alone (as in every request model): an object elsewhere with the discriminator and
    a field named as its value would have that field read as a tag."""
    return isinstance(node, dict) and any(
        node.get(field) == x for field, tags in unions.items() if x in tags)


def _path(err: dict, body: object, unions: dict[str, frozenset[str]]
          ) -> tuple[list[str], int | None]:
    """The error's location as the client's field names and list indexes, and where in it
    a union's choice was (None: no union): pydantic's location also names the union's
    choices (`mask.target.literal['think',...]`, `content.str`), which are no field of the
    request. With the body, a key is a field when the object there has it and it is not
    the object's tag (`unions`: the request model's discriminators and their tags);
    without, a name that is not a plain lower-case identifier is a choice."""
    loc = list(err.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]                     # FastAPI's prefix for the request body
    missing = err.get("type") in ("missing", "union_tag_not_found")
    out: list[str] = []
    union = None
    node = body
    tagged = None         # the object whose tag the location named last
    for k, x in enumerate(loc):
        rest = loc[k + 1:]
        if isinstance(x, int):
            out.append(str(x))
            node = node[x] if isinstance(node, list) and -len(node) <= x < len(node) \
                else _NO_BODY
            continue
        if node is not _NO_BODY:
            # one tag per object: after it, a name is the object's field, even when the
            # field is named as a tag is (`image_url` of an image_url part)
            if isinstance(node, dict) and x in node and (
                    node is tagged or not _is_tag(node, x, unions)):
                out.append(str(x))
                node = node[x]
                continue
            if isinstance(node, dict) and x in node:
                tagged = node
            if not rest and missing and isinstance(node, dict):
                out.append(str(x))            # a field the object lacks
                continue
        elif x.islower() and _IDENT.match(x) and x not in _TYPE_NAMES:
            out.append(x)
            continue
        if union is None:
            union = len(out)
    return out, union


def _or(choices: str) -> str:
    """pydantic's list of choices ("'text', 'image_url'") as "'text' or 'image_url'"."""
    head, comma, last = choices.rpartition(", ")
    return f"{head} or {last}" if comma and " or " not in choices else choices


def _message(err: dict) -> str:
    """What is wrong, in the service's words: never pydantic's message (`_PLAIN`), which
    may quote the value, but the service's own errors' (`_OWN`)."""
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind in _OWN:
        return err.get("msg", "invalid value")
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == B64_PATTERN:
        return B64_HELP           # the pattern itself tells a client little
    if kind == "string_too_short" and err.get("input") == "":
        return "empty"
    if kind in _KINDS:
        return f"must be {_KINDS[kind]}"
    if kind not in _PLAIN:
        log.warning("validation error of a type without a message: %s", kind)
        return "invalid value"
    # ctx holds the rule (bounds, the expected tags), never the value sent: for a union's
    # tag, pydantic's message quotes the tag sent, which is client text
    words = {k: _or(str(v)) if k in ("expected", "expected_tags") else v
             for k, v in ctx.items()}
    one = [ctx.get("min_length", ctx.get("max_length"))] == [1]
    words.update(items="item" if one else "items", characters="character" if one else
                 "characters")
    try:
        return _PLAIN[kind].format(**words)
    except (KeyError, IndexError, ValueError):   # a rule without its bound: none claimed
        return "invalid value"


def _kind(err: dict) -> str | None:
    """What a value of the wrong type must be, or None for another kind of error."""
    if err.get("type") == "literal_error":
        return str(err.get("ctx", {}).get("expected", "")) or None
    return _KINDS.get(err.get("type", ""))


Where = tuple[str, ...]      # a field's path in the request: names and list indexes


def explain(errors: list[dict], body: object = _NO_BODY,
            model: type[BaseModel] | None = None) -> str:
    """Validation errors as one line: where (the request's own field names) and what, in
    plain words, never the offending value. `body`: the parsed request, when there is one,
    to tell its fields from pydantic's names for a union's choices; `model`: what it was
    validated as, whose discriminated unions' tags pydantic's location holds too.

    A union's choices each report an error; only those of a choice the value's type fits
    are kept (`[0, 1.5]` as a span: its second item, not "should be 'think'"), and when
    none fits, one line says what it must be."""
    return joined(explained(errors, body, model))


def _line(where: Where, what: str) -> str:
    return f"{'.'.join(where) or 'body'}: {what}"


# pydantic's JSON parser's words for a \u escape of half a surrogate pair
_SURROGATE = re.compile(r"surrogate|end of hex escape")


def joined(parts: list[tuple[Where, str]]) -> str:
    """`explained`'s parts as `explain`'s one line."""
    return "; ".join(_line(where, what) for where, what in parts) or "invalid request"


def explained(errors: list[dict], body: object = _NO_BODY,
              model: type[BaseModel] | None = None) -> list[tuple[Where, str]]:
    """`explain`'s parts, each (where, what), in order and once each: a route that names
    the field apart (OpenAI's `param`) takes the first's path."""
    # (path, union site or None, message, what a wrong type must be)
    read: list[tuple[list[str], tuple[str, ...] | None, str, str | None]] = []
    unions = {} if model is None else _unions(model)
    for err in errors[:10]:
        if err.get("type") == "json_invalid":
            # loc holds a byte offset; a lone surrogate is refused here by the JSON parser
            # (the probe routes' parser reads it, then its field says "must be valid
            # Unicode text"): the same words, that the client may find it
            why = str((err.get("ctx") or {}).get("error", ""))
            read.append(([], None, "not valid JSON: a \\u escape that is not valid Unicode "
                                   "text (a lone surrogate)" if _SURROGATE.search(why)
                         else "not valid JSON", None))
            continue
        if err.get("type") == "extra_forbidden":
            # The unknown key itself is client text (it could carry an identifier); the
            # path is read without it, as the object's
            path, union = _path({**err, "loc": tuple(err.get("loc", ()))[:-1]}, body,
                                unions)
            site = None if union is None else tuple(path[:union])
            read.append((path, site, "unexpected field", None))
        else:
            if err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
                # about the field that names the object's kind (`type`), not the object
                name = str((err.get("ctx") or {}).get("discriminator", "")).strip("'")
                if _IDENT.match(name):
                    err = {**err, "loc": (*err.get("loc", ()), name)}
            path, union = _path(err, body, unions)
            site = None if union is None else tuple(path[:union])
            read.append((path, site, _message(err), _kind(err)))
    parts: list[tuple[Where, str]] = []
    for site in dict.fromkeys(r[1] for r in read):
        here = [r for r in read if r[1] == site]
        if site is not None:
            # errors below the union's own level, or not about the value's type: the
            # choices whose type the value has
            fits = [r for r in here if len(r[0]) > len(site) or r[3] is None]
            if not fits:
                kinds = [str(r[3]) for r in here]
                kinds = list(dict.fromkeys(kinds))
                # "'blank' or a base64 string", "'think', 'answer' or 'response', or an array"
                said = (", or " if any(" or " in k for k in kinds[:-1]) else " or ").join(
                    [", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
                parts.append((site, f"must be {said}"))
                continue
            here = fits
        parts += [(tuple(path), msg) for path, _, msg, _ in here]
    once: dict[str, tuple[Where, str]] = {}
    for part in parts:
        once.setdefault(_line(*part), part)
    return list(once.values())


@functools.cache
def _unions(model: type[BaseModel]) -> dict[str, frozenset[str]]:
    """The discriminated unions of `model`, as each discriminator field and its tags:
    pydantic names a choice by its tag in an error's location, where it reads as a field
    name (`content.1.text.text`)."""
    found: dict[str, set[str]] = {}
    todo: list[object] = [model.__pydantic_core_schema__]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            field = x.get("discriminator")
            if x.get("type") == "tagged-union" and isinstance(field, str):
                found.setdefault(field, set()).update(
                    k for k in x.get("choices", {}) if isinstance(k, str))
            todo.extend(x.values())
        elif isinstance(x, list | tuple):
            todo.extend(x)
    return {field: frozenset(tags) for field, tags in found.items()}


def _tags(model: type[BaseModel]) -> frozenset[str]:
    """Every tag of `model`'s discriminated unions."""
    return frozenset().union(*_unions(model).values())


def explain_json(errors: list[dict], raw: bytes, model: type[BaseModel]) -> str:
    """`explain` for a body pydantic read from JSON itself (as `model`)."""
    return joined(explained_json(errors, raw, model))


def explained_json(errors: list[dict], raw: bytes, model: type[BaseModel]
                   ) -> list[tuple[Where, str]]:
    """`explained` for a body pydantic read from JSON itself (as `model`): the body is parsed
    again for its field names only when an error's location holds a tag of one of the
    model's discriminated unions, the one name that the location alone cannot tell from a
    field. Parsing holds the GIL, off the event loop or not: a refused 30 MB body read
    twice held every other request twice as long."""
    tags = _tags(model)
    if not any(isinstance(x, str) and x in tags for err in errors[:10]
               for x in err.get("loc", ())):
        return explained(errors)
    try:
        body = from_json(raw)            # pydantic's own parser: as fast as the first read
    except ValueError:
        body = _NO_BODY
    return explained(errors, body, model)


def _body_model(request: Request) -> type[BaseModel] | None:
    """The model the matched route validates its body as (None: no such route or model)."""
    field = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def install(app: FastAPI) -> None:
    """Register the mapping: every error the app can raise becomes the same JSON shape."""

    async def on_service(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, exc)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        return error_response(exc.status_code, detail, request_id_of(request),
                              dict(exc.headers or {}))

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, explain(list(exc.errors()), exc.body, _body_model(request)),
                              request_id_of(request))

    for kind in (ServiceError, *FOREIGN):
        app.add_exception_handler(kind, on_service)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
