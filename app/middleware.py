"""Per-request context as plain ASGI: request id, body limit, access log, metrics, and a
JSON 500 for anything unexpected (never a plain-text trace, never a dropped connection)."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from fastapi import HTTPException
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import REQUEST_ID, error_response
from app.metrics import Metrics

log = logging.getLogger("dualread.access")
CORRELATION_ID = "x-correlation-id"
# A client's own id is kept only as a bounded, plain correlation id: echoed back, never
# logged (it may carry anything), never a key for feedback.
CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int,
                 draining: Callable[[], bool]) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body_bytes
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex
        headers = Headers(scope=scope)
        client_id = headers.get(REQUEST_ID, "")
        correlation = client_id if CLIENT_ID.match(client_id) else None
        state = scope.setdefault("state", {})
        state.update(request_id=rid, late=self.draining(), batch_size=None)
        t0 = time.perf_counter()
        status = 500
        started = False

        async def send_with_ids(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                h = MutableHeaders(scope=message)
                h[REQUEST_ID] = rid
                if correlation:
                    h[CORRELATION_ID] = correlation
            await send(message)

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise HTTPException(413, f"body over the limit of {self.max_body} bytes")
            return message

        try:
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                # refused before a byte of the body is read
                await error_response(413, f"body over the limit of {self.max_body} bytes",
                                     rid)(scope, receive, send_with_ids)
            else:
                await self.app(scope, limited_receive, send_with_ids)
        except Exception as e:
            log.error(json.dumps({"request_id": rid, "event": "unhandled",
                                  "error": type(e).__name__}))
            if not started:
                await error_response(500, "internal error", rid)(scope, receive,
                                                                 send_with_ids)
        finally:
            took = time.perf_counter() - t0
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.request_duration.labels(route).observe(took)
            self.metrics.requests.labels(route, str(status)).inc()
            # Never image bytes, question text or the client's own id: patient data.
            log.info(json.dumps({"request_id": rid, "route": route,
                                 "method": scope.get("method"), "status": status,
                                 "latency_ms": round(took * 1000, 2),
                                 "batch_size": state.get("batch_size")}))
