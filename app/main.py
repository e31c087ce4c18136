"""FastAPI app: HTTP in, core calls, HTTP out. No science here."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from app.engine import Batcher, QueueFull
from app.metrics import Metrics
from app.schemas import (
    AnswerRequest,
    AnswerResponse,
    CounterfactualRequest,
    CounterfactualResponse,
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    ScoreRequest,
    ScoreResponse,
)
from app.service import AnswerJob, Service
from app.settings import Settings
from heads.monitor import FeedbackMonitor
from models.canon import canon, is_correct
from models.evaluate import blank_image
from models.images import ImageError, open_image
from models.masking import MaskSpec

log = logging.getLogger("dualread.access")
ERRORS = {code: {"model": ErrorResponse} for code in (401, 413, 422, 429, 503, 504)}


def _json_logging() -> None:
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


class State:
    """Everything the routes share, hung on app.state.core."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.monitor = FeedbackMonitor(settings.feedback_window)
        self.service: Service | None = None
        self.batcher: Batcher | None = None
        self.load_error: str | None = None
        self.draining = False

    @property
    def ready(self) -> bool:
        return self.service is not None and self.batcher is not None and not self.draining

    def attach(self, service: Service) -> None:
        self.service = service
        s = self.settings

        def answer_handler(limit: int):
            return lambda jobs: service.answer_batch(jobs, limit)

        handlers: dict[str, Any] = {"score": lambda jobs: [service.score_one(*j) for j in jobs]}
        for limit in range(1, s.max_new_tokens + 1):
            handlers[f"answer:{limit}"] = answer_handler(limit)

        def on_batch(kind: str, n: int) -> None:
            self.metrics.batch_size.observe(n)

        self.batcher = Batcher(handlers, s.max_batch_size, s.batch_wait_ms, s.queue_limit,
                               on_batch)
        self.batcher.start()
        self.metrics.model_info.info({
            "actor": service.actor.fingerprint, "heads": service.heads_id,
            "family": service.actor.family.name, "device": str(service.actor.device)})

    def drain(self) -> None:
        self.draining = True


def create_app(settings: Settings | None = None, service: Service | None = None) -> FastAPI:
    """The ASGI app. With `service`, use it (tests); otherwise load in the background so
    liveness answers at once and readiness turns 200 when the model is in memory."""
    settings = settings or Settings()
    core = State(settings)
    _json_logging()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service is not None:
            core.attach(service)
        else:
            loop = asyncio.get_running_loop()

            async def load() -> None:
                try:
                    svc = await loop.run_in_executor(None, lambda: Service(
                        settings.actor, settings.heads, settings.device, settings.dtype))
                    core.attach(svc)
                except Exception as e:  # readiness stays 503 and says why
                    core.load_error = f"{type(e).__name__}: {e}"
                    log.error(json.dumps({"event": "load_failed", "error": core.load_error}))

            loop.create_task(load())
        yield
        core.drain()
        if core.batcher:
            for _ in range(int(settings.request_timeout_s * 10)):
                if core.batcher.idle():
                    break
                await asyncio.sleep(0.1)
            await core.batcher.stop()

    app = FastAPI(title="dualread", version="0.1.0", lifespan=lifespan,
                  description="Visual question answering with a frozen VLM and DualRead "
                              "confidence: answer, defer flag, probes, feedback, metrics.")
    app.state.core = core

    # ------------------------------------------------------------ cross-cutting
    @app.middleware("http")
    async def access(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = rid
        # A request that arrived before SIGTERM is in flight and will be served.
        request.state.late = core.draining
        request.state.batch_size = None
        t = time.perf_counter()
        try:
            response = await call_next(request)
            status = response.status_code
        except Exception:
            status = 500
            raise
        finally:
            took = time.perf_counter() - t
            route = request.scope.get("route")
            path = getattr(route, "path", "unmatched")
            core.metrics.request_duration.labels(path).observe(took)
            core.metrics.requests.labels(path, str(status)).inc()
            # Never image bytes or question text: they may be patient data.
            log.info(json.dumps({"request_id": rid, "route": path, "method": request.method,
                                 "status": status, "latency_ms": round(took * 1000, 2),
                                 "batch_size": request.state.batch_size}))
        response.headers["x-request-id"] = rid
        return response

    def auth(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = hmac.compare_digest(token.encode(), key.encode()) and scheme.lower() == "bearer"
        if not ok:
            raise HTTPException(401, "missing or invalid credentials",
                                headers={"WWW-Authenticate": "Bearer"})

    def decode(b64: str, what: str = "image"):
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise HTTPException(422, f"{what}: not valid base64") from None
        return image_from_bytes(raw, what)

    def image_from_bytes(raw: bytes, what: str = "image"):
        if len(raw) > settings.max_image_bytes:
            raise HTTPException(413, f"{what}: {len(raw)} bytes, over the limit of "
                                     f"{settings.max_image_bytes}")
        try:
            return open_image(raw, settings.max_image_pixels)
        except ImageError as e:
            code = 413 if "over the limit" in str(e) or "bomb" in str(e) else 422
            raise HTTPException(code, f"{what}: {e}") from None

    def check_question(q: str) -> str:
        q = q.strip()
        if not q:
            raise HTTPException(422, "question is empty")
        if len(q) > settings.max_question_chars:
            raise HTTPException(422, f"question is longer than {settings.max_question_chars} "
                                     "characters")
        return q

    async def run(request: Request, kind: str, payload: Any) -> Any:
        if request.state.late:
            raise HTTPException(503, "shutting down")
        if core.service is None or core.batcher is None:
            raise HTTPException(503, "not ready")
        try:
            job = core.batcher.submit(kind, payload)
        except QueueFull:
            raise HTTPException(429, "queue full, retry shortly",
                                headers={"Retry-After": "1"}) from None
        core.metrics.queue_depth.set(core.batcher.depth)
        try:
            result = await asyncio.wait_for(asyncio.shield(job.future),
                                            settings.request_timeout_s)
        except TimeoutError:
            job.future.cancel()
            raise HTTPException(504, f"no answer within {settings.request_timeout_s} s") from None
        finally:
            core.metrics.queue_depth.set(core.batcher.depth)
        queue_s = job.started - job.enqueued
        core.metrics.stage_duration.labels("queue").observe(queue_s)
        request.state.batch_size = job.batch
        return result, queue_s

    def limit_of(n: int | None) -> int:
        return min(n or settings.max_new_tokens, settings.max_new_tokens)

    # ------------------------------------------------------------ routes
    answer_body = {"requestBody": {"content": {
        "application/json": {"schema": AnswerRequest.model_json_schema()},
        "multipart/form-data": {"schema": {
            "type": "object", "required": ["file", "question"],
            "properties": {"file": {"type": "string", "format": "binary"},
                           "question": {"type": "string", "minLength": 1},
                           "max_new_tokens": {"type": "integer", "minimum": 1}}}}},
        "required": True}}

    @app.post("/answer", response_model=AnswerResponse, responses=ERRORS,
              dependencies=[Depends(auth)], openapi_extra=answer_body)
    async def answer(request: Request) -> AnswerResponse:
        """Answer a visual question; confidence, defer flag and timings come with it."""
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            form = await request.form()
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise HTTPException(422, "multipart body needs a 'file' part")
            raw = await upload.read()
            image = image_from_bytes(raw)
            question = check_question(str(form.get("question") or ""))
            try:
                mnt = int(form["max_new_tokens"]) if form.get("max_new_tokens") else None
            except ValueError:
                raise HTTPException(422, "max_new_tokens must be an integer") from None
        else:
            try:
                body = AnswerRequest.model_validate_json(await request.body())
            except ValidationError as e:
                raise HTTPException(422, _explain(e)) from None
            image = decode(body.image)
            question = check_question(body.question)
            mnt = body.max_new_tokens
        limit = limit_of(mnt)
        res, queue_s = await run(request, f"answer:{limit}", AnswerJob(image, question))
        return _answer_response(core, request.state.request_id, res, queue_s)

    @app.post("/probe/counterfactual", response_model=CounterfactualResponse,
              responses=ERRORS, dependencies=[Depends(auth)])
    async def counterfactual(request: Request, body: CounterfactualRequest
                             ) -> CounterfactualResponse:
        """Run the same question on the real image and a counterfactual one (SPEC §2, §5)."""
        question = check_question(body.question)
        real = decode(body.image)
        cf = blank_image() if body.counterfactual == "blank" else \
            decode(body.counterfactual, "counterfactual")
        limit = limit_of(body.max_new_tokens)
        (a, _), (b, _) = await asyncio.gather(
            run(request, f"answer:{limit}", AnswerJob(real, question)),
            run(request, f"answer:{limit}", AnswerJob(cf, question)))
        z_real = is_correct(a["answer"], body.reference_answer) \
            if body.reference_answer is not None else None
        cf_ref = body.counterfactual_reference_answer
        z_cf = is_correct(b["answer"], cf_ref) if cf_ref is not None else None
        decisive = strict = None
        if z_real is not None and z_cf is not None:
            decisive = bool(z_real and not z_cf)
            strict = decisive and bool(a["canonical"]) and a["canonical"] == b["canonical"]
        diff = {k: a["confidence"][k] - b["confidence"][k] for k in a["confidence"]}
        return CounterfactualResponse(
            real={**_run(a), "correct": z_real}, counterfactual={**_run(b), "correct": z_cf},
            confidence_difference=diff,
            answer_changed=canon(a["answer"]) != canon(b["answer"]),
            decisive=decisive, strict=strict, request_id=request.state.request_id)

    @app.post("/probe/score", response_model=ScoreResponse, responses=ERRORS,
              dependencies=[Depends(auth)])
    async def score(request: Request, body: ScoreRequest) -> ScoreResponse:
        """Teacher-forced confidence of a supplied trajectory, optionally masked (SPEC §3)."""
        image = decode(body.image)
        question = check_question(body.question)
        mask = None
        if body.mask is not None:
            try:
                mask = MaskSpec(tuple(body.mask.target) if isinstance(body.mask.target, list)
                                else body.mask.target, body.mask.ratio, body.mask.seed)
            except ValueError as e:
                raise HTTPException(422, str(e)) from None
        try:
            res, _ = await run(request, "score", (image, question, body.response, mask))
        except ValueError as e:   # e.g. a character span outside the response
            raise HTTPException(422, str(e)) from None
        return ScoreResponse(**res, request_id=request.state.request_id)

    @app.post("/feedback", response_model=FeedbackResponse, responses=ERRORS,
              dependencies=[Depends(auth)])
    async def feedback(body: FeedbackRequest) -> FeedbackResponse:
        """A clinician's verdict on an earlier answer; feeds the calibration monitor."""
        known = core.monitor.feedback(body.request_id, body.correct)
        core.metrics.feedback.labels(str(known).lower()).inc()
        core.metrics.set_feedback(core.monitor.stats())
        return FeedbackResponse(accepted=known, window=len(core.monitor.window))

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        if core.batcher:
            core.metrics.queue_depth.set(core.batcher.depth)
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready", responses={503: {"model": ErrorResponse}})
    async def ready() -> JSONResponse:
        if core.ready:
            return JSONResponse({"status": "ready"})
        why = "shutting down" if core.draining else (core.load_error or "loading model")
        return JSONResponse({"detail": why}, status_code=503)

    @app.get("/v1/models", dependencies=[Depends(auth)], responses=ERRORS)
    async def models() -> dict:
        if core.service is None:
            raise HTTPException(503, "loading model")
        return core.service.cards()

    return app


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _run(r: dict) -> dict:
    return {"answer": r["answer"], "canonical": r["canonical"], "response": r["response"],
            "confidence": r["confidence"]}


def _answer_response(core: State, rid: str, res: dict, queue_s: float) -> AnswerResponse:
    service = core.service
    c = res["confidence"]
    core.metrics.confidence.observe(c["dualread"])
    for stage in ("generate", "readout", "heads"):
        core.metrics.stage_duration.labels(stage).observe(res["timings"][stage])
    if res["defer"]:
        core.metrics.defer.inc()
    core.monitor.record(rid, c["dualread"], res["defer"])
    ms = {k: round(v * 1000, 3) for k, v in res["timings"].items()}
    return AnswerResponse(
        answer=res["answer"], response=res["response"], confidence=c, defer=res["defer"],
        defer_threshold=service.threshold, model=service.actor.fingerprint,
        heads=service.heads_id, request_id=rid,
        timings_ms={"queue": round(queue_s * 1000, 3), **ms})

