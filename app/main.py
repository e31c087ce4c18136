"""The ASGI app: wiring only (settings, serving layer, routers, middleware, error mapping).

Routes live in `app/routers/`, typed jobs and results in `app/serving.py`, the model side
in `app/service.py`, the one exception → status mapping in `app/errors.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import errors, openapi
from app.logs import JsonLines
from app.metrics import Metrics
from app.middleware import OriginForm, RequestContext, body_paths
from app.recertify import DriftCollector, RecertHooks, Recertification
from app.routers import answer, calibration, openai, ops, probes
from app.service import Service
from app.serving import Serving
from app.settings import Settings
from heads.monitor import FeedbackMonitor
from models.images import log_warnings

log = logging.getLogger("dualread.access")
DESCRIPTION = ("Visual question answering with a frozen VLM and DualRead confidence: answer, "
               "defer flag, probes, feedback, metrics. Errors are JSON "
               '`{"detail": str, "request_id": str}`.')


# the multipart parser warns of each body it cannot read (the 400 says it too): without a
# handler of its own Python's last resort printed those warnings as plain lines
LIBRARY_LOGGERS = {"python_multipart": logging.WARNING}


def _json_logging() -> None:
    levels = {**dict.fromkeys(("dualread.access", "dualread.errors", "dualread.service",
                               "dualread.audit", "dualread.engine"), logging.INFO),
              **LIBRARY_LOGGERS}
    for name, level in levels.items():
        lg = logging.getLogger(name)
        if not lg.handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(JsonLines())
            lg.addHandler(h)
            lg.setLevel(level)
            lg.propagate = False


def create_app(settings: Settings | None = None, service: Service | None = None) -> FastAPI:
    """The ASGI app. With `service`, use it (tests); otherwise load in the background so
    liveness answers at once and readiness turns 200 when the model is in memory."""
    settings = settings or Settings()
    _json_logging()
    # decoder warnings quote the file: into the JSON log, without their text
    log_warnings(logging.getLogger("dualread.service"))
    monitor = FeedbackMonitor(settings.feedback_window)
    metrics = Metrics(monitor)
    recert = Recertification(settings)
    hooks = RecertHooks(metrics, monitor, recert.drift)
    metrics.registry.register(DriftCollector(recert))
    serving = Serving(settings, hooks, hooks)

    def attach(svc) -> None:
        recert.attach(svc)         # a persisted rule is restored before the first answer
        serving.attach(svc)
        metrics.model_info.info(svc.info())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service is not None:
            attach(service)
        else:
            loop = asyncio.get_running_loop()

            async def load() -> None:
                try:
                    svc = await loop.run_in_executor(None, lambda: Service(
                        settings.actor, settings.heads, settings.device, settings.dtype,
                        settings.heads_mismatch))
                    attach(svc)
                except Exception as e:  # readiness stays 503 and says why
                    serving.load_error = f"{type(e).__name__}: {e}"
                    log.error(json.dumps({"event": "load_failed", "error": serving.load_error}))

            loop.create_task(load())
        yield
        await serving.stop()
        recert.close()
        if service is None and serving.backend is not None:     # the one it loaded itself
            getattr(serving.backend, "close", lambda: None)()

    app = FastAPI(title="dualread", version="0.1.0", lifespan=lifespan,
                  description=DESCRIPTION, docs_url=None, redoc_url=None, openapi_url=None,
                  # a bare 307 to "/feedback" answered before auth, and not as JSON
                  redirect_slashes=False)
    app.state.settings = settings
    app.state.serving = app.state.core = serving
    app.state.metrics = metrics
    app.state.hooks = hooks
    app.state.recert = recert
    errors.install(app)
    for router in (answer.router, probes.router, openai.router, ops.router, ops.docs,
                   ops.assets, calibration.router):
        app.include_router(router)
    if settings.operator_key:      # without one, pin and rollback are not served at all
        app.include_router(calibration.operator)
    openapi.install(app, settings, {r.path for r in calibration.operator.routes})
    app.add_middleware(RequestContext, metrics=metrics, max_body_bytes=settings.max_body_bytes,
                       draining=lambda: serving.draining,
                       body_timeout_s=settings.body_timeout_s, api_key=settings.api_key,
                       body_paths=body_paths(app), max_header_bytes=settings.max_header_bytes)
    app.add_middleware(openai.OpenAIErrors)    # outside RequestContext: its errors too
    app.add_middleware(OriginForm)             # outermost: every layer routes by the path
    return app
