"""GET /calibration: the defer rule being served, its certificate, the open window of
operator verdicts, the history of switches and the live drift statistics. POST
/calibration/pin, /unpin, /rollback and /window/reset: operator only, and served only when
an operator key is configured (heads.recert, app.recertify)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from app.deps import require_json, require_key
from app.recertify import LOADING
from app.routers.common import BODY_ERRORS, PRE_ROUTING_ERRORS, error_responses
from heads.recert import RecertError

router = APIRouter(tags=["calibration"], dependencies=[Depends(require_key)])


async def require_operator(request: Request) -> str:
    who = request.app.state.recert.operator(request)
    if who is None:
        raise HTTPException(403, "send the operator key in the X-Operator-Key header")
    return who


# what each route can answer besides the keys' statuses (`app.openapi` adds those, and the
# operator routes' 404 and 409): GET reads no body and runs no model; an operator route
# waits for the rule store while the model loads (503); a POST's body, which unpin,
# rollback and the window reset do not use, is still bounded and checked before routing
# (400, 408, 413, 422); pin reads its JSON body (415 too)
VIEW_ERRORS = error_responses(500)
STORE_ERRORS = error_responses(*PRE_ROUTING_ERRORS, 500, 503)
PIN_ERRORS = error_responses(*BODY_ERRORS, 503)

operator = APIRouter(tags=["calibration"],
                     dependencies=[Depends(require_key), Depends(require_operator)])


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | None = Field(None, max_length=64,
                                description="rule to serve and keep; default: the active one")


def _store(request: Request):
    recert = request.app.state.recert
    if recert.store is None:
        # 503 while the model loads; 409 when this service will never hold a rule store
        # (answer-only, or the state file unusable): retrying will not help
        why = recert.reason()
        raise HTTPException(503 if why == LOADING else 409, why)
    return recert.store


@router.get("/calibration", responses=VIEW_ERRORS)
def calibration(request: Request) -> dict:
    """The active defer rule with its certificate, the open verdict window (its tallies
    with the operator key only), the last certification attempt, the kept rules and the
    switch history (no request content)."""
    recert = request.app.state.recert
    return recert.view(operator=recert.operator(request) is not None)


@operator.post("/calibration/pin", responses=PIN_ERRORS, dependencies=[Depends(require_json)])
async def pin(request: Request, body: PinRequest, who: str = Depends(require_operator)
              ) -> dict:
    """Serve `version` (default: the active rule) and switch no more until unpinned."""
    try:
        rule = await run_in_threadpool(_store(request).pin, body.version, who)
    except RecertError as e:
        raise HTTPException(404, str(e)) from None
    return {"active": rule.summary(), "pinned": True}


@operator.post("/calibration/unpin", responses=STORE_ERRORS)
async def unpin(request: Request, who: str = Depends(require_operator)) -> dict:
    await run_in_threadpool(_store(request).unpin, who)
    return {"pinned": False}


@operator.post("/calibration/rollback", responses=STORE_ERRORS)
async def rollback(request: Request, who: str = Depends(require_operator)) -> dict:
    """Serve the rule active before the current one, and pin it."""
    try:
        rule = await run_in_threadpool(_store(request).rollback, who)
    except RecertError as e:
        raise HTTPException(409, str(e)) from None
    return {"active": rule.summary(), "pinned": True}


@operator.post("/calibration/window/reset", responses=STORE_ERRORS)
async def reset_window(request: Request, who: str = Depends(require_operator)) -> dict:
    """A new input stream: drop the window's verdicts (the next certificate test reads
    only verdicts given after this) and serve the shipped rule again unless one is
    pinned. Dropping verdicts spends a test's share of δ."""
    store = _store(request)

    def reset() -> dict:
        # the view takes the store's lock, which a verdict closing a window holds through
        # its certificate: off the event loop too
        return {**store.reset_window(who), "window": store.view()["window"]}

    return await run_in_threadpool(reset)
