"""Regression tests of the last hostile run's written-down leftovers on credentials: a
wrong operator key on /feedback is answered before the body is judged (as on the operator
routes), and a credential header sent twice is refused rather than its first copy read."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_error, small_limits_client

API = {"Authorization": "Bearer api-secret"}


def _client(service, tmp_path):
    return small_limits_client(service, api_key="api-secret", operator_key="op-secret",
                               recert_state=str(tmp_path / "state.json"))


def test_a_wrong_operator_key_on_feedback_is_answered_before_the_body(service, tmp_path):
    """/feedback judged its body first (422 to a wrong key with a bad body), the operator
    routes their key first: a client probing keys learnt different things from each."""
    with _client(service, tmp_path) as c:
        wrong = {**API, "X-Operator-Key": "guess"}
        for body in ({"request_id": "0" * 32}, {"correct": "maybe"}, {}):
            assert_error(c.post("/feedback", json=body, headers=wrong), 401,
                         "wrong operator key")
            assert_error(c.post("/calibration/pin", json={"version": 3}, headers=wrong), 401,
                         "wrong operator key")
        # before the content type too, as /calibration/pin (415 there before)
        for kind in ("text/plain", None):
            r = c.post("/feedback", content=b"x", headers={
                **wrong, **({"Content-Type": kind} if kind else {})})
            assert_error(r, 401, "wrong operator key")
        # the right key, or none, still has its body judged
        for headers in (API, {**API, "X-Operator-Key": "op-secret"}):
            assert_error(c.post("/feedback", json={"correct": True}, headers=headers), 422,
                         "request_id")
        r = c.post("/feedback", json={"request_id": "0" * 32, "correct": True},
                   headers={**API, "X-Operator-Key": "op-secret"})
        assert r.status_code == 200 and r.json()["accepted"] is False


def test_a_credential_header_sent_twice_is_refused(service, tmp_path):
    """The first copy won: a proxy that appended its own X-Operator-Key or Authorization
    decided which key was checked, and a right key beside a wrong one passed."""
    with _client(service, tmp_path) as c:
        body = {"request_id": "0" * 32, "correct": True}
        twice = [("Authorization", "Bearer api-secret"), ("X-Operator-Key", "op-secret"),
                 ("X-Operator-Key", "guess")]
        assert_error(c.post("/feedback", json=body, headers=twice), 400,
                     "send one X-Operator-Key header, not several")
        assert_error(c.post("/calibration/rollback", headers=twice), 400, "X-Operator-Key")
        assert_error(c.get("/calibration", headers=twice), 400, "X-Operator-Key")
        # two copies of one right key too: which copy counts is not the client's to guess
        same = [("Authorization", "Bearer api-secret"), ("X-Operator-Key", "op-secret"),
                ("X-Operator-Key", "op-secret")]
        assert_error(c.post("/feedback", json=body, headers=same), 400, "X-Operator-Key")
        auth_twice = [("Authorization", "Bearer api-secret"), ("Authorization", "Bearer x")]
        assert_error(c.get("/calibration", headers=auth_twice), 400,
                     "send one Authorization header, not several")
        assert_error(c.post("/feedback", json=body, headers=auth_twice), 400, "Authorization")
        # one of each passes
        r = c.post("/feedback", json=body, headers={**API, "X-Operator-Key": "op-secret"})
        assert r.status_code == 200


def test_repeated_headers_are_not_read_where_no_key_is_configured(service, tmp_path):
    """Without an API key (or an operator key) the header is not a credential here: it is
    ignored, whatever its count, as before."""
    with small_limits_client(service) as c:
        twice = [("Authorization", "Bearer a"), ("Authorization", "Bearer b"),
                 ("X-Operator-Key", "a"), ("X-Operator-Key", "b")]
        r = c.post("/feedback", json={"request_id": "0" * 32, "correct": True}, headers=twice)
        assert r.status_code == 200 and r.json()["counted"] is False
        assert c.get("/calibration", headers=twice).status_code == 200


def test_the_document_names_the_400_on_every_keyed_operation(service, tmp_path):
    """Every operation that checks a key can now answer 400 to that key's header sent twice;
    the GET routes had no 400 in the document."""
    with _client(service, tmp_path) as c:
        doc = c.get("/openapi.json", headers=API).json()
    keyed = [(path, method, op) for path, item in doc["paths"].items()
             for method, op in item.items() if "security" in op]
    assert any(method == "get" for _, method, _ in keyed)
    for path, method, op in keyed:
        assert "sent twice" in op["responses"]["400"]["description"], (method, path)


@pytest.mark.parametrize("raw, path", [
    (b"http://example.org/answer", "/answer"),
    (b"HTTPS://example.org:8443/calibration/pin", "/calibration/pin"),
    (b"http://example.org", "/"),
    (b"http://user@example.org/a%20b", "/a b"),
    (b"/answer", None),                   # origin form: untouched
    (b"/http://example.org/answer", None),
    (b"ftp://example.org/answer", None),  # not HTTP's: left to 404
    # hosts a URL parser refuses (urlsplit raised: a plain-text 500 quoting the host)
    (b"http://[::1/health/live", "/health/live"),
    (b"http://]/answer", "/answer"),
    (b"http://[PATIENT-SMITH]/answer", "/answer"),
    (b"http://example.org#frag", "/"),
    (b"http://example.org/a%23b#c/d", "/a#b"),
])
def test_origin_form_routes_an_absolute_target_by_its_path(raw, path):
    import asyncio

    from app.middleware import OriginForm

    seen = {}

    async def app(scope, receive, send):
        seen.update(scope)

    sent = {"type": "http", "path": raw.decode(), "raw_path": raw, "query_string": b""}
    asyncio.run(OriginForm(app)(sent, None, None))
    assert seen["path"] == (path if path is not None else raw.decode())
    assert seen["raw_path"] == raw      # what was sent: the request line's bound counts it
    assert sent["path"] == raw.decode()  # the server's own scope is not changed in place


def test_the_multipart_parsers_warnings_name_their_request(api):
    """The parser's own warnings were JSON lines without a request id: an operator could
    not tell which request a `Did not find CR at end of boundary` was about."""
    import logging

    from app.logs import JsonLines

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(JsonLines().format(record))    # formatted as it is logged

    keep = Keep()
    logging.getLogger("python_multipart").addHandler(keep)
    try:
        r = api.post("/answer", content=b"--Bx\r\n",
                     headers={"Content-Type": "multipart/form-data; boundary=B"})
    finally:
        logging.getLogger("python_multipart").removeHandler(keep)
    assert r.status_code == 400, r.text
    assert lines, "the body should make the parser warn"
    assert all(json.loads(line)["request_id"] == r.json()["request_id"] for line in lines)
    # outside a request the formatter adds no id
    rec = logging.getLogger("python_multipart").makeRecord(
        "python_multipart", logging.WARNING, __file__, 1, "m", (), None)
    assert "request_id" not in json.loads(JsonLines().format(rec))


def test_without_the_key_no_413_tells_the_body_limit(service, tmp_path):
    """A Content-Length over the limit got a 413 naming it on any route that takes no body
    (GET /health/live, POST /nope), before the key was read."""
    with _client(service, tmp_path) as c:
        big = {"Content-Length": "999999999"}
        for method, path, status in (("GET", "/health/live", 200), ("GET", "/calibration", 401),
                                     ("POST", "/nope", 404), ("DELETE", "/answer", 405)):
            r = c.request(method, path, headers=big)
            assert r.status_code == status, (method, path, r.status_code, r.text)
            assert "limit" not in r.text
        # with the key the limit is judged before anything is read, as before
        r = c.request("GET", "/health/live", headers={**big, **API})
        assert_error(r, 413, "body over the limit of")


def test_a_body_framed_two_ways_is_refused_and_the_connection_closed(service, tmp_path):
    """Content-Length and Transfer-Encoding together (RFC 9112 6.1): a proxy reading the
    other framing would take the body's rest for a second request."""
    with _client(service, tmp_path) as c:
        for headers in ({}, API):
            r = c.post("/feedback", content=b"0\r\n\r\n", headers={
                **headers, "Content-Length": "5", "Transfer-Encoding": "chunked",
                "Content-Type": "application/json"})
            assert_error(r, 400, "send Content-Length or Transfer-Encoding, not both")
            assert r.headers["connection"] == "close"


def test_the_bearer_token_is_read_alike_before_and_after_routing(service, tmp_path):
    """`Bearer  key` (two blanks): the GET routes' parser strips the token and passed it, the
    body routes' pre-check did not and refused it."""
    with _client(service, tmp_path) as c:
        loose = {"Authorization": "Bearer  api-secret\t"}
        assert c.get("/calibration", headers=loose).status_code == 200
        r = c.post("/feedback", json={"request_id": "0" * 32, "correct": True}, headers=loose)
        assert r.status_code == 200, r.text


def test_two_framings_close_the_connection_beside_headers_over_the_bound(service, tmp_path):
    """The 431 for headers over `--max-header-bytes` came first and kept the connection
    open, so a body framed two ways with a long header was read as h11 framed it and what
    followed it answered as a second request (RFC 9112 6.3: close after responding)."""
    with _client(service, tmp_path) as c:
        r = c.post("/feedback", content=b"0\r\n\r\n", headers={
            "X-Pad": "p" * 17000, "Content-Length": "5", "Transfer-Encoding": "chunked",
            "Content-Type": "application/json"})
        assert_error(r, 400, "send Content-Length or Transfer-Encoding, not both")
        assert r.headers["connection"] == "close"
