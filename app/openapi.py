"""The OpenAPI document as this service, with its settings, serves it.

FastAPI builds the document from the routes and the pydantic models (`clients.schemas`,
the one definition of every field's constraints); this adds what depends on the settings:
- the limits that are settings (`x-limit` fields get the configured `maxLength` or
  `maxItems`);
- security only when an API key is configured, on the operations that check it, with
  their 401 (in the shape of the operation's other errors: OpenAI's on the OpenAI route);
  without a key no operation declares it (the server asks for none).
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
    # a question is read up to 4× its limit (the backend refuses it when, once invisible
    # characters are dropped, it is still over the limit: `Service.check_question`)
    return {"question": 4 * settings.max_question_chars,
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


def build(app: FastAPI, settings: Settings) -> dict:
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
            else:
                del op["security"]
    if not keyed:
        components = doc.get("components", {})
        components.pop("securitySchemes", None)
    return doc


def install(app: FastAPI, settings: Settings) -> None:
    """Serve `build`'s document as `app.openapi()` (built once, on first use)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, settings)
        return app.openapi_schema

    app.openapi = openapi
