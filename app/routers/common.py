"""Pieces the routers share."""

from __future__ import annotations

from app.schemas import ErrorResponse

ERRORS = {code: {"model": ErrorResponse}
          for code in (401, 413, 415, 422, 429, 500, 503, 504)}
