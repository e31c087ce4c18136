"""POST /v1/chat/completions with the official `openai` client against a live server: the
answer and DualRead's reading agree with /answer's, errors come in OpenAI's shape."""

from __future__ import annotations

import httpx
import pytest

from app.settings import Settings
from tests.conftest import random_image
from tests.helpers import b64, live_servers, png_bytes, random_heads

openai = pytest.importorskip("openai")

KEY = "test-key-123"
Q = "what color is the shape?"
ERROR_KEYS = {"message", "type", "param", "code"}


def data_uri(seed: int) -> str:
    return "data:image/png;base64," + b64(png_bytes(random_image(seed)))


def user(question: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def url(actor_dirs, actors, tmp_path_factory):
    heads = random_heads(tmp_path_factory.mktemp("openai-heads"), actors["qwen3_vl"])
    with live_servers(actor_dirs["qwen3_vl"], heads, max_new_tokens=8, api_key=KEY) as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def client(url):
    # no retries: a refused request must surface as its own error, once
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def answer(url: str, seed: int, question: str = Q, **extra) -> dict:
    r = httpx.post(url + "/answer", json={"image": b64(png_bytes(random_image(seed))),
                                          "question": question, **extra},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["dualread"]


@pytest.mark.parametrize("seed", [0, 1])
def test_answer_and_reading_match_the_answer_route(client, url, seed):
    got = client.chat.completions.create(model="dualread", messages=user(Q, data_uri(seed)))
    want = answer(url, seed)
    assert got.object == "chat.completion" and got.model == "dualread"
    [choice] = got.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert choice.message.content == want["answer"]
    ext = got.model_extra["dualread"]
    assert ext["response"] == want["response"] and ext["answer"] == want["answer"]
    for k, v in want["confidence"].items():
        assert ext["confidence"][k] == pytest.approx(v, abs=1e-6), k
    for k in ("defer", "defer_reason", "defer_threshold", "model", "heads"):
        assert ext[k] == want[k], k
    assert got.id == "chatcmpl-" + ext["request_id"] and ext["request_id"] != want["request_id"]


def test_request_id_takes_feedback(client, url):
    got = client.chat.completions.create(model="any-name", messages=user(Q, data_uri(2)))
    rid = got.model_extra["dualread"]["request_id"]
    r = httpx.post(url + "/feedback", json={"request_id": rid, "correct": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.json()["accepted"] is True


def test_max_tokens_is_the_generation_limit(client, url):
    got = client.chat.completions.create(model="dualread", messages=user(Q, data_uri(3)),
                                         max_tokens=1)
    want = answer(url, 3, max_new_tokens=1)
    assert got.model_extra["dualread"]["response"] == want["response"]
    assert got.model_extra["dualread"]["defer_reason"] == want["defer_reason"]
    # cut at the limit: OpenAI's "length", so a client reading only choices sees it
    assert "truncated" in want["defer_reasons"]
    assert got.choices[0].finish_reason == "length"
    full = answer(url, 3)
    assert len(want["response"]) <= len(full["response"])


def test_question_as_a_string_part_list_is_joined(client, url):
    """Two text parts are the question's lines."""
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "what color"}, {"type": "text", "text": "is the shape?"},
        {"type": "image_url", "image_url": {"url": data_uri(4), "detail": "low"}}]}]
    got = client.chat.completions.create(model="dualread", messages=msgs)
    assert got.model_extra["dualread"]["response"] == \
        answer(url, 4, "what color\nis the shape?")["response"]


# `param` of the image's url: `user` puts the image part first
IMAGE = "messages[0].content[0].image_url.url"


def refusal(exc: pytest.ExceptionInfo, status: int, param: str | None) -> str:
    e = exc.value
    assert e.status_code == status
    assert set(e.body) == ERROR_KEYS, e.body        # the SDK keeps the "error" object
    assert e.param == param and e.type == e.body["type"] and e.code == e.body["code"]
    assert e.response.headers["x-request-id"]
    return e.body["message"]


def test_wrong_key_is_an_authentication_error(url):
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model="dualread", messages=user(Q, data_uri(0)))
    refusal(exc, 401, None)
    assert exc.value.type == "authentication_error" and exc.value.code == "invalid_api_key"


def test_remote_url_is_refused_not_fetched(client):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(
            model="dualread", messages=user(Q, "http://127.0.0.1:9/secret.png"))
    msg = refusal(exc, 422, IMAGE)
    assert "data URI" in msg and exc.value.type == "invalid_request_error"


@pytest.mark.parametrize("head", ["data:image/gif;base64", "data:image/png",
                                  "data:image/PNG;base64", "data:;base64"])
def test_a_data_uri_names_a_documented_media_type(client, head):
    """The document's pattern: image/png, image/jpeg or application/dicom, base64."""
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(
            model="dualread", messages=user(Q, f"{head}," + b64(png_bytes(random_image(0)))))
    assert "data URI" in refusal(exc, 422, IMAGE)


@pytest.mark.parametrize("media_type, fmt", [("image/jpeg", "JPEG"), ("image/png", "PNG")])
def test_a_documented_media_type_is_served(client, media_type, fmt):
    url = f"data:{media_type};base64," + b64(png_bytes(random_image(5), fmt))
    got = client.chat.completions.create(model="dualread", messages=user(Q, url))
    assert got.choices[0].message.content == got.model_extra["dualread"]["answer"]


def test_base64_that_does_not_decode(client):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(
            model="dualread", messages=user(Q, "data:image/png;base64,iVBORw0KGgo..."))
    assert "base64" in refusal(exc, 422, IMAGE)


def test_bytes_that_are_not_an_image(client):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(
            model="dualread", messages=user(Q, "data:image/png;base64," + b64(b"nope")))
    refusal(exc, 422, IMAGE)


def test_an_image_over_the_limit_is_413(client):
    big = "data:image/png;base64," + b64(b"\0" * (10 * 1024 * 1024 + 10))
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="dualread", messages=user(Q, big))
    refusal(exc, 413, IMAGE)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "system", "content": "be brief"}, *user(Q, "data:,")], "messages[0].role"),
    ([{"role": "user", "content": Q}], "messages[0].content"),       # no image
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}] * 2
       + [{"type": "text", "text": Q}]}], "messages[0].content"),     # two images
    ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": Q}] * 9}],
     "messages[0].content"),                                          # over MAX_PARTS
    (user(Q, data_uri(0)) * 2, "messages"),                           # two user messages
])
def test_messages_the_service_cannot_serve(client, messages, param):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(model="dualread", messages=messages)
    assert refusal(exc, 422, param).strip()


def test_the_length_limit_holds_per_text_part(client):
    """The document states the question length per text part (a JSON Schema cannot add
    up parts): each part within it is served, though the joined question is longer."""
    limit = Settings().max_question_chars
    # invisible characters count toward the length as sent, not toward the tokens
    long = ["what" + "\u200b" * (limit - 4), "color?" + "\u200b" * (limit - 6)]
    content = [{"type": "image_url", "image_url": {"url": data_uri(0)}},
               *({"type": "text", "text": t} for t in long)]
    got = client.chat.completions.create(model="dualread",
                                         messages=[{"role": "user", "content": content}])
    assert got.choices[0].message.content is not None
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(model="dualread",
                                       messages=user(long[0] + "\u200b", data_uri(0)))
    # the part is named by its index; the joined question's checks name the content
    assert f"longer than {limit} characters" in refusal(exc, 422, "messages[0].content[1].text")


def test_question_checks_are_the_answer_routes(client):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(model="dualread",
                                       messages=user("what\x1b[2J?", data_uri(0)))
    assert "control character" in refusal(exc, 422, "messages[0].content")


@pytest.mark.parametrize("kwargs, param", [
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    # one name or the other, as the document says (it cannot say "both, if equal")
    ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
])
def test_parameters_the_service_does_not_honour(client, kwargs, param):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(model="dualread", messages=user(Q, data_uri(0)),
                                       **kwargs)
    refusal(exc, 422, param)


def test_middleware_refusals_use_the_same_shape(url):
    """Errors sent before the route runs (the JSON pre-check, the media type) are
    rewritten too, and the route's errors keep the request id header."""
    auth = {"Authorization": f"Bearer {KEY}"}
    wide = {f"k{i}": i for i in range(40)}     # over the pre-check's 32 keys per object
    r = httpx.post(url + "/v1/chat/completions", json=wide, headers=auth, timeout=30)
    assert r.status_code == 422 and set(r.json()) == {"error"}
    assert set(r.json()["error"]) == ERROR_KEYS and "32 fields" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", content=b"x", timeout=30,
                   headers={**auth, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert r.headers["x-request-id"]
    # the other routes keep the service's own shape
    r = httpx.post(url + "/answer", json=wide, headers=auth, timeout=30)
    assert set(r.json()) == {"detail", "request_id"}
