"""The request middleware driven as plain ASGI, no model (mutation gaps of app/middleware.py):
the JSON pre-check's bounds and its scan's cost, the refusals before routing and their
order, the ids on a response, the body limit and deadline, a client gone, an unexpected
error, what the metrics and the access log record, and the path an absolute-form request
target is routed by."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
import sys
import time
from types import SimpleNamespace
from urllib.parse import unquote

import pytest
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect

from app import middleware
from app.metrics import Metrics
from app.middleware import (
    CLIENT_CLOSED,
    MAX_JSON_NODES,
    OriginForm,
    RequestContext,
    bearer_matches,
    body_paths,
    json_problem,
    long_number,
    routed_path,
)

LIMIT = sys.get_int_max_str_digits()


# ------------------------------------------------------------------ JSON pre-check
# The tokens as one regex reads them (what the windowed scan replaced): a whole string,
# escapes included, -1 as the end of one that never closes, or a structural character.
_REFERENCE = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(")?|[][{}:,]', re.S)


def _reference_tokens(body: bytes) -> list[tuple[int, int]]:
    out = []
    for m in _REFERENCE.finditer(body):
        unclosed = body[m.start()] == ord('"') and m.group(1) is None
        out.append((m.start(), -1 if unclosed else m.end()))
        if unclosed:
            break
    return out


@pytest.mark.parametrize("window", [1, 2, 3, 7, 1 << 18])
def test_the_windowed_token_scan_reads_what_one_regex_reads(monkeypatch, window):
    # tiny windows cut strings, escapes and gaps at every place a real one could
    monkeypatch.setattr(middleware, "WINDOW", window)
    rng = random.Random(window)
    for _ in range(3000):
        body = bytes(rng.choice(b'"\\[]{}:, a1') for _ in range(rng.randint(0, 40)))
        assert list(middleware._tokens(body)) == _reference_tokens(body), body


# The scan's cost: a string's end is a search for its closing quote, and the escape regex
# (which holds the GIL for a whole call) runs only from a backslash, a window at a time.
_ESCAPED = middleware._ESCAPED


class _RecordedRegex:
    """`_ESCAPED` with each call's span recorded: (where it started, where it stopped)."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []

    def match(self, body: bytes, pos: int, *endpos: int) -> re.Match:
        m = _ESCAPED.match(body, pos, *endpos)
        self.spans.append((pos, m.end()))
        return m


def test_only_strings_with_an_escape_go_through_the_regex(monkeypatch):
    regex = _RecordedRegex()
    monkeypatch.setattr(middleware, "_ESCAPED", regex)
    # (body, strings with a backslash before their closing quote)
    for body, escaped in ((b'"plain"', 0),                       # a string at the very start
                          (b'{"a": "b", "c": ["d"]}', 0),         # no backslash anywhere
                          (b'["\\n", "plain", "x"]', 1),        # one before the plain strings
                          (b'["plain", "\\n"]', 1),             # one after a plain string
                          (b'{"a\\"b": 1}', 1)):
        regex.spans.clear()
        assert list(middleware._tokens(body)) == _reference_tokens(body), body
        assert len(regex.spans) == escaped, (body, regex.spans)


def test_no_one_regex_call_scans_more_than_a_window(monkeypatch):
    monkeypatch.setattr(middleware, "WINDOW", 8)
    regex = _RecordedRegex()
    monkeypatch.setattr(middleware, "_ESCAPED", regex)
    body = b'["' + b"\\n" * 40 + b'x", 1]'
    assert list(middleware._tokens(body)) == _reference_tokens(body)
    assert len(regex.spans) >= 10
    assert all(stop - start <= 8 for start, stop in regex.spans), regex.spans


class _CountedSlices(bytes):
    """A body that counts the bytes its slices copy: the scan marks a copy of each window."""

    copied = 0

    def __getitem__(self, key):
        part = super().__getitem__(key)
        if isinstance(key, slice):
            type(self).copied += len(part)
        return part


@pytest.mark.parametrize("window", [16, 1 << 18])
def test_the_token_scan_marks_each_byte_at_most_once(monkeypatch, window):
    monkeypatch.setattr(middleware, "WINDOW", window)
    raw = b"[" + b'"ab", 1, ' * 300 + b'"\\u0071", {"k": [2]}]'
    body = _CountedSlices(raw)
    _CountedSlices.copied = 0
    assert list(middleware._tokens(body)) == _reference_tokens(raw)
    assert 0 < _CountedSlices.copied <= len(raw)


class _CountedFinds(bytes):
    """A body that counts the bytes its backslash look-ups read (to the byte found, or to
    the end of the range searched)."""

    read = 0

    def find(self, sub, start=0, end=None):
        at = super().find(sub, start, end)
        if sub == b"\\":
            stop = len(self) if end is None else end
            type(self).read += (at + 1 if at >= 0 else stop) - start
        return at


def test_the_backslash_look_ups_read_each_string_only():
    """Many short strings, then a long run of blanks and one escape at the end: each
    string's backslash look-up stops at its own quote, so the scan reads the body about
    once, not once per string (a body within every bound, thousands of short strings in
    nested containers and 30 MB of blanks, cost 6.7 s of a worker thread when each
    look-up ran to the distant backslash)."""
    raw = b"[" + b'"ab", ' * 2000 + b" " * 100_000 + b'"\\n"]'
    body = _CountedFinds(raw)
    _CountedFinds.read = 0
    assert list(middleware._tokens(body)) == _reference_tokens(raw)
    assert 0 < _CountedFinds.read <= len(raw)


def test_a_long_number_across_a_window_edge_is_found(monkeypatch):
    monkeypatch.setattr(middleware, "WINDOW", 1000)
    for lead in range(0, 1001, 250):
        gap = b" " * lead + b"5" * (LIMIT + 1)
        assert long_number(gap), lead
        assert not long_number(b" " * lead + b"5" * LIMIT + b" 5")


def test_long_number_is_more_digits_than_python_converts():
    assert not long_number(b"1" * LIMIT)
    assert long_number(b"1" * (LIMIT + 1))
    assert long_number(b" , " + b"7" * (LIMIT + 1) + b" ")
    assert not long_number(b"1" * LIMIT + b" " + b"1" * LIMIT)   # two numbers, each fine
    assert not long_number(b"x" * (LIMIT + 1))                     # not digits
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)                                  # 0: Python has no limit
    try:
        assert not long_number(b"1" * (LIMIT + 1))
    finally:
        sys.set_int_max_str_digits(old)


def test_a_long_number_is_found_between_tokens_and_at_the_end():
    n = b"9" * (LIMIT + 1)
    for body in (b'{"a": ' + n + b"}", b"[1, " + n + b", 2]", b"[" + n, n):
        assert json_problem(body) == f"body: a number has more than {LIMIT} digits"
    # digits inside a string are text, not a number
    assert json_problem(json.dumps({"a": "1" * (LIMIT + 1), "b": 2}).encode()) is None
    ok = b"9" * LIMIT
    assert json_problem(b'{"a": ' + ok + b', "b": ' + ok + b"}") is None
    assert json_problem(b"[" + ok) is None


def _lists(sizes: list[int]) -> bytes:
    return json.dumps([[0] * s for s in sizes]).encode()


def test_values_are_counted_up_to_the_bound():
    # values = separators inside containers: sum(s - 1) inside, len - 1 between
    at = [256] * 16 + [2]                # 16 * 255 + 1 + 16 = 4097
    assert sum(s - 1 for s in at) + len(at) - 1 == MAX_JSON_NODES + 1
    assert json_problem(_lists(at)) == f"body: more than {MAX_JSON_NODES} values"
    below = [256] * 16 + [1]             # 4096
    assert json_problem(_lists(below)) is None


def test_object_and_list_bounds_by_hand():
    def obj(n: int) -> bytes:
        return json.dumps({f"k{i}": 1 for i in range(n)}).encode()

    assert json_problem(obj(32)) is None
    assert json_problem(obj(33)) == "body: an object has more than 32 fields"
    assert json_problem(json.dumps([0] * 256).encode()) is None
    assert json_problem(json.dumps([0] * 257).encode()) == "body: a list has more than 256 items"
    # commas count in a list, colons in an object: 300 commas in one object are fine
    assert json_problem(json.dumps({"a": 1, "b": [0] * 200}).encode()) is None
    assert json_problem(b"[" * 16 + b"]" * 16) is None
    assert json_problem(b"[" * 17 + b"]" * 17) == "body: nested deeper than 16 levels"
    assert json_problem(b"{" * 17) == "body: nested deeper than 16 levels"
    # a closed container no longer counts towards the depth
    assert json_problem((b"[" * 15 + b"]" * 15 + b",") * 3) is None
    # a stray closer at the top level is left to the parser
    assert json_problem(b"]]}") is None
    assert json_problem(b"]" + b"[" * 16) is None


def test_duplicate_keys_as_the_parser_reads_them():
    assert json_problem(b'{"q": 1, "q": 2}') == "body: an object has a duplicate key"
    assert json_problem(b'{"q": 1, "\\u0071": 2}') == "body: an object has a duplicate key"
    assert json_problem(b'{"q": 1, "r": {"q": 2}}') is None      # another object
    assert json_problem(b'{"a": "q", "q": 1}') is None           # a value is not a key
    assert json_problem(b'{"\\x": 1, "y": 2}') is None           # invalid escape: parser's
    assert json_problem(b'{"a\\"b": 1, "a\\"b": 2}') == "body: an object has a duplicate key"
    assert json_problem('{"é": 1, "e": 2}'.encode()) is None


def test_nul_bytes_and_unclosed_strings():
    assert json_problem(b'{"a": 1}\x00') == "body: JSON must be UTF-8 text"
    assert json_problem(b'{"a": 1}') is None
    assert json_problem(b"") is None


def test_bytes_that_are_not_utf8_are_refused_wherever_they_are():
    utf8 = "body: JSON must be UTF-8 text"
    for body in (b'{"\xff": 1, "a": 2}', b'{"\xff\\n": 1}', b'{"a": "\xc3"}', b'{"a": 1}\xe2\x82',
                 b'{"a": "' + b"x" * (3 * middleware.WINDOW) + b'\xff"}', "é".encode("latin-1")):
        assert json_problem(body) == utf8
    # a character cut in two by a window's end is still one character: the window ends at
    # each of the 9 bytes of "€😀é" in turn (7 bytes of `{"a": "` come before them)
    for cut in range(10):
        text = " " * (middleware.WINDOW - 7 - cut) + '{"a": "\u20ac\U0001f600é"}'
        assert json_problem(text.encode()) is None
    assert json_problem(b'{"a": "x') is None
    # a colon before any key is invalid JSON, left to the parser
    assert json_problem(b'{:1}') is None
    # after an unclosed string nothing more is checked
    assert json_problem(b'["' + b"[" * 40) is None


def test_bearer_matches_any_case_of_the_scheme_only():
    assert bearer_matches("Bearer k1", "k1")
    assert bearer_matches("bEARER k1", "k1")
    assert not bearer_matches("Basic k1", "k1")
    assert not bearer_matches("k1", "k1")
    assert not bearer_matches("Bearer k2", "k1")
    # another scheme never matches, even with the key itself as its token
    assert not bearer_matches("Basic XXXX", "XXXX")
    # the scheme ends at the first space, as FastAPI's HTTPBearer splits it
    assert bearer_matches("Bearer a b", "a b")
    assert not bearer_matches("Bearer a b", "b")


# ------------------------------------------------------------------ the middleware
def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        return {"n": len(body), "state": {k: request.state._state.get(k)
                                          for k in ("request_id", "late", "batch_size")}}

    @app.put("/put")
    async def put(request: Request) -> dict:
        return {"n": len(await request.body())}

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.get("/boom")
    async def boom() -> dict:
        raise KeyError("x")

    return app


def _call(mw: RequestContext, method: str = "GET", path: str = "/ok",
          headers: dict[str, str] | list[tuple[str, str]] | None = None,
          body: list[bytes] | None = None,
          receive=None, send_error: BaseException | None = None,
          state: dict | None = None) -> dict:
    chunks = list(body or [])
    sent: list[dict] = []

    async def default_receive() -> dict:
        if chunks:
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if send_error is not None and message["type"] == "http.response.start":
            raise send_error
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "server": ("t", 80), "client": ("c", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         (headers.items() if isinstance(headers, dict) else headers or [])]}
    if state is not None:
        scope["state"] = state
    asyncio.run(mw(scope, receive or default_receive, send))
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"start": start, "status": start and start["status"], "scope": scope,
            "headers": dict((k.decode(), v.decode()) for k, v in start["headers"])
            if start else {}, "json": json.loads(payload) if payload else None}


def _mw(app=None, metrics: Metrics | None = None, **kw) -> RequestContext:
    app = app or _app()
    kw.setdefault("max_body_bytes", 100)
    return RequestContext(app, metrics or Metrics(), draining=kw.pop("draining", lambda: False),
                          **kw)


def _count(metrics: Metrics, route: str, status: int) -> float | None:
    return metrics.registry.get_sample_value("dualread_requests_total",
                                             {"route": route, "status": str(status)})


def test_ids_on_every_response_and_the_state_a_route_sees():
    m = Metrics()
    mw = _mw(metrics=m, draining=lambda: True)
    r = _call(mw, "POST", "/echo", {"content-type": "text/plain", "x-request-id": "abc.D-1:2"},
              [b"hello"])
    assert r["status"] == 200
    rid = r["headers"]["x-request-id"]
    assert len(rid) == 32 and rid != "abc.D-1:2"          # the server's own, not the client's
    assert r["headers"]["x-correlation-id"] == "abc.D-1:2"
    assert r["json"] == {"n": 5, "state": {"request_id": rid, "late": True, "batch_size": None}}
    assert _count(m, "/echo", 200) == 1
    assert m.registry.get_sample_value("dualread_request_duration_seconds_count",
                                       {"route": "/echo"}) == 1
    # a client id that is not a plain bounded token is not echoed
    for bad in ("a" * 65, "a b", "a/b", ""):
        r = _call(mw, headers={"x-request-id": bad})
        assert r["status"] == 200 and "x-correlation-id" not in r["headers"]
    assert _call(mw, headers={"x-request-id": "a" * 64})["headers"]["x-correlation-id"] == \
        "a" * 64
    assert _call(_mw())["json"] is not None


def test_other_scopes_pass_through_untouched():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope)

    mw = _mw(app=app)
    asyncio.run(mw({"type": "lifespan"}, None, None))
    assert seen == [{"type": "lifespan"}]


def test_headers_over_the_bound_are_431_and_at_the_bound_pass():
    m = Metrics()
    # "x-a: " + 20 bytes + CRLF = 27 bytes; the request line "GET /ok HTTP/1.1" + CRLF, 18
    h = {"x-a": "b" * 20}
    assert _call(_mw(metrics=m, max_header_bytes=45), headers=h)["status"] == 200
    r = _call(_mw(metrics=m, max_header_bytes=26), headers=h)
    assert r["status"] == 431
    assert r["json"]["detail"] == "request headers over 26 bytes"
    assert r["json"]["request_id"] == r["headers"]["x-request-id"]
    # the headers within the bound, the line with them over it: the headers are the most
    r = _call(_mw(metrics=m, max_header_bytes=44), headers=h)
    assert r["status"] == 431
    assert r["json"]["detail"] == "request line and headers over 44 bytes"
    # a line longer than the headers: 414 ("GET /" + 40 bytes + " HTTP/1.1" + CRLF = 56)
    path = "/" + "a" * 40
    assert _call(_mw(metrics=m, max_header_bytes=83), path=path, headers=h)["status"] != 414
    r = _call(_mw(metrics=m, max_header_bytes=82), path=path, headers=h)
    assert r["status"] == 414
    assert r["json"]["detail"] == "request line and headers over 82 bytes"
    # the method is the line's too (40 bytes of it, sent in one read, reached the app)
    r = _call(_mw(metrics=m, max_header_bytes=81), method="X" * 40, headers=h)
    assert r["status"] == 414
    assert _call(_mw(metrics=m, max_header_bytes=82), method="X" * 40,
                 headers=h)["status"] not in (414, 431)
    assert _count(m, "precheck", 431) == 2 and _count(m, "precheck", 414) == 2
    assert _count(m, "/ok", 200) == 1
    assert _call(_mw(max_header_bytes=None), headers=h)["status"] == 200


def test_a_query_counts_with_its_question_mark():
    """"GET /ok?ab HTTP/1.1" + CRLF: 21 bytes."""
    from app.middleware import _request_line_bytes

    scope = {"method": "GET", "raw_path": b"/ok", "query_string": b"ab"}
    assert _request_line_bytes(scope) == len(b"GET /ok?ab HTTP/1.1\r\n") == 21
    assert _request_line_bytes({**scope, "query_string": b""}) == len(b"GET /ok HTTP/1.1\r\n")


@pytest.mark.parametrize("method, logged", [("GET", "GET"), ("PATCH", "PATCH"),
                                            ("OPTIONS", "OPTIONS"), ("get", "OTHER"),
                                            ("SECRET-PATIENT-NAME", "OTHER"), (None, "OTHER")])
def test_the_access_log_writes_only_http_s_own_methods(method, logged):
    """Any other token is the client's text (a name, or 120 KB of it): never logged."""
    from app.middleware import _logged_method

    assert _logged_method(method) == logged


def test_an_unknown_method_is_logged_as_other():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    lg = logging.getLogger("dualread.access")
    level = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        _call(_mw(), method="SECRET-PATIENT-NAME")
        _call(_mw(), method="GET")
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
    assert [json.loads(r.getMessage())["method"] for r in records] == ["OTHER", "GET"]


def test_a_body_without_the_key_is_refused_before_it_is_read():
    reads = []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    paths = body_paths(_app())
    assert paths == {"/echo", "/put"}
    m = Metrics()
    mw = _mw(metrics=m, api_key="k1", body_paths=paths)
    json_h = {"content-type": "application/json"}
    r = _call(mw, "POST", "/echo", json_h, receive=receive)
    assert r["status"] == 401 and reads == []
    assert r["headers"]["www-authenticate"] == "Bearer"
    assert r["json"]["detail"] == "missing or invalid credentials"
    assert _count(m, "precheck", 401) == 1
    assert _call(mw, "PUT", "/put", json_h, receive=receive)["status"] == 401
    ok = _call(mw, "POST", "/echo", {**json_h, "authorization": "bearer k1"}, receive=receive)
    assert ok["status"] == 200 and reads == [1]
    # no body: the routes decide; a path that takes no body: the router answers (405)
    assert _call(mw, "GET", "/ok")["status"] == 200
    assert _call(mw, "POST", "/ok", json_h, receive=receive)["status"] == 405
    # without the list of paths every body needs the key; without a key none does
    assert _call(_mw(api_key="k1"), "POST", "/ok", json_h, receive=receive)["status"] == 401
    assert _call(_mw(), "POST", "/echo", json_h, receive=receive)["status"] == 200


def test_declared_length_over_the_limit_or_not_a_number_is_413_unread():
    m = Metrics()
    mw = _mw(metrics=m, max_body_bytes=10)
    for length in ("11", "-1", "1e3", "ten"):
        r = _call(mw, "POST", "/echo", {"content-length": length, "content-type": "text/plain"},
                  [b"x" * 5])
        assert r["status"] == 413, length
        assert r["json"]["detail"] == "body over the limit of 10 bytes"
    assert _count(m, "precheck", 413) == 4
    r = _call(mw, "POST", "/echo", {"content-length": "10", "content-type": "text/plain"},
              [b"x" * 10])
    assert r["status"] == 200 and r["json"]["n"] == 10


@pytest.mark.parametrize("ctype", ["text/plain", "application/json"])
def test_a_streamed_body_over_the_limit_is_413(ctype):
    m = Metrics()
    mw = _mw(metrics=m, max_body_bytes=10)
    r = _call(mw, "POST", "/echo", {"content-type": ctype}, [b"[1,", b"2,3,4,5,", b"6]"])
    assert r["status"] == 413
    assert r["json"]["detail"] == "body over the limit of 10 bytes"
    # exactly at the limit, in pieces
    r = _call(mw, "POST", "/echo", {"content-type": ctype}, [b"[1,2", b",3,45]"])
    assert r["status"] == 200 and r["json"]["n"] == 10


@pytest.mark.parametrize("ctype", ["application/json", "application/problem+json",
                                   "Application/JSON; charset=utf-8"])
def test_a_json_body_is_prechecked_and_replayed_whole(ctype):
    m = Metrics()
    mw = _mw(metrics=m, max_body_bytes=10_000)
    bad = json.dumps({f"k{i}": 1 for i in range(33)}).encode()
    r = _call(mw, "POST", "/echo", {"content-type": ctype}, [bad[:50], bad[50:]])
    assert r["status"] == 422
    assert r["json"]["detail"] == "body: an object has more than 32 fields"
    assert _count(m, "precheck", 422) == 1
    good = json.dumps({f"k{i}": 1 for i in range(32)}).encode()
    r = _call(mw, "POST", "/echo", {"content-type": ctype}, [good[:50], good[50:]])
    assert r["status"] == 200 and r["json"]["n"] == len(good)


def test_only_json_bodies_on_body_paths_are_prechecked():
    bad = json.dumps({f"k{i}": 1 for i in range(33)}).encode()
    # text, or a path outside the body paths: passed on unchecked
    assert _call(_mw(max_body_bytes=10_000), "POST", "/echo", {"content-type": "text/plain"},
                 [bad])["status"] == 200
    assert _call(_mw(max_body_bytes=10_000), "POST", "/echo",
                 {"content-type": "application/jsonx"}, [bad])["status"] == 200
    mw = _mw(max_body_bytes=10_000, body_paths=frozenset({"/put"}))
    assert _call(mw, "POST", "/echo", {"content-type": "application/json"}, [bad])["status"] \
        == 200
    assert _call(mw, "PUT", "/put", {"content-type": "application/json"}, [bad])["status"] \
        == 422


def test_after_the_replayed_body_reads_wait_for_the_disconnect():
    got = []

    async def app(scope, receive, send):
        got.append(await receive())
        got.append(await receive())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    msgs = [{"type": "http.request", "body": b"[1]", "more_body": False},
            {"type": "http.disconnect"}]

    async def receive():
        return msgs.pop(0)

    r = _call(_mw(app=app), "POST", "/x", {"content-type": "application/json"}, receive=receive)
    assert r["status"] == 204
    assert got == [{"type": "http.request", "body": b"[1]", "more_body": False},
                   {"type": "http.disconnect"}]


def test_a_plain_body_read_after_its_end_has_no_deadline():
    got = []

    async def app(scope, receive, send):
        got.append(await receive())
        got.append(await receive())        # past the deadline: waits for the disconnect
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        if not got:
            return {"type": "http.request", "body": b"ab", "more_body": False}
        await asyncio.sleep(0.15)
        return {"type": "http.disconnect"}

    r = _call(_mw(app=app, body_timeout_s=0.05), "POST", "/x", {"content-type": "text/plain"},
              receive=receive)
    assert r["status"] == 204 and got[1] == {"type": "http.disconnect"}


@pytest.mark.parametrize("ctype", ["text/plain", "application/json"])
def test_a_body_that_never_comes_is_408_with_retry_after(ctype):
    m = Metrics()
    r = _call(_mw(metrics=m, body_timeout_s=0.05), "POST", "/echo", {"content-type": ctype})
    assert r["status"] == 408
    assert r["headers"]["retry-after"] == "1"
    assert r["json"]["detail"] == "request body not received within 0.05 s"


def test_a_client_gone_is_499_not_a_server_error(caplog):
    async def receive():
        return {"type": "http.disconnect"}

    m = Metrics()
    caplog.set_level(logging.INFO, "dualread.access")
    r = _call(_mw(metrics=m), "POST", "/echo", {"content-type": "application/json"},
              receive=receive)
    assert r["start"] is None
    assert _count(m, "precheck", CLIENT_CLOSED) == 1
    events = [json.loads(x.getMessage()) for x in caplog.records]
    assert events[0] == {"request_id": events[1]["request_id"], "event": "client_disconnected"}
    assert events[1]["status"] == 499 and events[1]["route"] == "precheck"


@pytest.mark.parametrize("error", [OSError("reset"), RuntimeError("transport closed"),
                                   ClientDisconnect()])
def test_a_reply_to_a_closed_transport_counts_as_the_client_gone(error):
    m = Metrics()
    r = _call(_mw(metrics=m), send_error=error)
    assert r["start"] is None
    # labelled by its route, which the router had set
    assert _count(m, "/ok", 499) == 1 and _count(m, "/ok", 500) is None


def test_other_send_errors_and_unexpected_errors_are_a_json_500(caplog):
    async def boom(scope, receive, send):
        raise KeyError("client text")

    caplog.set_level(logging.INFO, "dualread.access")
    m = Metrics()
    r = _call(_mw(app=boom, metrics=m), "GET", "/boom")
    assert r["status"] == 500
    assert r["json"] == {"detail": "internal error", "request_id": r["headers"]["x-request-id"]}
    assert _count(m, "unmatched", 500) == 1
    logged = [json.loads(x.getMessage()) for x in caplog.records]
    failed = next(x for x in logged if x.get("event") == "unhandled")
    assert {k: failed[k] for k in ("request_id", "event", "error")} == \
        {"request_id": r["headers"]["x-request-id"], "event": "unhandled", "error": "KeyError"}
    # where it failed, innermost last (this test's `boom`), without the exception's text
    assert failed["at"][-1].startswith("tests/test_mutation_gaps_middleware.py:")
    assert failed["at"][-1].endswith(" boom") and len(failed["at"]) <= 8
    assert "client text" not in json.dumps(logged)
    done = logged[-1]
    assert done == {"request_id": r["headers"]["x-request-id"], "route": "unmatched",
                    "method": "GET", "status": 500, "latency_ms": done["latency_ms"],
                    "batch_size": None}
    assert 0 <= done["latency_ms"] < 10_000
    # a wrong message order is a server fault, not a client gone: logged as unhandled, and
    # no second reply is started over the first
    caplog.clear()
    m = Metrics()
    r = _call(_mw(metrics=m), send_error=RuntimeError("Unexpected message"))
    assert r["start"] is None and _count(m, "/ok", 499) is None
    assert _count(m, "/ok", 200) == 1
    assert "RuntimeError" in [json.loads(x.getMessage()).get("error") for x in caplog.records]


def test_an_error_after_the_reply_started_sends_nothing_more():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise ValueError("late")

    m = Metrics()
    r = _call(_mw(app=app, metrics=m))
    assert r["status"] == 200 and r["json"] is None
    assert _count(m, "unmatched", 200) == 1


def test_unrouted_requests_are_labelled_unmatched():
    m = Metrics()
    assert _call(_mw(metrics=m), "GET", "/nowhere")["status"] == 404
    assert _count(m, "unmatched", 404) == 1


def test_a_body_without_a_content_type_is_passed_on_unchecked():
    r = _call(_mw(), "POST", "/echo", {}, [b"{}"])
    assert r["status"] == 200 and r["json"]["n"] == 2


# ------------------------------------------------------------------ RequestContext.__call__
SMALL = ["/feedback", "/calibration/pin", "/calibration/unpin", "/calibration/rollback",
         "/calibration/window/reset"]


def _sink() -> FastAPI:
    """Routes that read the whole body and answer its length (FastAPI turns the
    middleware's 413 raised inside a read into the JSON reply, as in the service)."""
    app = FastAPI()

    async def length(request: Request) -> dict:
        return {"n": len(await request.body())}

    for path in [*SMALL, "/answer", "/feedbackx", "/calibration"]:
        app.add_api_route(path, length, methods=["POST"])
    return app


def test_no_client_id_sent_means_no_correlation_id():
    r = _call(_mw())
    assert r["status"] == 200 and "x-correlation-id" not in r["headers"]


def test_other_scopes_get_the_servers_own_receive_and_send():
    got = []

    async def app(scope, receive, send):
        got.append((scope, receive, send))

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        pass

    scope = {"type": "lifespan"}
    asyncio.run(_mw(app=app)(scope, receive, send))
    assert len(got) == 1
    assert got[0][0] is scope and got[0][1] is receive and got[0][2] is send


def test_each_request_state_starts_fresh_and_the_log_reads_the_routes_batch_size(caplog):
    seen = []

    async def app(scope, receive, send):
        seen.append(dict(scope["state"]))
        scope["state"]["batch_size"] = 8          # as the answering routes do
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    caplog.set_level(logging.INFO, "dualread.access")
    # a server copies the lifespan's state into each request's scope: a per-request field
    # found there is not this request's
    r = _call(_mw(app=app), state={"batch_size": 5, "shared": "kept"})
    assert r["status"] == 204
    assert len(seen) == 1
    arrived = seen[0].pop("arrived")             # the request's clock start (timings' `read`)
    assert isinstance(arrived, float)
    assert seen == [{"batch_size": None, "shared": "kept", "late": False,
                     "request_id": r["headers"]["x-request-id"]}]
    assert json.loads(caplog.records[-1].getMessage())["batch_size"] == 8


def test_an_app_that_never_replies_is_counted_as_a_server_error(caplog):
    async def silent(scope, receive, send):
        return None

    caplog.set_level(logging.INFO, "dualread.access")
    m = Metrics()
    r = _call(_mw(app=silent, metrics=m))
    assert r["start"] is None
    assert _count(m, "unmatched", 500) == 1
    assert json.loads(caplog.records[-1].getMessage())["status"] == 500


@pytest.mark.parametrize("path", SMALL)
def test_the_small_body_routes_refuse_more_than_16_kib(path):
    mw = _mw(app=_sink(), max_body_bytes=20_000)
    text = {"content-type": "text/plain"}
    r = _call(mw, "POST", path, text, [b"x" * 16_000, b"x" * 385])
    assert r["status"] == 413
    assert r["json"]["detail"] == "body over the limit of 16384 bytes"
    r = _call(mw, "POST", path, {**text, "content-length": "16385"}, [b"x" * 16_385])
    assert r["status"] == 413
    assert r["json"]["detail"] == "body over the limit of 16384 bytes"
    r = _call(mw, "POST", path, text, [b"x" * 16_000, b"x" * 384])
    assert r["status"] == 200 and r["json"] == {"n": 16_384}
    # the service's own limit when it is the smaller
    r = _call(_mw(app=_sink(), max_body_bytes=100), "POST", path, text, [b"x" * 101])
    assert r["json"]["detail"] == "body over the limit of 100 bytes"


def test_other_routes_keep_the_service_limit_above_16_kib():
    mw = _mw(app=_sink(), max_body_bytes=20_000)
    for path in ("/answer", "/feedbackx", "/calibration"):
        r = _call(mw, "POST", path, {"content-type": "text/plain"}, [b"x" * 20_000])
        assert r["status"] == 200 and r["json"] == {"n": 20_000}, path


def test_a_json_body_message_without_more_body_is_the_whole_body():
    reads = []

    async def receive():
        reads.append(1)
        if len(reads) == 1:
            return {"type": "http.request", "body": b"[1, 2]"}     # more_body: optional
        return {"type": "http.disconnect"}

    r = _call(_mw(), "POST", "/echo", {"content-type": "application/json"}, receive=receive)
    assert r["status"] == 200 and r["json"]["n"] == 6
    assert reads == [1]


def test_a_json_body_message_without_body_bytes_is_empty():
    msgs = [{"type": "http.request", "more_body": True},              # body: optional
            {"type": "http.request", "body": b"[1]", "more_body": False}]

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    r = _call(_mw(), "POST", "/echo", {"content-type": "application/json"}, receive=receive)
    assert r["status"] == 200 and r["json"]["n"] == 3


def test_a_client_gone_while_its_json_body_is_read_is_not_read_again():
    reads = []

    async def receive():
        reads.append(1)
        if len(reads) > 1:
            raise AssertionError("read after the disconnect")
        return {"type": "http.disconnect"}

    m = Metrics()
    r = _call(_mw(metrics=m), "POST", "/echo", {"content-type": "application/json"},
              receive=receive)
    assert r["start"] is None and reads == [1]
    assert _count(m, "precheck", CLIENT_CLOSED) == 1


def test_a_json_body_refused_while_it_is_read_is_labelled_precheck():
    m = Metrics()
    json_h = {"content-type": "application/json"}
    r = _call(_mw(metrics=m, max_body_bytes=10), "POST", "/echo", json_h, [b"[1,", b"2,3,4,5,6]"])
    assert r["status"] == 413
    r = _call(_mw(metrics=m, body_timeout_s=0.05), "POST", "/echo", json_h)
    assert r["status"] == 408
    assert _count(m, "precheck", 413) == 1 and _count(m, "precheck", 408) == 1
    assert _count(m, "unmatched", 413) is None and _count(m, "unmatched", 408) is None


def test_the_latency_in_the_access_log_and_the_histogram(monkeypatch, caplog):
    clock = itertools.chain([2.0], itertools.repeat(2.0123456))   # start, then end
    monkeypatch.setattr(middleware, "time", SimpleNamespace(
        perf_counter=lambda: next(clock), monotonic=time.monotonic))
    caplog.set_level(logging.INFO, "dualread.access")
    m = Metrics()
    assert _call(_mw(metrics=m))["status"] == 200
    assert json.loads(caplog.records[-1].getMessage())["latency_ms"] == 12.35
    assert m.registry.get_sample_value("dualread_request_duration_seconds_sum",
                                       {"route": "/ok"}) == pytest.approx(0.0123456)


def test_long_digits_counts_a_long_numbers_digits_exactly():
    """Only a number of more than 19 digits counts toward the body's total, with every
    digit of it, across the scan's windows too."""
    long_digits, short = middleware.long_digits, middleware.SHORT_NUMBER_DIGITS
    assert short == 19
    assert long_digits(b"") == 0 and long_digits(b"7") == 0
    assert long_digits(b"1" * 19) == 0
    assert long_digits(b" " + b"1" * 19) == 0          # a long gap, a short number
    assert long_digits(b" " * 30 + b"123") == 0
    assert long_digits(b"1" * 20) == 20
    assert long_digits(b"-0." + b"9" * 25) == 26        # the 0 is a digit too
    n = middleware.WINDOW + 5                           # a number over two windows
    assert long_digits(b"1" * n) == n


def test_long_numbers_may_hold_exactly_the_bound_together():
    """16,384 digits of long numbers together pass; one more is refused, by the total."""
    bound = middleware.MAX_LONG_DIGITS
    assert bound == 16384
    four = b"[" + b",".join([b"1" * 4096] * 4) + b"]"
    assert json_problem(four) is None
    assert json_problem(four[:-1] + b",12345678901234567890]") == (
        "body: its numbers of more than 19 digits have more than 16384 digits together")
    # short numbers never count, however many
    row = b"[" + b",".join([b"1" * 19] * 200) + b"]"
    assert json_problem(b"[" + b",".join([row] * 10) + b"]") is None     # 38,000 digits


# ------------------------------------------------------------------ a body left unread
def test_a_reply_before_the_declared_body_is_read_closes_the_connection():
    """A declared body (a length above 0, or chunked) the app answers without reading:
    the server would go on reading and discarding it, so the connection closes."""
    for framing in ({"content-length": "5"}, {"content-length": "10"},
                    {"content-length": "007"}, {"transfer-encoding": "chunked"}):
        r = _call(_mw(), "GET", "/ok", framing, [b"hello"])
        assert r["status"] == 200 and r["headers"]["connection"] == "close", framing
        # a refusal before the body: the 404, the pre-check's 401 and 413
        r = _call(_mw(), "POST", "/nowhere", framing, [b"hello"])
        assert r["status"] == 404 and r["headers"]["connection"] == "close", framing
        r = _call(_mw(api_key="k1"), "POST", "/echo", framing, [b"hello"])
        assert r["status"] == 401 and r["headers"]["connection"] == "close", framing
    r = _call(_mw(max_body_bytes=4), "POST", "/echo", {"content-length": "5"}, [b"hello"])
    assert r["status"] == 413 and r["headers"]["connection"] == "close"
    # a length that is not a number is a declared body too (refused unread)
    for length in ("X", "x", "1e3"):
        r = _call(_mw(), "POST", "/echo", {"content-length": length}, [b"hello"])
        assert r["status"] == 413 and r["headers"]["connection"] == "close", length


def test_no_body_or_a_body_read_whole_keeps_the_connection():
    for framing in ({}, {"content-length": "0"}, {"content-length": "00"},
                    {"content-length": "000"}):
        r = _call(_mw(), "GET", "/ok", framing)
        assert r["status"] == 200 and "connection" not in r["headers"], framing
    r = _call(_mw(), "POST", "/nowhere", {"content-length": "00"})
    assert r["status"] == 404 and "connection" not in r["headers"]
    # read whole, by the route or by the JSON pre-check (then refused or not)
    for ctype in ("text/plain", "application/json"):
        for framing in ({"content-length": "6"}, {"transfer-encoding": "chunked"}):
            r = _call(_mw(), "POST", "/echo", {"content-type": ctype, **framing},
                      [b"[1,", b"22]"])
            assert r["status"] == 200 and "connection" not in r["headers"], (ctype, framing)
    bad = json.dumps({f"k{i}": 1 for i in range(33)}).encode()
    r = _call(_mw(max_body_bytes=10_000), "POST", "/echo",
              {"content-type": "application/json", "content-length": str(len(bad))},
              [bad[:50], bad[50:]])
    assert r["status"] == 422 and "connection" not in r["headers"]


@pytest.mark.parametrize("ctype", ["text/plain", "application/json"])
@pytest.mark.parametrize("framing", [{"content-length": "8"}, {"transfer-encoding": "chunked"}])
def test_a_body_refused_part_way_closes_the_connection(ctype, framing):
    """The limit crossed by a later chunk: the body's rest is unread."""
    r = _call(_mw(max_body_bytes=10), "POST", "/echo", {"content-type": ctype, **framing},
              [b"[1,2,", b"3,4,5,6]", b"[]"])
    assert r["status"] == 413 and r["headers"]["connection"] == "close"
    assert r["json"]["detail"] == "body over the limit of 10 bytes"


# ------------------------------------------------------------------ two Authorization headers
@pytest.mark.parametrize("first, second", [("Bearer k1", "Bearer x"), ("Bearer x", "Bearer k1"),
                                           ("Bearer k1", "Bearer k1")])
def test_two_authorizations_are_one_400_before_the_body_whichever_is_right(first, second):
    reads = []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    m = Metrics()
    mw = _mw(metrics=m, api_key="k1", body_paths=frozenset({"/echo"}))
    twice = [("content-type", "application/json"), ("authorization", first),
             ("authorization", second)]
    r = _call(mw, "POST", "/echo", twice, receive=receive)
    assert r["status"] == 400 and reads == []
    assert r["json"] == {"detail": "send one Authorization header, not several",
                         "request_id": r["headers"]["x-request-id"]}
    assert "www-authenticate" not in r["headers"]
    assert _count(m, "precheck", 400) == 1
    # before the declared size is judged, too
    r = _call(mw, "POST", "/echo", [*twice, ("content-length", "1000")], receive=receive)
    assert r["status"] == 400 and reads == []
    # without a key to check, two copies are the routes' to judge
    assert _call(_mw(), "POST", "/echo", twice, receive=receive)["status"] == 200


def test_one_wrong_authorization_is_the_401_with_its_challenge():
    mw = _mw(api_key="k1", body_paths=frozenset({"/echo"}))
    for auth in ([("authorization", "Bearer x")], []):
        r = _call(mw, "POST", "/echo", [("content-type", "application/json"), *auth], [b"{}"])
        assert r["status"] == 401 and r["headers"]["www-authenticate"] == "Bearer"
        assert r["json"]["detail"] == "missing or invalid credentials"
    r = _call(mw, "POST", "/echo", [("content-type", "application/json"),
                                    ("authorization", "Bearer k1")], [b"{}"])
    assert r["status"] == 200


# ------------------------------------------------------------------ the HTTP parser's 400
def test_the_request_id_the_http_protocol_set_is_kept(caplog):
    caplog.set_level(logging.INFO, "dualread.access")
    r = _call(_mw(), state={"request_id": "f" * 32})
    assert r["headers"]["x-request-id"] == "f" * 32
    assert json.loads(caplog.records[-1].getMessage())["request_id"] == "f" * 32
    # none set (or an empty one): the middleware's own
    for state in ({}, {"request_id": ""}, {"request_id": None}):
        rid = _call(_mw(), state=state)["headers"]["x-request-id"]
        assert len(rid) == 32 and int(rid, 16) >= 0


def test_the_parsers_400_is_logged_and_counted_as_400_not_a_client_gone(caplog):
    caplog.set_level(logging.INFO, "dualread.access")

    async def gone(scope, receive, send):
        scope["state"]["parser_answered"] = True
        raise ClientDisconnect()

    m = Metrics()
    r = _call(_mw(app=gone, metrics=m), "POST", "/echo", {"content-type": "text/plain"},
              state={"request_id": "e" * 32})
    assert r["start"] is None
    assert _count(m, "precheck", 400) == 1 and _count(m, "precheck", CLIENT_CLOSED) is None
    events = [json.loads(x.getMessage()) for x in caplog.records]
    assert events == [{"request_id": "e" * 32, "route": "precheck", "method": "POST",
                       "status": 400, "latency_ms": events[0]["latency_ms"],
                       "batch_size": None}]
    # marked before the JSON pre-check read (the protocol's 400 while the body came)
    caplog.clear()

    async def receive():
        return {"type": "http.disconnect"}

    m = Metrics()
    r = _call(_mw(metrics=m), "POST", "/echo", {"content-type": "application/json"},
              receive=receive, state={"parser_answered": True})
    assert _count(m, "precheck", 400) == 1 and _count(m, "precheck", CLIENT_CLOSED) is None
    assert [json.loads(x.getMessage())["status"] for x in caplog.records] == [400]


def test_the_parsers_400_is_labelled_precheck_whatever_the_app_did(caplog):
    """The app returned without a reply of its own (it saw the client gone): the parser's
    400 went out, not a 500, and no route answered it."""
    async def quiet(scope, receive, send):
        scope["state"]["parser_answered"] = True

    caplog.set_level(logging.INFO, "dualread.access")
    m = Metrics()
    _call(_mw(app=quiet, metrics=m))
    assert _count(m, "precheck", 400) == 1
    assert _count(m, "unmatched", 500) is None and _count(m, "unmatched", 400) is None
    assert json.loads(caplog.records[-1].getMessage())["status"] == 400

    # not marked: the 500 it always was
    async def silent(scope, receive, send):
        return None

    m = Metrics()
    _call(_mw(app=silent, metrics=m), state={"parser_answered": False})
    assert _count(m, "unmatched", 500) == 1


# ------------------------------------------------------------------ two framings
def test_two_framings_are_one_400_before_any_other_refusal():
    """Content-Length beside Transfer-Encoding: refused unread, the connection closed, and
    first (a 431 or a 401 beside them would have left the connection open)."""
    reads = []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"hello", "more_body": False}

    both = {"content-type": "application/json", "content-length": "5",
            "transfer-encoding": "chunked"}
    for kw in ({}, {"max_header_bytes": 10}, {"api_key": "k1"}):
        m = Metrics()
        r = _call(_mw(metrics=m, **kw), "POST", "/echo", both, receive=receive)
        assert r["status"] == 400 and reads == [], kw
        assert r["json"] == {"detail": "send Content-Length or Transfer-Encoding, not both",
                             "request_id": r["headers"]["x-request-id"]}
        # the close, and no header beside the usual ones
        assert r["headers"] == {"content-length": r["headers"]["content-length"],
                                "content-type": "application/json", "connection": "close",
                                "x-request-id": r["headers"]["x-request-id"]}
        assert _count(m, "precheck", 400) == 1 and _count(m, "unmatched", 400) is None
    # either alone is one framing
    for one in ({"content-length": "5"}, {"transfer-encoding": "chunked"}):
        r = _call(_mw(), "POST", "/echo", {"content-type": "text/plain", **one}, [b"hello"])
        assert r["status"] == 200 and r["json"]["n"] == 5


def test_the_header_bound_when_line_and_headers_are_the_same_size():
    """`x-a: ` + 20 bytes + CRLF = 27 bytes, and a 27-byte request line (a 12-byte path):
    the larger part names the status, so equal parts are a 431, not a 414; headers of
    exactly the bound are not "request headers over" it."""
    h = {"x-a": "b" * 20}
    r = _call(_mw(max_header_bytes=53), path="/" + "a" * 11, headers=h)
    assert r["status"] == 431
    assert r["json"]["detail"] == "request line and headers over 53 bytes"
    r = _call(_mw(max_header_bytes=27), headers=h)
    assert r["status"] == 431
    assert r["json"]["detail"] == "request line and headers over 27 bytes"


# ------------------------------------------------------------------ absolute-form targets
def _target(raw: bytes, **kw) -> dict:
    """A scope as uvicorn's h11 server builds it for `GET raw`: `path` is the target
    unquoted (an absolute-form target's whole URL), `raw_path` what was sent."""
    return {"type": "http", "method": "GET", "path": unquote(raw.decode("latin-1")),
            "raw_path": raw, "query_string": b"", **kw}


@pytest.mark.parametrize("raw, path", [
    (b"http://example.org/answer", "/answer"),
    (b"https://example.org/answer", "/answer"),
    (b"HTTPS://Example.org:8443/calibration/pin", "/calibration/pin"),
    (b"hTtP://example.org/a/b/c", "/a/b/c"),          # the path from the first slash on
    (b"http://example.org", "/"),                     # no path: the root
    (b"http://example.org?x=1", "/"),
    (b"http:///answer", "/answer"),                   # an empty authority
    (b"http://user@example.org/a%20b%2Fc", "/a b/c"),  # unquoted, as uvicorn does
    (b"http://example.org/x://y/z", "/x://y/z"),      # only the first `://` ends the scheme
    (b"http://example.org/a#b", "/a"),                # a fragment is not the path
    (b"http://example.org/a#b#c/d", "/a"),
    (b"http://example.org#frag/x", "/"),
    (b"http://[::1/health/live", "/health/live"),     # a host no URL parser reads
    # an ASGI server may pass any bytes: one outside ASCII is a replacement character,
    # never an error (h11 lets only visible ASCII through)
    (b"http://example.org/\xffa%41", "/\ufffdaA"),
])
def test_an_absolute_target_routes_by_its_path(raw, path):
    assert routed_path(_target(raw)) == path


@pytest.mark.parametrize("raw", [b"/answer", b"/http://example.org/answer",
                                 b"ftp://example.org/answer", b"http:/example.org/answer",
                                 b"http//example.org/answer", b"*", b""])
def test_other_targets_route_by_the_scopes_own_path(raw):
    # the scope's `path`, not one read again from `raw_path`
    assert routed_path(_target(raw, path="/the/scopes")) == "/the/scopes"


def test_a_scope_without_a_raw_path_routes_by_its_path():
    # `raw_path` is optional in ASGI
    scope = _target(b"http://example.org/answer")
    del scope["raw_path"]
    assert routed_path(scope) == "http://example.org/answer"
    assert routed_path({**scope, "raw_path": None}) == "http://example.org/answer"


def test_origin_form_passes_on_a_copy_with_the_routed_path():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope, receive, send))

    async def receive() -> dict:
        return {}

    async def send(message: dict) -> None:
        return None

    mw = OriginForm(app)
    scope = _target(b"http://example.org/answer")
    asyncio.run(mw(scope, receive, send))
    passed, r, s = seen[-1]
    assert passed["path"] == "/answer" and (r, s) == (receive, send)
    # every other key kept; the server's own scope not changed in place
    assert {**passed, "path": scope["path"]} == scope
    assert scope["path"] == "http://example.org/answer"
    # an origin-form target, or another kind of scope: the very scope, untouched
    for other in (_target(b"/answer"), {**_target(b"http://example.org/ws"), "type": "websocket"},
                  {"type": "lifespan"}):
        before = dict(other)
        asyncio.run(mw(other, receive, send))
        assert seen[-1][0] is other and other == before


def test_an_absolute_target_reaches_its_route_through_the_middleware():
    m = Metrics()
    app = OriginForm(_mw(metrics=m))
    r = _call(app, "GET", "http://example.org/ok")
    assert r["status"] == 200 and r["json"] == {"ok": True}
    assert _count(m, "/ok", 200) == 1
    r = _call(app, "POST", "HTTPS://example.org:8443/echo", {"content-type": "text/plain"},
              [b"hello"])
    assert r["status"] == 200 and r["json"]["n"] == 5
