"""The OpenAPI document as this service, with its settings, serves it.

FastAPI builds the document from the routes and the pydantic models (`clients.schemas`,
the one definition of every field's constraints); this adds what depends on the settings:
- the limits that are settings (`x-limit` fields get the configured `maxLength` or
  `maxItems`);
- security only when an API key is configured, on the operations that check it, with
  their 401 (in the shape of the operation's other errors: OpenAI's on the OpenAI route);
  without a key no operation declares it (the server asks for none);
- the operator key, when one is configured: required on the operator routes (served only
  then) with their 401, 403, 404 and 409, optional on /feedback and GET /calibration.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.routers.common import error_responses
from app.routers.openai import DATA_URI_HEAD_CHARS
from app.serving import b64_limit
from app.settings import Settings
from clients.schemas import LIMIT

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def limits(settings: Settings) -> dict[str, int]:
    """`maxLength` of each `x-limit` kind under these settings."""
    # a question's length as sent (`Service.check_question`; on the OpenAI route each
    # text part's)
    return {"question": settings.max_question_chars,
            "image": b64_limit(settings.max_image_bytes),
            # an image as a data URI (the OpenAI route): the longest head, then its base64
            "data_uri": DATA_URI_HEAD_CHARS + b64_limit(settings.max_image_bytes),
            # a batch of trajectories is that many jobs, admitted together (413 above)
            "jobs": settings.queue_limit}


def _set_limits(node: Any, values: dict[str, int]) -> None:
    if isinstance(node, dict):
        kind = node.pop(LIMIT, None)
        if kind is not None:
            key = "maxItems" if node.get("type") == "array" else "maxLength"
            node[key] = min(node.get(key, values[kind]), values[kind])
        for v in node.values():
            _set_limits(v, values)
    elif isinstance(node, list):
        for v in node:
            _set_limits(v, values)


def _unauthorized(op: dict) -> dict:
    """The 401 response object, in the error shape of the operation's other errors (the
    service's `ErrorResponse`; OpenAI's on the route that answers in it)."""
    entry = error_responses(401)[401]
    schema = next((r["content"]["application/json"]["schema"]
                   for code, r in sorted(op["responses"].items())
                   if code.startswith(("4", "5")) and "application/json" in r.get("content", {})),
                  {"$ref": "#/components/schemas/ErrorResponse"})
    return {"description": entry["description"], "headers": entry["headers"],
            "content": {"application/json": {"schema": copy.deepcopy(schema)}}}


# The operator key (`operator_key`): the operator routes need it; /feedback reads it when
# sent (an operator's verdict also counts toward re-certification).
OPERATOR = "OperatorKey"
OPERATOR_SCHEME = {"type": "apiKey", "in": "header", "name": "X-Operator-Key",
                   "description": "the operator key, when the service has one: required by "
                                  "/calibration/pin, /unpin, /rollback and /window/reset "
                                  "(403 without it, "
                                  "401 when wrong); optional on /feedback, where an "
                                  "operator's verdict also counts toward re-certifying the "
                                  "defer rule (401 when wrong), and on GET /calibration, "
                                  "which shows an operator more (401 when wrong)"}
# routes that read the operator key when it is sent (a wrong one is a 401 there too)
OPERATOR_OPTIONAL = {("post", "/feedback"), ("get", "/calibration")}
OPERATOR_ERRORS = {401: "missing or wrong API key, or a wrong operator key",
                   403: "no operator key (X-Operator-Key) sent"}
# what else an operator route answers
NO_STORE = ("this service holds no rule store (answer-only heads, or its state file "
            "unusable; the detail says which): retrying will not help")
OPERATOR_OUTCOMES = {("post", "/calibration/pin"): {
                         404: "no kept rule has that version (GET /calibration lists them)",
                         409: NO_STORE},
                     ("post", "/calibration/unpin"): {409: NO_STORE},
                     ("post", "/calibration/window/reset"): {409: NO_STORE},
                     ("post", "/calibration/rollback"): {
                         409: "nothing to roll back to: shipped is the only rule in the "
                              "chain; or " + NO_STORE}}


REPEATED = "a credential header (Authorization, X-Operator-Key) is sent twice"
# where a wrong operator key is a 401 too, its challenge names that key's header
OPERATOR_CHALLENGE = ('Bearer (a missing or wrong API key); OperatorKey header="X-Operator-Key" '
                      '(a wrong operator key)')


def _error(op: dict, code: int, description: str) -> dict:
    """An error response of `op`: `description`, in the shape of its other errors."""
    entry = _unauthorized(op)
    if code != 401:
        entry.pop("headers")
    else:
        entry["headers"] = {"WWW-Authenticate": {"description": OPERATOR_CHALLENGE,
                                                 "schema": {"type": "string"}}}
    return {**entry, "description": description}


def _operator_security(doc: dict, paths: set[str], keyed: bool) -> None:
    """Declare the operator key: required on the operator routes, optional on /feedback
    and GET /calibration, with the statuses it brings."""
    bearer = {"HTTPBearer": []} if keyed else {}
    for path, item in doc.get("paths", {}).items():
        for method in METHODS:
            op = item.get(method)
            if op is None:
                continue
            if path in paths or (method, path) in OPERATOR_OPTIONAL:
                # the operator key's header sent twice (app.deps.one_header)
                op["responses"].setdefault("400", _error(op, 400, REPEATED))
            if path in paths:
                op["security"] = [{**bearer, OPERATOR: []}]
                for code, text in {**OPERATOR_ERRORS,
                                   **OPERATOR_OUTCOMES.get((method, path), {})}.items():
                    op["responses"][str(code)] = _error(op, code, text)
            elif (method, path) in OPERATOR_OPTIONAL:
                op["security"] = [bearer, {**bearer, OPERATOR: []}]
                op["responses"]["401"] = _error(op, 401, OPERATOR_ERRORS[401])
    doc.setdefault("components", {}).setdefault("securitySchemes", {})[OPERATOR] = \
        OPERATOR_SCHEME


def build(app: FastAPI, settings: Settings, operator_paths: set[str] = frozenset()) -> dict:
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    _set_limits(doc, limits(settings))
    keyed = bool(settings.api_key)
    for item in doc.get("paths", {}).values():
        for method in METHODS:
            op = item.get(method)
            if op is None or "security" not in op:
                continue
            if keyed:
                op["responses"]["401"] = _unauthorized(op)
                # the key's header sent twice (app.deps.one_header), on routes without a body
                op["responses"].setdefault("400", _error(op, 400, REPEATED))
            else:
                del op["security"]
    if not keyed:
        components = doc.get("components", {})
        components.pop("securitySchemes", None)
    if settings.operator_key:
        _operator_security(doc, set(operator_paths), keyed)
    return doc


def install(app: FastAPI, settings: Settings, operator_paths: set[str] = frozenset()
            ) -> None:
    """Serve `build`'s document as `app.openapi()` (built once, on first use);
    `operator_paths` are the routes that need the operator key."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, settings, operator_paths)
        return app.openapi_schema

    app.openapi = openapi
