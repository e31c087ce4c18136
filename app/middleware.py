"""Per-request context as plain ASGI: request id, body limit and read deadline, a bounded
JSON pre-check, access log, metrics, and a JSON 500 for anything unexpected (never a
plain-text trace, never a dropped connection)."""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import re
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from fastapi import HTTPException
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.security.utils import get_authorization_scheme_param
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.deps import key_matches
from app.errors import REQUEST_ID, RepeatedHeader, Unauthorized, error_response
from app.metrics import Metrics

log = logging.getLogger("dualread.access")
CORRELATION_ID = "x-correlation-id"
# A client's own id is kept only as a bounded, plain correlation id: echoed back, never
# logged (it may carry anything), never a key for feedback.
CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# Bounds of a JSON body, checked before pydantic sees it: the request schemas have at most
# 7 fields per object, 64 trajectories and 4 levels, so these refuse only hostile bodies
# (1M unknown keys made pydantic build 1M errors on the event loop for 23 s).
MAX_JSON_KEYS = 32
MAX_JSON_ITEMS = 256
MAX_JSON_DEPTH = 16
MAX_JSON_NODES = 4096
CLIENT_CLOSED = 499   # nginx's code for a client that went away before the reply
# Routes whose bodies are a few fields (a request id and a verdict, a rule version): a
# 32 MiB body there is only work (parsing it held the event loop ~0.1 s), so it is refused
# at this size, before it is read when its length is sent.
SMALL_BODY_BYTES = 16384
SMALL_BODY_PATHS = frozenset({"/feedback", "/calibration/pin", "/calibration/unpin",
                              "/calibration/rollback", "/calibration/window/reset"})
# Digits in all the body's numbers of more than 19 (an int64's most), together: no request
# field takes one, and each costs a conversion that grows with the square of its length
# and holds the GIL, in a worker thread too (4,096 numbers of 4,300 digits, 17.5 MB within
# the bounds above, stalled the event loop ~0.4 s on a route and ~0.75 s on /probe/*).
SHORT_NUMBER_DIGITS = 19
MAX_LONG_DIGITS = 16384
_DIGIT_BYTES = b"0123456789"
# every byte a digit or not: a run of digits is then one `bytes.find` (linear; a regex
# `[0-9]{4301}` rescans a shorter run from each of its digits)
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
# Bytes scanned by one regex call. The scan runs in a worker thread, but re and translate
# hold the GIL for a whole call: 30 MB of blanks between two tokens stalled the event loop
# for about a second. Python hands the GIL over between calls (every 5 ms).
WINDOW = 1 << 18


def long_number(gap: bytes) -> bool:
    """Whether text between JSON tokens (numbers, literals, blanks) holds a number of more
    digits than Python converts to an int (`sys.get_int_max_str_digits`, 4,300): FastAPI's
    parser fails on it with a 400 and pydantic's with a 422; refused here, on every route,
    with the one status of a body that cannot be used (422)."""
    limit = sys.get_int_max_str_digits()
    if not 0 < limit < len(gap):
        return False
    run = b"0" * (limit + 1)
    # window by window (overlapping by a run's length), so no one C call holds the GIL
    # over a whole 30 MB gap: the event loop gets it back between windows
    for i in range(0, len(gap), WINDOW):
        if gap[max(0, i - limit):i + WINDOW].translate(_DIGITS).find(run) >= 0:
            return True
    return False


def long_digits(gap: bytes) -> int:
    """The digits in text between JSON tokens when there are more than
    `SHORT_NUMBER_DIGITS` of them (a long number's), else 0; counted a window at a time,
    as `long_number` scans."""
    if len(gap) <= SHORT_NUMBER_DIGITS:
        return 0
    n = sum(len(w) - len(w.translate(None, _DIGIT_BYTES))
            for w in (gap[i:i + WINDOW] for i in range(0, len(gap), WINDOW)))
    return n if n > SHORT_NUMBER_DIGITS else 0


# One JSON token: a whole string (escapes included) or a structural character. Numbers,
# literals and whitespace are skipped; the route's parser still checks the syntax. The
# next token is a `find` (memchr) in a copy of the body with every token byte marked, and
# a string's end a `find` of its closing quote; only escapes go through a regex, possessive
# (a backtracking one rescanned an unclosed string of escaped quotes from every quote) and
# a window at a time: re and translate hold the GIL for a whole call, and 30 MB of blanks
# or of one base64 string scanned by regex stalled the event loop for about a second.
_MARKS = bytes(33 if b in b'[]{}:,"' else 32 for b in range(256))
_ESCAPED = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)
_QUOTE, _OPEN, _CLOSE = ord('"'), b"{[", b"}]"
# What a string or an opener may follow in JSON: nothing (the root), an opener or a
# separator. Anywhere else the body is invalid; the scan stops there, since such tokens
# count toward no bound (30 MB of `{}{}...` or `"a""a"...` kept it busy for 100 s).
_BEFORE_VALUE = frozenset(b"[{,:") | {0}


def _string_end(body: bytes, j: int) -> int:
    """Where the string whose text starts at `j` ends (past its closing quote), -1 when it
    never closes. The next quote and backslash are looked up once each and kept while
    the scan has not passed them (looking them up again each window was quadratic); a
    backslash only up to that quote (searched further, every short string before one
    distant backslash read to it: quadratic in the body again)."""
    n = len(body)
    quote = slash = -1
    while j < n:
        if quote < j:
            quote = body.find(b'"', j)
            if quote < 0:
                return -1
        if slash < j:
            slash = body.find(b"\\", j, quote)
            slash = n if slash < 0 else slash
        if slash > quote:
            return quote + 1
        e = _ESCAPED.match(body, j, min(n, j + max(WINDOW, 2))).end()
        if e < n and body[e] == _QUOTE:
            return e + 1
        if e == j:                 # a lone backslash at the very end
            return -1
        j = e                      # the window's end, or an escape it cut in two
    return -1


def _tokens(body: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of each token in order; a string that never closes ends at -1 (last).
    Token bytes are marked a window at a time, as the scan reaches it (no copy of a whole
    32 MB body; each byte is marked at most once)."""
    n, base, marks, pos = len(body), 0, b"", 0
    while pos < n:
        if pos >= base + len(marks):
            base, marks = pos, body[pos:pos + WINDOW].translate(_MARKS)
        i = marks.find(b"!", pos - base)
        if i < 0:
            pos = base + len(marks)
            continue
        start = base + i
        pos = _string_end(body, start + 1) if body[start] == _QUOTE else start + 1
        yield start, pos
        if pos < 0:
            return


def json_problem(body: bytes) -> str | None:
    """Why a JSON body is refused before it is parsed (no key or value is quoted), or None.

    A scan of its tokens that stops at the first bound crossed: json.loads holds the GIL
    for its whole run (1.7 s of a stalled event loop on 1.2M keys, even in a thread),
    this returns after 33 keys. Invalid JSON is None: the route's parser says where."""
    # JSON on the wire is UTF-8 (RFC 8259), which never holds a raw NUL; UTF-16/32 always
    # do, and json.loads would decode them behind this byte-level scan.
    if b"\x00" in body or not _utf8(body):
        return "body: JSON must be UTF-8 text"
    # per open container: [is an object, keys or commas so far, its keys]
    stack: list[list] = []
    values = 0
    last = (0, 0)              # the latest string token (a key when ':' follows it)
    end = 0                    # where the previous token ended
    prev = 0                   # the previous token's byte (0: none yet)
    digits = 0                 # in long numbers so far (`MAX_LONG_DIGITS`)
    for start, stop in _tokens(body):
        digits, problem = _numbers(body[end:start], digits)
        if problem:
            return problem
        end = stop
        c = body[start]
        if c == _QUOTE or c in _OPEN:
            if prev not in _BEFORE_VALUE:
                return None        # invalid JSON: the parser says so
        elif not stack:
            return None            # a separator or a close outside every container
        prev = c
        if c == _QUOTE:
            if stop < 0:
                return None        # a string that never closes: invalid, the parser says so
            last = (start, stop)
            continue
        if c in _OPEN:
            stack.append([c == _OPEN[0], 0, set()])
            if len(stack) > MAX_JSON_DEPTH:
                return f"body: nested deeper than {MAX_JSON_DEPTH} levels"
        elif c in _CLOSE:
            stack.pop()
        elif stack:
            obj, count, _ = stack[-1]
            if (c == ord(":")) == obj:       # a key in an object, a comma in a list
                stack[-1][1] = count = count + 1
                if obj and count > MAX_JSON_KEYS:
                    return f"body: an object has more than {MAX_JSON_KEYS} fields"
                if obj:
                    # the parser would keep the last of two equal keys, and a proxy that
                    # checked the first would have judged another request
                    key = _key(body[last[0]: last[1]])
                    if key in stack[-1][2]:
                        return "body: an object has a duplicate key"
                    stack[-1][2].add(key)
                if not obj and count >= MAX_JSON_ITEMS:
                    return f"body: a list has more than {MAX_JSON_ITEMS} items"
            values += 1
            if values > MAX_JSON_NODES:
                return f"body: more than {MAX_JSON_NODES} values"
    return _numbers(body[end:], digits)[1]


def _numbers(gap: bytes, digits: int) -> tuple[int, str | None]:
    """The long numbers' digits counted with those of `gap` (text between tokens), and why
    the body is refused for its numbers, or None."""
    if long_number(gap):
        return digits, f"body: a number has more than {sys.get_int_max_str_digits()} digits"
    digits += long_digits(gap)
    if digits > MAX_LONG_DIGITS:
        return digits, (f"body: its numbers of more than {SHORT_NUMBER_DIGITS} digits have "
                        f"more than {MAX_LONG_DIGITS} digits together")
    return digits, None


def _utf8(body: bytes) -> bool:
    """Whether the body is UTF-8. Checked here so that every JSON route refuses other bytes
    with the one status of an unusable body (FastAPI's parser answered 400, `/answer`'s
    422); a window at a time, as the token scan, so no one call holds the GIL for 30 MB."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for i in range(0, len(body), WINDOW):
            decoder.decode(body[i:i + WINDOW])
        decoder.decode(b"", final=True)      # a sequence cut off at the very end
    except UnicodeDecodeError:
        return False
    return True


def _key(token: bytes) -> str:
    """A key as the parser will read it: escapes decoded (`"\\u0071"` is `"q"`)."""
    if b"\\" not in token:
        return token[1:-1].decode("utf-8", "replace")
    try:
        return json.loads(token)
    except ValueError:     # an invalid escape: the parser refuses the body anyway
        return token.decode("utf-8", "replace")


def _is_json(headers: Headers) -> bool:
    # the media types FastAPI itself would parse as JSON
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def bearer_matches(authorization: str, key: str) -> bool:
    """`Authorization: Bearer <key>` (scheme in any case), read by the parser the routes'
    check uses (blanks around the token dropped)."""
    scheme, token = get_authorization_scheme_param(authorization)
    return key_matches(token if scheme.lower() == "bearer" else "", key)


BODY_METHODS = ("POST", "PUT", "PATCH")


def body_paths(app: Any) -> frozenset[str]:
    """Paths of the app's routes that take a body (POST, PUT or PATCH). `app.routes` holds
    the included routers, not their routes: FastAPI's own walk reaches those (and their
    full paths)."""
    return frozenset(ctx.path for ctx in iter_route_contexts(app.routes)
                     if isinstance(ctx.original_route, APIRoute)
                     and ctx.original_route.methods & set(BODY_METHODS))


# HTTP's methods (RFC 9110 and PATCH): any other token is the client's own text
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                     "PATCH"})


def _logged_method(method: object) -> str:
    """The method as the access log writes it: another token is "OTHER" (a client could
    send 120 KB of it, or a name)."""
    return method if isinstance(method, str) and method in METHODS else "OTHER"


def _request_line_bytes(scope: Scope) -> int:
    """The request line's length: `METHOD target HTTP/x.y` and CRLF."""
    query = scope.get("query_string") or b""
    return (len(scope.get("method") or "") + 1 + len(scope.get("raw_path") or b"")
            + (1 + len(query) if query else 0) + 1 + len("HTTP/") + 3 + 2)


class OriginForm:
    """Routes a request target in absolute form (`POST http://host/answer`, which RFC 9112
    3.2.2 says a server must accept) by its path: uvicorn's h11 parser kept the whole URL as
    the path, so every such request was a 404. Only `path` is rewritten: `raw_path` keeps
    what was sent, which the request line's bound counts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = routed_path(scope)
            if path != scope["path"]:
                scope = {**scope, "path": path}
        await self.app(scope, receive, send)


def failure_site(e: BaseException, frames: int = 8) -> list[str]:
    """Where an unhandled error was raised, innermost last (`folder/file.py:line function`,
    the last `frames` frames): what an operator needs to find the fault, without the
    exception's text, which may quote the request (a decoder's or tokenizer's message)."""
    return [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}"
            for f in traceback.extract_tb(e.__traceback__)[-frames:]]


def routed_path(scope: Scope) -> str:
    """The path an HTTP request is routed by: an absolute-form target's path, else the
    scope's `path` (`OriginForm`; the HTTP parser's own 400 reads it too)."""
    raw = scope.get("raw_path") or b""
    if not raw[:8].lower().startswith((b"http://", b"https://")):
        return scope["path"]
    # by hand, not urlsplit: that raises on a bracketed host it cannot read (`http://[x/`),
    # which was a plain-text 500 quoting the host in the log
    rest = raw.split(b"://", 1)[1].split(b"#", 1)[0]
    at = rest.find(b"/")
    return unquote((rest[at:] if at >= 0 else b"/").decode("ascii", "replace"))


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int,
                 draining: Callable[[], bool], body_timeout_s: float = 30.0,
                 api_key: str | None = None, body_paths: frozenset[str] | None = None,
                 max_header_bytes: int | None = None) -> None:
        self.app = app
        # h11 bounds headers that arrive in pieces; a whole header block in one read passes
        # its check, so the parsed headers are measured again here
        self.max_header_bytes = max_header_bytes
        self.metrics = metrics
        self.max_body = max_body_bytes
        self.draining = draining
        self.body_timeout = body_timeout_s
        self.api_key = api_key
        # where a body without the key is refused before it is read; None: every path.
        # Elsewhere the router answers (405 for a method a route lacks, 404).
        self.body_paths = body_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        # the HTTP protocol names the request when its own 400 answers it (app.http11)
        rid = state.get("request_id") or uuid.uuid4().hex
        headers = Headers(scope=scope)
        client_id = headers.get(REQUEST_ID, "")
        correlation = client_id if CLIENT_ID.match(client_id) else None
        # `arrived`: where the request's `timings_ms.read` starts (app.serving)
        state.update(request_id=rid, late=self.draining(), batch_size=None,
                     arrived=time.monotonic())
        t0 = time.perf_counter()
        status = 500
        started = False
        length = headers.get("content-length")
        declared = "transfer-encoding" in headers or \
            (length is not None and length.strip("0") != "")

        async def send_with_ids(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                h = MutableHeaders(scope=message)
                h[REQUEST_ID] = rid
                if correlation:
                    h[CORRELATION_ID] = correlation
                if declared and not body_done:
                    # answered before the declared body was read (a refusal, a route that
                    # takes none): the server would keep reading and discarding it for as
                    # long as the client trickles it, so the connection closes instead
                    h["Connection"] = "close"
            try:
                await send(message)
            except (OSError, RuntimeError) as e:
                # the transport is closed (a client gone unnoticed, e.g. while a pipelined
                # request paused reading): the client's doing, not a server fault. Other
                # RuntimeErrors (a wrong message order) stay server errors.
                if isinstance(e, RuntimeError) and "closed" not in str(e):
                    raise
                raise ClientDisconnect() from e

        received = 0
        body_done = False
        max_body = min(self.max_body, SMALL_BODY_BYTES) \
            if scope.get("path") in SMALL_BODY_PATHS else self.max_body
        precheck = False      # refused here, before routing: labelled apart from 404s
        deadline = time.monotonic() + self.body_timeout

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:     # later reads wait for a disconnect: no deadline on those
                return await receive()
            try:
                # a slow-loris body must not hold a connection (and a worker) forever
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                # Retry-After: a body that never came may come on a second try (a
                # client's slow link, or a load balancer that re-routed the request
                # without its body); clients retry a 408 only when it says so
                raise HTTPException(408, f"request body not received within "
                                         f"{self.body_timeout:g} s",
                                    headers={"Retry-After": "1"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    raise HTTPException(413, f"body over the limit of {max_body} bytes")
                body_done = not message.get("more_body", False)
            return message

        async def checked_json() -> Receive | None:
            """Read a JSON body whole, pre-check it off the event loop; the receive that
            replays it, or None when a 4xx has been sent."""
            nonlocal precheck
            chunks = []
            try:
                while not body_done:
                    message = await limited_receive()
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    chunks.append(message.get("body", b""))
            except HTTPException as e:
                precheck = True
                await error_response(e.status_code, e.detail, rid, dict(e.headers or {}))(
                    scope, receive, send_with_ids)
                return None
            body = b"".join(chunks)
            problem = await run_in_threadpool(json_problem, body)
            if problem:
                precheck = True
                await error_response(422, problem, rid)(scope, receive, send_with_ids)
                return None
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return replay

        try:
            credentials = headers.getlist("authorization")
            authorized = not self.api_key or \
                (len(credentials) == 1 and bearer_matches(credentials[0], self.api_key))
            # each header as parsed, "name: value" and CRLF (h11 has dropped the blanks
            # around a value): by name and value alone, 16,000 empty headers passed 16 KiB
            head = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            # the request line too: h11 bounds it only while it arrives in pieces, so a
            # 60 KB URL, or a 120 KB method, sent in one read reached the app
            line = _request_line_bytes(scope)
            if length is not None and "transfer-encoding" in headers:
                # two framings (RFC 9112 6.1): a proxy that reads the other one would take
                # the rest of this body for a second request; refused, connection closed.
                # First: any other refusal (a 431) would leave the connection open
                precheck = True
                await error_response(400, "send Content-Length or Transfer-Encoding, not "
                                          "both", rid, {"Connection": "close"})(
                    scope, receive, send_with_ids)
            elif self.max_header_bytes is not None and head + line > self.max_header_bytes:
                precheck = True
                # the larger part names the status: 12 bytes of URL beside 16 KB of
                # headers is not a "URI too long"
                too_long = (414, "request line and headers") if line > head else \
                    (431, "request headers" if head > self.max_header_bytes
                     else "request line and headers")
                await error_response(too_long[0], f"{too_long[1]} over "
                                     f"{self.max_header_bytes} bytes", rid)(
                    scope, receive, send_with_ids)
            elif scope.get("method") in BODY_METHODS and not authorized and \
                    (self.body_paths is None or scope.get("path") in self.body_paths):
                # every route that takes a body needs the key: refused before a byte of the
                # body is read or its size is judged (the routes check the key again)
                precheck = True
                # two copies: the routes' 400 (app.deps.one_header), whichever copy is right
                refusal = RepeatedHeader("Authorization") if len(credentials) > 1 \
                    else Unauthorized()
                await error_response(refusal.status, refusal.detail, rid, dict(refusal.headers))(
                    scope, receive, send_with_ids)
            elif length is not None and authorized and \
                    (not length.isdigit() or int(length) > max_body):
                # refused before a byte of the body is read; without the key the router
                # answers (404, 405, 401) and reads nothing, so a 413 cannot tell an
                # unauthenticated client the limits
                precheck = True
                await error_response(413, f"body over the limit of {max_body} bytes",
                                     rid)(scope, receive, send_with_ids)
            elif scope.get("method") in BODY_METHODS and _is_json(headers) and \
                    (self.body_paths is None or scope.get("path") in self.body_paths):
                replay = await checked_json()
                if replay is not None:
                    await self.app(scope, replay, send_with_ids)
            else:
                await self.app(scope, limited_receive, send_with_ids)
        except ClientDisconnect:
            # the client's own abort: not a server fault, so no 5xx in the metrics
            status = CLIENT_CLOSED
            precheck = True   # labelled by its route when it had one
            if not state.get("parser_answered"):      # then it was the parser's 400
                log.info(json.dumps({"request_id": rid, "event": "client_disconnected"}))
        except Exception as e:
            log.error(json.dumps({"request_id": rid, "event": "unhandled",
                                  "error": type(e).__name__, "at": failure_site(e)}))
            if not started:
                await error_response(500, "internal error", rid)(scope, receive,
                                                                 send_with_ids)
        finally:
            if state.get("parser_answered"):
                # the body broke the framing: the HTTP parser's 400 went out, not the app's
                status, precheck = 400, True
            took = time.perf_counter() - t0
            route = getattr(scope.get("route"), "path",
                            "precheck" if precheck else "unmatched")
            self.metrics.request_duration.labels(route).observe(took)
            self.metrics.requests.labels(route, str(status)).inc()
            # Never image bytes, question text or the client's own id: patient data.
            log.info(json.dumps({"request_id": rid, "route": route,
                                 "method": _logged_method(scope.get("method")),
                                 "status": status,
                                 "latency_ms": round(took * 1000, 2),
                                 "batch_size": state.get("batch_size")}))
