"""Pieces the routers share: the documented error responses, the confidence object."""

from __future__ import annotations

import dataclasses

from app.schemas import Confidence, ErrorResponse
from app.serving import Confidences

# What each error status means in this service; every one has the one error shape
# (`ErrorResponse`). 401 is not listed on routes: the document adds it to exactly the
# operations that need the API key, when one is configured (`app.openapi`).
ERROR_MEANINGS: dict[int, str] = {
    400: "the body cannot be parsed (not UTF-8, or a malformed multipart body) or framed "
         "(Content-Length with Transfer-Encoding, a broken chunked body), its content type "
         "is too long, or a credential header (Authorization, X-Operator-Key) is sent twice",
    401: "missing or wrong API key",
    408: "the request body did not arrive within the body timeout (retry: Retry-After)",
    413: "the body, an image's bytes or its pixels are over the service's limits, or a "
         "request holds more jobs than the queue can",
    415: "the body is not sent with a media type this route reads",
    422: "the request is not valid: its fields, an image that does not decode, a question "
         "or trajectory the model cannot take (see `detail`)",
    429: "the queue is full (retry: Retry-After)",
    500: "internal error (never a trace)",
    503: "the model is not loaded yet, failed to load, or the service is shutting down",
    504: "no result within the request deadline",
}
# Headers sent with a status, every time.
ERROR_HEADERS: dict[int, dict[str, str]] = {
    401: {"WWW-Authenticate": "Bearer"},
    408: {"Retry-After": "seconds to wait before retrying"},
    429: {"Retry-After": "seconds to wait before retrying"},
}

# What the middleware refuses before routing, on any POST (framing, a slow or oversized body,
# a JSON body over the pre-check's bounds); a route that reads a body; a route that runs
# the model.
PRE_ROUTING_ERRORS = (400, 408, 413, 422)
BODY_ERRORS = (*PRE_ROUTING_ERRORS, 415, 500)
MODEL_ERRORS = (429, 500, 503, 504)


def error_responses(*codes: int) -> dict[int | str, dict]:
    """A route's `responses=`: each status with its meaning and the error shape."""
    out: dict[int | str, dict] = {}
    for code in sorted(set(codes)):
        entry: dict = {"model": ErrorResponse, "description": ERROR_MEANINGS[code]}
        if code in ERROR_HEADERS:
            entry["headers"] = {name: {"description": text, "schema": {"type": "string"}}
                                for name, text in ERROR_HEADERS[code].items()}
        out[code] = entry
    return out


# A JSON route that runs the model (the probes)
ERRORS = error_responses(*BODY_ERRORS, *MODEL_ERRORS)


def confidence(c: Confidences) -> Confidence:
    # the served fields are one list (clients.schemas.SERVED_CONFIDENCES)
    return Confidence(**dataclasses.asdict(c))
