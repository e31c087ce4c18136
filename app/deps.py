"""Request-scoped accessors and guards shared by the routers (auth, content type)."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.errors import NoHeads, RepeatedHeader, Unauthorized, UnsupportedMediaType
from app.serving import Serving
from app.settings import Settings

# Declared in the OpenAPI spec (Swagger UI's Authorize button); checked below, so a
# missing header and a wrong key get the same 401.
bearer = HTTPBearer(auto_error=False, description="the service's API key, when it has one")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_serving(request: Request) -> Serving:
    return request.app.state.serving


def request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


def key_matches(given: str, key: str) -> bool:
    """The one comparison of a presented key with the configured one (constant time)."""
    return hmac.compare_digest(given.encode(), key.encode())


def one_header(request: Request, name: str, shown: str) -> str | None:
    """A credential header's value, None when absent; two of them are a 400 (`shown` is the
    name as the message writes it)."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise RepeatedHeader(shown)
    return values[0] if values else None


def check_key(request: Request, creds: HTTPAuthorizationCredentials | None) -> None:
    key = get_settings(request).api_key
    if not key:
        return
    one_header(request, "authorization", "Authorization")
    # HTTPBearer checked the scheme; an absent header compares as empty
    if not key_matches(creds.credentials if creds is not None else "", key):
        raise Unauthorized()


async def require_key(request: Request,
                      creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    check_key(request, creds)


async def require_key_for_docs(request: Request, creds: HTTPAuthorizationCredentials | None
                               = Depends(bearer)) -> None:
    if get_settings(request).docs_require_key:
        check_key(request, creds)


async def require_key_for_metrics(request: Request, creds: HTTPAuthorizationCredentials | None
                                  = Depends(bearer)) -> None:
    if get_settings(request).metrics_require_key:
        check_key(request, creds)


async def require_heads(request: Request) -> None:
    """The probe routes compute confidences: refused in answer-only mode (no heads)."""
    backend = get_serving(request).backend
    if backend is not None and backend.heads_id is None:
        raise NoHeads()


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def require_json(request: Request) -> None:
    if media_type(request) != "application/json":
        raise UnsupportedMediaType("send the body as application/json")
