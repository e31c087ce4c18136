"""Regression tests of the last hostile run's leftover on connections: a response sent
before the request's declared body was read (a refusal, a route that takes no body) kept
the connection open, and the server went on reading and discarding the body's rest for as
long as the client trickled it."""

from __future__ import annotations

import pytest

from tests.helpers import assert_error, small_limits_client

API = {"Authorization": "Bearer api-secret"}
FEEDBACK = {"request_id": "0" * 32, "correct": True}


@pytest.fixture
def client(service, tmp_path):
    with small_limits_client(service, api_key="api-secret", operator_key="op-secret",
                             recert_state=str(tmp_path / "state.json"),
                             max_body_bytes=50_000) as c:
        yield c


def test_a_response_before_the_body_is_read_closes_the_connection(client):
    refused = [
        (client.post("/answer", json={"question": "q"}), 401, "missing or invalid"),
        (client.post("/answer", content=b"x" * 60_000, headers=API), 413, "over the limit"),
        (client.post("/nope", content=b"{}", headers=API), 404, None),
        (client.request("DELETE", "/answer", content=b"{}", headers=API), 405, None),
    ]
    for r, status, detail in refused:
        if detail:
            assert_error(r, status, detail)
        assert r.status_code == status, r.text
        assert r.headers.get("connection") == "close", (status, r.headers)
    # a route that takes no body, sent one: answered, and closed (its body went unread)
    r = client.request("GET", "/health/live", content=b"abc", headers=API)
    assert r.status_code == 200 and r.headers.get("connection") == "close"


def test_a_body_read_whole_or_no_body_keeps_the_connection(client):
    """Only an unread body closes: keep-alive stays for everything else, refusals
    included."""
    kept = [
        (client.post("/feedback", json=FEEDBACK, headers={**API, "X-Operator-Key": "op-secret"}),
         200),
        (client.post("/feedback", json={"correct": 1}, headers=API), 422),   # read, judged
        # a JSON body is read whole (and bounded) before the routes: then refused
        (client.post("/feedback", json=FEEDBACK, headers={**API, "X-Operator-Key": "guess"}),
         401),
        # FastAPI reads a body route's body (16 KiB at most there) before its dependencies
        (client.post("/feedback", content=b"x", headers={
            **API, "X-Operator-Key": "guess", "Content-Type": "text/plain"}), 401),
        (client.post("/answer", content=b"{not json", headers={
            **API, "Content-Type": "application/json"}), 422),               # read whole
        (client.get("/health/live"), 200),
        (client.request("GET", "/health/live", headers={"Content-Length": "0"}), 200),
        (client.request("GET", "/health/live", headers={"Content-Length": "000"}), 200),
        (client.get("/calibration"), 401),
        (client.post("/nope", headers=API), 404),
    ]
    for r, status in kept:
        assert r.status_code == status, r.text
        assert "connection" not in r.headers, (status, r.headers)


def test_a_repeated_authorization_is_the_same_400_before_and_after_routing(client):
    """Two Authorization headers, the first wrong: the body routes' pre-check read the first
    copy and answered 401, the other routes 400; both are 400 now, either order."""
    body = {"request_id": "0" * 32, "correct": True}
    for twice in ([("Authorization", "Bearer x"), ("Authorization", "Bearer api-secret")],
                  [("Authorization", "Bearer api-secret"), ("Authorization", "Bearer x")]):
        for r in (client.post("/feedback", json=body, headers=twice),
                  client.post("/answer", json={"question": "q"}, headers=twice),
                  client.get("/calibration", headers=twice)):
            assert_error(r, 400, "send one Authorization header, not several")
    # one wrong copy is still the 401 with its challenge
    r = client.post("/answer", json={"question": "q"}, headers={"Authorization": "Bearer x"})
    assert_error(r, 401, "missing or invalid credentials")
    assert r.headers["www-authenticate"] == "Bearer"


def test_a_body_refused_part_way_or_sent_chunked_closes_too(client):
    """A refusal after part of the body was read (the limit crossed by a later chunk) and a
    chunked body the router never reads close as well: only a body read whole is done."""
    json_type = {**API, "Content-Type": "application/json"}
    r = client.post("/answer", content=iter([b"[" + b"1," * 15_000, b"1," * 15_000 + b"1]"]),
                    headers=json_type)
    assert_error(r, 413, "over the limit of 50000 bytes")
    assert r.headers.get("connection") == "close"
    r = client.post("/nope", content=iter([b"x"]), headers=API)       # chunked, unread
    assert r.status_code == 404 and r.headers.get("connection") == "close"
    assert r.request.headers.get("transfer-encoding") == "chunked"
    # chunked and read whole: kept
    r = client.post("/feedback", content=iter([b'{"request_id": "' + b"0" * 32,
                                               b'", "correct": true}']), headers=json_type)
    assert r.status_code == 200 and "connection" not in r.headers


def test_two_authorizations_are_a_400_before_the_declared_size_is_judged(client):
    """The first copy right and a body over the limit: the pre-check read that copy alone
    and answered 413 (naming the limit), where the routes refuse the two copies."""
    twice = [("Authorization", "Bearer api-secret"), ("Authorization", "Bearer x"),
             ("Content-Type", "application/json")]
    r = client.post("/answer", content=b"x" * 60_000, headers=twice)
    assert_error(r, 400, "send one Authorization header, not several")
    assert "limit" not in r.text
