"""One answer outside the server, shaped exactly as `POST /answer` returns it
(`dualread answer`): the same checks, the same serving layer, the same response builder."""

from __future__ import annotations

import uuid

from app.routers.answer import response
from app.schemas import AnswerResponse
from app.service import Service
from app.serving import AnswerItem, Serving
from app.settings import Settings


async def answer_once(service: Service, settings: Settings, image: bytes, question: str,
                      max_new_tokens: int | None = None) -> AnswerResponse:
    """`/answer` for one image (its bytes: PNG, JPEG or DICOM) and question; raises what the
    route would turn into an error status (`app.errors.status_of`)."""
    serving = Serving(settings)
    serving.attach(service)
    try:
        # checked in the route's order: question, token limit, then the image
        q, limit = serving.question(question), serving.max_new_tokens(max_new_tokens)
        item = AnswerItem(await serving.image(image), q, limit)
        rid = uuid.uuid4().hex
        [served] = await serving.answer([item], request_id=rid)
        return response(serving, rid, served.result, served.queued_s)
    finally:
        await serving.stop()
