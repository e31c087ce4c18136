"""The service's log lines: one JSON object each, with an ISO-8601 UTC time and a level."""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from datetime import UTC, datetime

# The request a library's log line belongs to, where the service can tell (the multipart
# parser's warnings): set around the library call, read by `JsonLines`
LOG_REQUEST_ID: ContextVar[str | None] = ContextVar("dualread_log_request_id", default=None)


class JsonLines(logging.Formatter):
    """`{"time", "level", "logger", ...}`: a message that is a JSON object (the service's
    own events) keeps its fields; any other message becomes `"message"`. A traceback, when
    there is one, is a field too, so every line stays one JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        try:
            fields = json.loads(msg) if msg.startswith("{") else None
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            fields = {"message": msg}
        when = datetime.fromtimestamp(record.created, UTC)
        out = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name}
        out.update((k, v) for k, v in fields.items() if k not in out)
        rid = LOG_REQUEST_ID.get()
        if rid is not None and "request_id" not in out:
            out["request_id"] = rid
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# uvicorn's own loggers as JSON lines too (`dualread serve`): its "Invalid HTTP request
# received." warning, which any client can cause, was a plain line among the JSON ones
UVICORN_LOG_CONFIG: dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "app.logs.JsonLines"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                            "stream": "ext://sys.stderr"},
                 "none": {"class": "logging.NullHandler"}},
    "loggers": {"uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
                # the service writes its own access lines (`dualread.access`)
                "uvicorn.access": {"handlers": ["none"], "level": "WARNING",
                                   "propagate": False}},
}
