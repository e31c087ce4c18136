"""Regression tests of the last hostile run's written-down leftovers: the OpenAI route's
messages name fields as its `param` does (`messages[0].content[1].text`, not
`messages.0.content.1.text`), and the errors it rewrites from the service's shape are
compact JSON like its own."""

from __future__ import annotations

import json

import pytest

from app.routers.openai import _openai_error, _openai_paths, error_body
from tests.conftest import random_image
from tests.helpers import b64, png_bytes

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
])
def test_a_message_names_fields_as_param_does(message, shown):
    assert _openai_paths(message) == shown
    assert error_body(422, message, "x")["error"]["message"] == shown


def test_a_rewritten_error_is_compact_json_with_its_paths():
    out = _openai_error(422, json.dumps({"detail": "messages.0.content: 40 fields, over "
                                                   "32", "request_id": "r"}).encode())
    assert out == (b'{"error":{"message":"messages[0].content: 40 fields, over 32",'
                   b'"type":"invalid_request_error","param":null,"code":"invalid_value"}}')
    # written as the route writes its own (no ASCII escapes either)
    assert _openai_error(400, b'{"detail": "\xe2\x89\xa5 2"}') == \
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
