"""Regression tests of the last hostile run's findings on what the service documents: the
operator routes' 409 when no rule store is held, the statuses GET /calibration and the
OpenAI route can answer, and uvicorn's parser WARNING (the live-server side of these is in
tests/test_server.py)."""

from __future__ import annotations

import asyncio
import logging

from app.http11 import PARSER_WARNING, JsonH11Protocol
from tests.helpers import assert_error, small_limits_client

OPERATOR = {"X-Operator-Key": "op-secret"}


def _doc(service, **settings) -> dict:
    with small_limits_client(service, **settings) as c:
        return c.get("/openapi.json").json()


def test_the_operator_routes_answer_409_without_a_rule_store_as_documented(service, tmp_path):
    """A state file this process cannot use leaves the service answering without a rule
    store: pin and unpin answered 409, which the document listed for rollback only."""
    settings = {"operator_key": "op-secret", "recert_state": str(tmp_path)}   # a folder
    with small_limits_client(service, **settings) as c:
        assert c.get("/calibration").json()["counting"] is False
        for path, body in (("/calibration/pin", {}), ("/calibration/unpin", None),
                           ("/calibration/rollback", None), ("/calibration/window/reset", None)):
            r = c.post(path, json=body, headers=OPERATOR) if body is not None else \
                c.post(path, headers=OPERATOR)
            assert_error(r, 409, "state file")
        doc = c.get("/openapi.json").json()["paths"]
    for path in ("/calibration/pin", "/calibration/unpin", "/calibration/rollback",
                 "/calibration/window/reset"):
        assert "holds no rule store" in doc[path]["post"]["responses"]["409"]["description"]
    assert "nothing to roll back to" in \
        doc["/calibration/rollback"]["post"]["responses"]["409"]["description"]


def test_each_calibration_route_lists_only_what_it_can_answer(service, tmp_path):
    """GET /calibration listed 415, 422, 429 and 504 (a body route's and the model's
    statuses); unpin and rollback read no body and run no model either."""
    paths = _doc(service, operator_key="op-secret",
                 recert_state=str(tmp_path / "state.json"))["paths"]
    codes = {(m, p): set(paths[p][m]["responses"]) for p, m in (
        ("/calibration", "get"), ("/calibration/pin", "post"),
        ("/calibration/unpin", "post"), ("/calibration/rollback", "post"),
        ("/calibration/window/reset", "post"))}
    # 400: the operator key's header sent twice (with or without an API key); the POSTs'
    # bodies are bounded and checked before routing even where the route reads none
    assert codes[("get", "/calibration")] == {"200", "400", "401", "500"}
    for p in ("/calibration/unpin", "/calibration/rollback", "/calibration/window/reset"):
        assert codes[("post", p)] == \
            {"200", "400", "401", "403", "408", "409", "413", "422", "500", "503"}, p
    assert codes[("post", "/calibration/pin")] == \
        {"200", "400", "401", "403", "404", "408", "409", "413", "415", "422", "500", "503"}


def test_a_repeated_operator_key_is_a_documented_400_without_an_api_key(service, tmp_path):
    """Two `X-Operator-Key` headers are a 400 wherever the key is read; without an API key
    the document listed that 400 nowhere (it came with the API key's security only)."""
    settings = {"operator_key": "op-secret", "recert_state": str(tmp_path / "state.json")}
    twice = [("X-Operator-Key", "op-secret"), ("X-Operator-Key", "op-secret")]
    with small_limits_client(service, **settings) as c:
        paths = c.get("/openapi.json").json()["paths"]
        assert_error(c.get("/calibration", headers=twice), 400, "X-Operator-Key")
        assert_error(c.post("/calibration/unpin", headers=twice), 400, "X-Operator-Key")
    for method, path in (("get", "/calibration"), ("post", "/feedback"),
                         ("post", "/calibration/pin"), ("post", "/calibration/unpin"),
                         ("post", "/calibration/rollback")):
        assert "sent twice" in paths[path][method]["responses"]["400"]["description"], path


def test_the_openai_route_lists_its_framing_400_without_a_key(service):
    """Without an API key the document gave /v1/chat/completions no 400, yet a body framed
    two ways or a broken chunked body is one (in OpenAI's shape)."""
    op = _doc(service)["paths"]["/v1/chat/completions"]["post"]
    assert op["responses"]["400"]["description"].startswith(
        "the body is framed two ways (Content-Length with Transfer-Encoding) or its chunked "
        "framing is broken")
    schema = op["responses"]["400"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/OpenAIError"}


async def _app(scope, receive, send) -> None:
    pass


def test_uvicorn_s_parser_warning_is_dropped_and_nothing_else():
    """uvicorn logs a WARNING for each request its parser refuses: any client could write
    those at will, and the 400's access line (with its request id) records the request."""
    lg = logging.getLogger("uvicorn.error")
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    before, loop = lg.filters[:], asyncio.new_event_loop()
    try:
        for _ in range(2):                   # one filter on the logger, not one a connection
            JsonH11Protocol(Config(app=_app), ServerState(), {}, loop)
        added = [f for f in lg.filters if f not in before]
        assert len(added) == 1
        rec = lg.makeRecord(lg.name, logging.WARNING, __file__, 1, PARSER_WARNING, (), None)
        assert not added[0].filter(rec)
        other = lg.makeRecord(lg.name, logging.WARNING, __file__, 1, "Invalid %s", ("x",), None)
        assert added[0].filter(other)
    finally:
        lg.filters[:] = before
        loop.close()
