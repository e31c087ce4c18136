"""Regression tests of the last hostile run's written-down leftovers: the OpenAI route's
messages name fields as its `param` does (`messages[0].content[1].text`, not
`messages.0.content.1.text`), and the errors it rewrites from the service's shape are
compact JSON like its own."""

from __future__ import annotations

import json

import pytest

from app.routers.openai import _openai_paths, error_body, openai_error
from tests.conftest import random_image
from tests.helpers import assert_error, b64, png_bytes, small_limits_client

URI = "data:image/png;base64," + b64(png_bytes(random_image(0)))


@pytest.mark.parametrize("message, shown", [
    ("messages.0.content.1.text: required", "messages[0].content[1].text: required"),
    ("messages.0.content.0: unexpected field; messages.12.role: must be 'user'",
     "messages[0].content[0]: unexpected field; messages[12].role: must be 'user'"),
    ("messages.0.content: the question (its text parts, joined) has no letter or digit",
     "messages[0].content: the question (its text parts, joined) has no letter or digit"),
    # already bracketed, other fields, a word ending a sentence: unchanged
    ("messages[0]: only one user message is served", "messages[0]: only one user message "
                                                     "is served"),
    ("stream: streaming is not supported.", "stream: streaming is not supported."),
    ("send exactly one user message: one image and its question",
     "send exactly one user message: one image and its question"),
    ("body over the limit of 10 bytes", "body over the limit of 10 bytes"),
    # a name `param` would not write (not ASCII, over 41 characters): no text is dropped
    ("messages.0.contenté: x", "messages[0].contenté: x"),
    ("messages.٣.role: x", "messages.٣.role: x"),
    ("messages.0." + "a" * 50 + ": x", "messages[0]." + "a" * 50 + ": x"),
])
def test_a_message_names_fields_as_param_does(message, shown):
    assert _openai_paths(message) == shown
    assert error_body(422, message, "x")["error"]["message"] == shown


def test_a_rewritten_error_is_compact_json_with_its_paths():
    out = openai_error(422, json.dumps({"detail": "messages.0.content: 40 fields, over "
                                                   "32", "request_id": "r"}).encode())
    assert out == (b'{"error":{"message":"messages[0].content: 40 fields, over 32",'
                   b'"type":"invalid_request_error","param":null,"code":"invalid_value"}}')
    # written as the route writes its own (no ASCII escapes either)
    assert openai_error(400, b'{"detail": "\xe2\x89\xa5 2"}') == \
        '{"error":{"message":"≥ 2","type":"invalid_request_error","param":null,' \
        '"code":"bad_request"}}'.encode()


def test_the_route_s_own_and_rewritten_errors_read_alike(api):
    own = api.post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI}},
                                     {"type": "text", "text": 5}]}]})
    assert own.status_code == 422
    assert own.json()["error"]["message"] == "messages[0].content[1].text: must be a string"
    assert own.json()["error"]["param"] == "messages[0].content[1].text"
    rewritten = api.post("/v1/chat/completions", content=b"x",
                         headers={"content-type": "text/plain"})
    assert rewritten.status_code == 415
    for r in (own, rewritten):
        assert r.content.startswith(b'{"error":{"message":"') and b'": ' not in r.content


# ------------------------------------------------------------------ multipart
@pytest.mark.parametrize("boundary", ["", '""', "b" * 71, "é" * 35])
def test_an_empty_or_over_long_multipart_boundary_is_400(api, boundary):
    r = api.post("/answer", content=b"--\r\n\r\n--", headers={
        "content-type": f"multipart/form-data; boundary={boundary}".encode()})
    assert_error(r, 400, "multipart boundary must have 1 to 70 ASCII characters")


def test_a_70_character_boundary_is_read(api):
    """The bound is RFC 2046's: a boundary of 70 characters reads as any other."""
    b = "b" * 70
    body = (f"--{b}\r\nContent-Disposition: form-data; name=\"question\"\r\n\r\n"
            f"what color is the shape?\r\n--{b}--\r\n").encode()
    r = api.post("/answer", content=body,
                 headers={"content-type": f"multipart/form-data; boundary={b}"})
    # read whole: the one thing wrong is the missing image
    assert r.status_code == 422 and "needs a 'file' part or an 'image' part" in r.text


def test_the_multipart_parser_s_warnings_are_json_lines(service):
    """Its warnings (one per body it cannot read) went to Python's last-resort handler,
    plain text among the service's JSON lines."""
    import logging

    from app.logs import JsonLines
    from app.main import create_app

    create_app(service=service)
    lg = logging.getLogger("python_multipart.multipart")
    handlers = [h for h in logging.getLogger("python_multipart").handlers
                if isinstance(h.formatter, JsonLines)]
    assert handlers and not logging.getLogger("python_multipart").propagate
    # the batcher's own logger too (it wrote plain text through Python's last resort)
    assert any(isinstance(h.formatter, JsonLines)
               for h in logging.getLogger("dualread.engine").handlers)
    assert lg.isEnabledFor(logging.WARNING) and not lg.isEnabledFor(logging.INFO)
    rec = lg.makeRecord(lg.name, logging.WARNING, __file__, 1,
                        "Did not find CR at end of boundary (%d)", (7,), None)
    line = json.loads(handlers[0].format(rec))
    assert line["message"] == "Did not find CR at end of boundary (7)"
    assert line["logger"] == "python_multipart.multipart" and line["level"] == "WARNING"


# ------------------------------------------------------------------ the operator key's challenge
def test_a_wrong_operator_key_is_challenged_for_that_key_not_a_bearer_token(service, tmp_path):
    """A right API key with a wrong `X-Operator-Key` got `WWW-Authenticate: Bearer`: the
    challenge told the client to fix the token it had right."""
    with small_limits_client(service, api_key="api-secret", operator_key="op-secret",
                             recert_state=str(tmp_path / "state.json")) as c:
        body = {"request_id": "0" * 32, "correct": True}
        r = c.post("/feedback", json=body, headers={"Authorization": "Bearer api-secret",
                                                    "X-Operator-Key": "guess"})
        assert_error(r, 401, "wrong operator key")
        assert r.headers["www-authenticate"] == 'OperatorKey header="X-Operator-Key"'
        r = c.post("/calibration/rollback", headers={"Authorization": "Bearer api-secret",
                                                     "X-Operator-Key": "guess"})
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == 'OperatorKey header="X-Operator-Key"'
        # a wrong API key keeps the Bearer challenge
        r = c.post("/feedback", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


# ------------------------------------------------------------------ parsing off the event loop
def test_the_openai_route_parses_its_body_off_the_event_loop(api, monkeypatch):
    """As /answer does: pydantic holds the GIL either way, but a 30 MB body of escapes held
    the loop itself (and every other request on it) 383 ms."""
    import asyncio

    from app.routers import openai

    on_loop, real = [], openai._parse

    def spy(raw: bytes):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(raw)

    monkeypatch.setattr(openai, "_parse", spy)
    r = api.post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert r.status_code == 422 and on_loop == [False]


# ------------------------------------------------------------------ a lone surrogate
LONE = "not valid JSON: a \\u escape that is not valid Unicode text (a lone surrogate)"


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "\\ud800\\ud800", "\\ud800x"])
def test_a_lone_surrogate_is_named_as_such(api, escape):
    """/answer and the OpenAI route said only "not valid JSON", the probe routes "must be
    valid Unicode text": the client now reads what is wrong on every route."""
    img = b64(png_bytes(random_image(0)))
    body = f'{{"image": "{img}", "question": "what {escape} is it?"}}'
    assert_error(api.post("/answer", content=body,
                          headers={"content-type": "application/json"}), 422, "body: " + LONE)
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url",
                                                 "image_url": {"url": URI}}]}]})
    r = api.post("/v1/chat/completions", content=chat.replace("what is", f"what {escape} is"),
                 headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["message"] == "body: " + LONE


def test_other_broken_escapes_stay_plain_invalid_json(api):
    for bad in ('{"question": "a\\u12"}', '{"question": "a\\x"}', '{"question": 5'):
        r = api.post("/answer", content=bad, headers={"content-type": "application/json"})
        assert_error(r, 422, "body: not valid JSON")
        assert "surrogate" not in r.text


# ------------------------------------------------------------------ uvicorn's own lines
def test_serve_writes_uvicorn_s_lines_as_json(monkeypatch, capsys):
    """`dualread serve` gives uvicorn a logging config whose lines are JSON: its own lines
    (its parser's WARNING, which any client could cause, is not written since) were plain
    text."""
    import logging
    import logging.config

    import uvicorn
    from typer.testing import CliRunner

    from app.cli import app as cli

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    assert CliRunner().invoke(cli, ["serve", "--port", "1"]).exit_code == 0
    config = seen["log_config"]
    saved = {n: (lg.handlers[:], lg.level, lg.propagate) for n in ("uvicorn", "uvicorn.access")
             for lg in [logging.getLogger(n)]}
    try:
        logging.config.dictConfig(config)
        logging.getLogger("uvicorn.error").warning("Waiting for application shutdown.")
        logging.getLogger("uvicorn.access").warning("GET / 200")     # the service logs those
        err = capsys.readouterr().err.strip().splitlines()
    finally:
        for n, (handlers, level, propagate) in saved.items():
            lg = logging.getLogger(n)
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)
    assert len(err) == 1
    line = json.loads(err[0])
    assert (line["logger"], line["message"]) == ("uvicorn.error",
                                                 "Waiting for application shutdown.")


# ------------------------------------------------------------------ the document's 401s
def test_the_document_names_the_operator_challenge_only_where_it_is_sent(service):
    with small_limits_client(service, api_key="k", operator_key="op") as c:
        doc = c.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()

    def challenge(path: str, method: str) -> str:
        return doc["paths"][path][method]["responses"]["401"]["headers"][
            "WWW-Authenticate"]["description"]

    for path, method in (("/answer", "post"), ("/v1/chat/completions", "post"),
                         ("/probe/score", "post")):
        assert challenge(path, method) == "Bearer"
    for path, method in (("/feedback", "post"), ("/calibration", "get"),
                         ("/calibration/pin", "post"), ("/calibration/rollback", "post")):
        assert 'OperatorKey header="X-Operator-Key"' in challenge(path, method)
    assert "wrong operator key" in doc["paths"]["/calibration"]["get"]["responses"]["401"][
        "description"]
