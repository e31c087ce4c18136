"""Regression tests of the review's three leftovers: a 422's field path read off the model's
own discriminated-union tags (never guessed from the body's values), the work of a body's
long numbers bounded before any parser sees it, and OpenAI's `param` naming a content part
by its index."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from app import middleware
from app.errors import install
from app.middleware import MAX_LONG_DIGITS, SHORT_NUMBER_DIGITS, json_problem, long_digits
from tests.conftest import random_image
from tests.helpers import assert_error, b64, png_bytes

Q = "what color is the shape?"
IMG = b64(png_bytes(random_image(0)))
URI = "data:image/png;base64," + IMG
IMAGE = {"type": "image_url", "image_url": {"url": URI}}


def _chat(content) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def _openai_error(r, status: int = 422) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ------------------------------------------------------------------ 1. a path by the model's tags
@pytest.mark.parametrize("route, body, detail", [
    # a value equal to a key's name ("mask"), with that key's field misplaced beside it:
    # the value made `mask` read as a union's tag, and the error sat at the misplaced key
    ("/probe/score_batch", {"image": IMG, "question": Q, "trajectories": [
        {"response": "mask", "mask": {"ratio": "x"}, "ratio": 1}]},
     "trajectories.0.mask.ratio: must be a number from 0 to 1; trajectories.0: unexpected "
     "field"),
    ("/probe/score", {"image": IMG, "question": "mask", "response": "r",
                      "mask": {"target": 5}, "target": 1},
     "mask.target: must be 'think', 'answer' or 'response', or an array; body: unexpected "
     "field"),
])
def test_a_value_equal_to_a_key_s_name_does_not_move_the_error(api, route, body, detail):
    assert assert_error(api.post(route, json=body), 422)["detail"] == detail


@pytest.mark.parametrize("part", [
    {"type": "text", "text": Q, "x": 1},
    {"type": "text", "text": "image_url", "image_url": {"url": URI}},   # a value named as a key
    {**IMAGE, "text": "text"},
])
def test_an_unknown_key_of_a_content_part_is_the_part_s(api, part):
    """The part's tag (`text`, `image_url`) ends the location of an unknown key on the part:
    it was read as the part's field of that name (`messages[0].content[1].text`)."""
    body = _chat([IMAGE, part] if part["type"] == "text" else [{"type": "text", "text": Q},
                                                                 part])
    error = _openai_error(api.post("/v1/chat/completions", json=body))
    assert error["message"] == "messages[0].content[1]: unexpected field"
    assert error["param"] == "messages[0].content[1]"


class _A(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["a"]
    a: int


class _B(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["b"]
    b: int


class _Plain(BaseModel):
    b: int


class _Tagged(BaseModel):
    parts: list[Annotated[_A | _B, Field(discriminator="kind")]]
    note: str = ""
    b: _Plain | None = None          # fields named as a tag, outside the union


def test_a_route_validated_by_fastapi_reads_the_tags_of_its_own_body_model():
    """The service's handler finds the matched route's body model: with its tags, an
    unknown key of a tagged object is that object's, not its field named as the tag."""
    app = FastAPI()
    install(app)

    @app.post("/t")
    async def t(body: _Tagged) -> None:
        return None

    with TestClient(app) as c:
        r = c.post("/t", json={"parts": [{"kind": "b", "b": 1}, {"kind": "a", "a": 1, "z": 1}]})
        assert r.json()["detail"] == "parts.1: unexpected field"
        r = c.post("/t", json={"parts": [{"kind": "a", "a": "x"}]})
        assert r.json()["detail"] == "parts.0.a: must be an integer"
        # a name that is a tag, where no object's kind is it: a field, whatever value
        # (`note`) spells it
        r = c.post("/t", json={"parts": [], "note": "b", "b": {"b": "x"}})
        assert r.json()["detail"] == "b.b: must be an integer"


# ------------------------------------------------------------------ 2. long numbers, bounded
def _numbers(digits: list[int]) -> bytes:
    return ("[" + ", ".join("7" * n for n in digits) + "]").encode()


LONG = f"body: its numbers of more than {SHORT_NUMBER_DIGITS} digits have more than " \
       f"{MAX_LONG_DIGITS} digits together"


def test_long_numbers_are_bounded_by_their_digits_together():
    # each within Python's limit (4,300): together at the bound, then one digit over it
    at = [4000] * (MAX_LONG_DIGITS // 4000) + [MAX_LONG_DIGITS % 4000]
    assert sum(at) == MAX_LONG_DIGITS and min(at) > SHORT_NUMBER_DIGITS
    assert json_problem(_numbers(at)) is None
    assert json_problem(_numbers([*at[:-1], at[-1] + 1])) == LONG
    # an int64's 19 digits are short, however many: only the values' bound holds them
    assert json_problem(_numbers([SHORT_NUMBER_DIGITS] * 255)) is None
    # the last number too, after the last token
    assert json_problem(b"[" + _numbers(at)[1:-1] + b", " + b"7" * 20) == LONG


def test_long_digits_counts_a_long_number_s_digits_across_windows(monkeypatch):
    monkeypatch.setattr(middleware, "WINDOW", 7)
    assert long_digits(b" " * 30 + b"1" * SHORT_NUMBER_DIGITS) == 0
    assert long_digits(b" " * 30 + b"1" * (SHORT_NUMBER_DIGITS + 1) + b" ") == 20
    assert long_digits(b"-1.5" + b"0" * 30 + b"e-17") == 34      # every digit of a number
    assert long_digits(b"x" * 40) == 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/probe/score", "/answer"])
def test_a_body_of_long_numbers_is_refused_before_any_parser_reads_it(api, monkeypatch,
                                                                      route):
    """4,096 numbers of 4,300 digits (17.5 MB, within every other bound) held the event
    loop 0.3-0.8 s in the parser, off the loop or not (the conversion holds the GIL): the
    pre-check refuses them for their digits together, and no parser runs."""
    import app.routers.answer as answer_route
    import app.routers.openai as openai_route

    parsed = []

    def watch(model):
        real = model.model_validate_json
        monkeypatch.setattr(model, "model_validate_json",
                            lambda raw, **k: parsed.append(1) or real(raw, **k))

    watch(openai_route.ChatRequest)
    watch(answer_route.AnswerRequest)
    # FastAPI's parser (the probes); the service's own small error bodies are read too
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: (len(s) > 10_000 and parsed.append(1))
                        or _loads(s, *a, **k))
    numbers = ", ".join(["9" * 4300] * 4)
    body = f'{{"image": "{IMG}", "question": "q", "x": [{numbers}]}}'
    r = api.post(route, content=body, headers={"content-type": "application/json"})
    assert parsed == []
    got = _openai_error(r)["message"] if route.startswith("/v1") else \
        assert_error(r, 422)["detail"]
    assert got == LONG


_loads = json.loads


# ------------------------------------------------------------------ 3. OpenAI's param
@pytest.mark.parametrize("content, message, param", [
    ([IMAGE, {"type": "text", "text": 5}], "messages[0].content[1].text: must be a string",
     "messages[0].content[1].text"),
    ([IMAGE, {"type": "text"}], "messages[0].content[1].text: required",
     "messages[0].content[1].text"),
    ([{"type": "text", "text": Q}, {"type": "video"}],
     "messages[0].content[1].type: must be 'text' or 'image_url'", "messages[0].content[1].type"),
    ([{"type": "text", "text": Q}, {"type": "image_url", "image_url": {"url": 5}}],
     "messages[0].content[1].image_url.url: must be a string",
     "messages[0].content[1].image_url.url"),
    # refused after parsing: the image's url and a text part by their index
    ([{"type": "text", "text": Q}, {"type": "image_url", "image_url": {"url": "https://x"}}],
     "messages[0].content[1].image_url.url: must be a base64 data URI",
     "messages[0].content[1].image_url.url"),
    ([{"type": "text", "text": Q}, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + b64(b"not an image")}}],
     "messages[0].content[1].image_url.url: cannot decode image",
     "messages[0].content[1].image_url.url"),
    ([{"type": "text", "text": Q}, IMAGE, {"type": "text", "text": "a" * 2001}],
     "messages[0].content[2].text: longer than 2000 characters",
     "messages[0].content[2].text"),
    # the whole content: its type, or the question its parts make together
    (5, "messages[0].content: must be a string or an array", "messages[0].content"),
    ([IMAGE, {"type": "text", "text": "?"}],
     "messages[0].content: the question (its text parts, joined) has no letter or digit",
     "messages[0].content"),
])
def test_openai_s_param_names_the_content_part_by_its_index(api, content, message, param):
    error = _openai_error(api.post("/v1/chat/completions", json=_chat(content)))
    assert error["message"].startswith(message), error
    assert error["param"] == param
