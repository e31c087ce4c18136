"""Operations: health, readiness, model cards, Prometheus metrics, and the API docs served
from local assets (an air-gapped network has no CDN)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.deps import (
    get_serving,
    request_id,
    require_key,
    require_key_for_docs,
    require_key_for_metrics,
)
from app.errors import NotReady, error_response
from app.routers import openai
from app.routers.common import error_responses
from app.serving import Serving

router = APIRouter(tags=["ops"])
docs = APIRouter(include_in_schema=False, dependencies=[Depends(require_key_for_docs)])
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "text/javascript", "favicon.png": "image/png"}
ASSET_URL = "/docs/assets/"


# HEAD too (load balancers and uptime checkers probe with it); kept out of the schema,
# where a second method of one function would repeat its operation id
@router.head("/health/live", include_in_schema=False)
@router.get("/health/live")
async def live() -> dict:
    return {"status": "live"}


@router.head("/health/ready", include_in_schema=False)
@router.get("/health/ready", responses=error_responses(503))
async def ready(request: Request, serving: Serving = Depends(get_serving)) -> JSONResponse:
    if serving.ready:
        return JSONResponse({"status": "ready"})
    why = "shutting down" if serving.draining else (serving.load_error or "loading model")
    return error_response(503, why, request_id(request))


@router.get("/v1/models", dependencies=[Depends(require_key)],
            responses=error_responses(500, 503))
async def models(serving: Serving = Depends(get_serving)) -> dict:
    if serving.backend is None:
        raise NotReady(serving.load_error or "loading model")
    # OpenAI's model list (`object`, `data`) beside the cards: the OpenAI SDK's
    # `models.list()` reads it
    return {**openai.model_list(), **serving.backend.cards()}


@router.get("/metrics", include_in_schema=False,
            dependencies=[Depends(require_key_for_metrics)])
def metrics(request: Request) -> Response:
    # a sync route: FastAPI runs it in a worker thread, so computing the feedback-window
    # statistics never holds the event loop
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@docs.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@docs.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title=request.app.title + " - docs",
        swagger_js_url=ASSET_URL + "swagger-ui-bundle.js",
        swagger_css_url=ASSET_URL + "swagger-ui.css", swagger_favicon_url=ASSET_URL + "favicon.png")


@docs.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=request.app.title + " - ReDoc",
                          redoc_js_url=ASSET_URL + "redoc.standalone.js",
                          redoc_favicon_url=ASSET_URL + "favicon.png", with_google_fonts=False)


assets = APIRouter(include_in_schema=False)


@assets.get(ASSET_URL + "{name}")
async def asset(name: str) -> Response:
    """Swagger UI and ReDoc, shipped by the fastapi-offline package (public code, no key)."""
    if name not in ASSETS:
        raise HTTPException(404, "not found")
    return FileResponse(str(files("fastapi_offline") / "static" / name), media_type=ASSETS[name])
