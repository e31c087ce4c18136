"""Pieces the routers share."""

from __future__ import annotations

import dataclasses

from app.schemas import Confidence, ErrorResponse
from app.serving import Confidences

ERRORS = {code: {"model": ErrorResponse}
          for code in (401, 413, 415, 422, 429, 500, 503, 504)}


def confidence(c: Confidences) -> Confidence:
    # the served fields are one list (clients.schemas.SERVED_CONFIDENCES)
    return Confidence(**dataclasses.asdict(c))
