"""The HTTP/1.1 protocol `dualread serve` runs: uvicorn's h11 protocol, except that its own
400, for a request the parser refuses before the app sees it (no `Host`, a malformed
request line, two `Content-Length`s, headers over `--max-header-bytes` in pieces), is the
service's JSON error shape with a request id, not plain text."""

from __future__ import annotations

import json
import logging
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.errors import REQUEST_ID

log = logging.getLogger("dualread.access")


class JsonH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        rid = uuid.uuid4().hex
        bound = self.config.h11_max_incomplete_event_size
        detail = ("invalid HTTP request: a request line, header or framing the HTTP parser "
                  "refuses" + (f", or a request line and headers over {bound} bytes"
                               if bound else ""))
        body = json.dumps({"detail": detail, "request_id": rid}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length",
                   str(len(body)).encode()), (b"connection", b"close"),
                   (REQUEST_ID.encode(), rid.encode())]
        # as uvicorn's own: the response, its body, the end, then the connection closes
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
        # the parser read no route and no method it would vouch for: neither is logged
        log.info(json.dumps({"request_id": rid, "route": "unparsed", "status": 400}))
