"""The HTTP/1.1 protocol `dualread serve` runs: uvicorn's h11 protocol, with two changes.

- Its own 400, for a request the parser refuses before the app sees it (no `Host`, a
  malformed request line, two `Content-Length`s, headers over `--max-header-bytes` in
  pieces), is the service's JSON error shape with a request id, not plain text (OpenAI's
  shape when the request was already routed to the OpenAI route), and logs one access
  line, not uvicorn's WARNING as well.
- A connection closed while the client is still sending its body (the app answered before
  reading it: a 401, a 413, a 404) closes gently: closing a socket with unread bytes makes
  the kernel reset the connection, and a reset can destroy the answer before the client
  reads it (RFC 9112 9.6). The server half-closes after the answer and reads and discards
  what comes for `LINGER_S` at most (the client's own close ends it sooner).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from app.errors import REQUEST_ID
from app.middleware import routed_path
from app.routers.openai import PATH as OPENAI_PATH
from app.routers.openai import openai_error

log = logging.getLogger("dualread.access")
# Long enough for an answer to cross a slow link, short enough that a client trickling
# its body cannot hold the connection (nginx's lingering_timeout is 5 s).
LINGER_S = 2.0
PARSER_WARNING = "Invalid HTTP request received."


class _NoParserWarning(logging.Filter):
    """uvicorn's WARNING for each request its parser refuses: any client could write
    WARNING lines at will; the 400's access line records the request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != PARSER_WARNING


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` lingers while the client is
    mid-body; everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: JsonH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        if not self.lingering:     # an answer still streaming when the parser failed
            self._transport.write(data)

    def is_closing(self) -> bool:
        # uvicorn must treat a lingering connection as closed: no next request on it
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        t = self._transport
        # SEND_BODY: answered mid-body; ERROR: the parser's 400, with the rest unread
        if self.lingering or t.is_closing() or not t.can_write_eof() or \
                self._protocol.conn.their_state not in (h11.SEND_BODY, h11.ERROR):
            t.close()
            return
        self.lingering = True
        t.write_eof()              # after the buffered answer: the client sees it end
        t.resume_reading()         # a paused socket would fill and reset all the same
        self._protocol.loop.call_later(LINGER_S, t.close)


def _tell_gone(cycle: RequestResponseCycle) -> None:
    """The app's request as if its client had left: its sends are dropped, a read waiting
    for the body wakes to a disconnect."""
    cycle.disconnected = True
    cycle.message_event.set()


class JsonH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not any(isinstance(f, _NoParserWarning) for f in self.logger.filters):
            self.logger.addFilter(_NoParserWarning())

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if getattr(self.transport, "lingering", False):
            return                 # the refused body's rest: read, never parsed
        super().data_received(data)

    def _unsupported_upgrade_warning(self) -> None:
        # no WebSocket route (`ws="none"`): an upgrade is answered as plain HTTP; uvicorn's
        # warnings (one of them says to install a WebSocket library) would let any client
        # write WARNING lines at will
        pass

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            # an answer is already out: no second one; the app's further writes are dropped
            if self.cycle is not None and not self.cycle.response_complete:
                _tell_gone(self.cycle)
            self.transport.close()
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_started \
            else None
        if cycle is not None:
            # the app holds this request already (its body broke the framing) and h11 will
            # not let it answer now: it is told the client left, this 400 is the answer,
            # and the request middleware logs it under the same id
            _tell_gone(cycle)
            state = cycle.scope.setdefault("state", {})  # type: ignore[typeddict-item]
            rid = state.setdefault("request_id", uuid.uuid4().hex)
            state["parser_answered"] = True
        else:
            rid = uuid.uuid4().hex
        bound = self.config.h11_max_incomplete_event_size
        detail = ("invalid HTTP request: a request line, header or framing the HTTP parser "
                  "refuses" + (f", or a request line and headers over {bound} bytes"
                               if bound else ""))
        body = json.dumps({"detail": detail, "request_id": rid}).encode()
        if cycle is not None and routed_path(cycle.scope) == OPENAI_PATH:
            body = openai_error(400, body)     # as every error on that route
        headers = [(b"content-type", b"application/json"), (b"content-length",
                   str(len(body)).encode()), (b"connection", b"close"),
                   (REQUEST_ID.encode(), rid.encode())]
        # as uvicorn's own: the response, its body, the end, then the connection closes
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
        if cycle is None:
            # the parser read no route and no method it would vouch for: neither is logged
            log.info(json.dumps({"request_id": rid, "route": "unparsed", "status": 400}))
