"""Typed errors and the one mapping from exception to HTTP status.

Every error leaves the service as JSON `{"detail": str, "request_id": str}` with the
`x-request-id` header. Details are written here or by the validators: they never quote the
request (image bytes, question text and field values may be patient data).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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


def explain(errors: list[dict]) -> str:
    """Validation errors as one line: where and what, never the offending value."""
    parts = []
    for err in errors[:10]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden":
            # The unknown key itself is client text (it could carry an identifier).
            where = ".".join(loc[:-1]) if len(loc) > 1 else "body"
            parts.append(f"{where}: unexpected field")
            continue
        where = ".".join(x if _IDENT.match(x) or x.isdigit() else "(field)" for x in loc)
        msg = err.get("msg", "invalid")
        if err.get("type") == "string_pattern_mismatch" and \
                err.get("ctx", {}).get("pattern") == B64_PATTERN:
            msg = B64_HELP           # the pattern itself tells a client little
        elif err.get("type") == "string_too_short" and err.get("input") == "":
            msg = "empty"
        elif err.get("type") == "union_tag_invalid":
            # pydantic's message quotes the tag sent, which is client text
            ctx = err.get("ctx", {})
            msg = (f"the tag found using {ctx.get('discriminator', 'its discriminator')} is "
                   f"none of the expected tags: {ctx.get('expected_tags', '')}")
        if err.get("type") == "json_invalid":
            where, msg = "body", "not valid JSON"      # loc holds a byte offset
        parts.append(f"{where or 'body'}: {msg}")
    return "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    """Register the mapping: every error the app can raise becomes the same JSON shape."""

    async def on_service(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, exc)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        return error_response(exc.status_code, detail, request_id_of(request),
                              dict(exc.headers or {}))

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, explain(list(exc.errors())), request_id_of(request))

    for kind in (ServiceError, *FOREIGN):
        app.add_exception_handler(kind, on_service)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
