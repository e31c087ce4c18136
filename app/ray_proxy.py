"""Runs inside Ray Serve's HTTP proxy (kept free of the model's imports).

Two differences of Serve's proxy from the service's contract, undone here:
- the proxy appends its own `x-request-id` after the service's: the first is kept (the id
  in the JSON body, the one `/feedback` takes);
- a request whose replica died under it ends with no response, which the server turns
  into a plain-text 500; here it becomes the service's JSON 503 with `Retry-After`, which
  clients retry (another replica answers).

Serve reads the callback's import path from the environment of the Ray node
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, see `PROXY_ENV`) when its proxy starts.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.middleware import Middleware

REQUEST_ID = b"x-request-id"
PROXY_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "app.ray_proxy.middlewares"}


def _one_request_id(headers: list) -> list:
    out, seen = [], False
    for k, v in headers:
        if k.lower() == REQUEST_ID:
            if seen:
                continue
            seen = True
        out.append((k, v))
    return out


class ServiceContract:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_checked(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = _one_request_id(list(message.get("headers", [])))
            await send(message)

        await self.app(scope, receive, send_checked)
        if not started:
            rid = uuid.uuid4().hex
            body = json.dumps({"detail": "the replica serving this request stopped; retry",
                               "request_id": rid}).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", b"1"),
                (REQUEST_ID, rid.encode()), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def middlewares() -> list[Middleware]:
    """What Serve's proxy wraps around its own middleware."""
    return [Middleware(ServiceContract)]
