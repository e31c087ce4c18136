"""Regression tests of the fifth hostile-client review: one set of accepted values and one
message per field in both encodings, plain validation messages, a clean `answer` when the
response does not parse, and the wait for a decode slot in `timings_ms`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import random_image
from tests.helpers import assert_error, b64, png_bytes

Q = "what color is the shape?"
PNG = png_bytes(random_image(0))
IMG = b64(PNG)


def _json_answer(api, number: str):
    """/answer with `max_new_tokens` written as this JSON number, byte for byte."""
    body = f'{{"image": "{IMG}", "question": "{Q}", "max_new_tokens": {number}}}'
    return api.post("/answer", content=body, headers={"content-type": "application/json"})


def _multipart_answer(api, part: str):
    return api.post("/answer", files={"image": ("x.png", PNG)},
                    data={"question": Q, "max_new_tokens": part})


# ------------------------------------------------------------------ 1. one field, two encodings
@pytest.mark.parametrize("number", ["0", "-1", "1025", "1.5", "4.25", "1e400", "-0.0",
                                    "99999999999999999999", "1E5"])
def test_multipart_refuses_what_json_refuses_with_the_same_message(api, number):
    """The multipart part is declared application/json: it holds the JSON body's values,
    refused with the JSON body's message."""
    from_json = assert_error(_json_answer(api, number), 422, "max_new_tokens")
    from_form = assert_error(_multipart_answer(api, number), 422, "max_new_tokens")
    assert from_form["detail"] == from_json["detail"]


@pytest.mark.parametrize("number", ["4.0", "4e0", "40e-1", "0.4E1"])
def test_multipart_accepts_a_whole_number_written_with_a_fraction_as_json_does(api, number):
    """JSON Schema's `integer` (the document's) admits 4.0: the JSON body took it and the
    multipart part refused it."""
    from_json, from_form = _json_answer(api, number), _multipart_answer(api, number)
    plain = _multipart_answer(api, "4")
    assert from_json.status_code == from_form.status_code == plain.status_code == 200, \
        from_form.text
    # the same limit reached the model (greedy decoding: the same response)
    assert from_json.json()["response"] == from_form.json()["response"] == \
        plain.json()["response"]


@pytest.mark.parametrize("text", ['"4"', "true", "null", "04", "+4", "4.", ".5", "0x4",
                                  "\u0664", "4\n"])
def test_multipart_text_that_is_no_json_integer_is_refused_as_json_refuses_a_string(api, text):
    """What is not a JSON number is text, and an integer field refuses text in a JSON body
    with the same message."""
    from_json = assert_error(_json_answer(api, json.dumps("4")), 422, "max_new_tokens")
    from_form = assert_error(_multipart_answer(api, text), 422, "max_new_tokens")
    assert from_form["detail"] == from_json["detail"]


SPAN = '{"image": "IMG", "question": "q", "response": "<think>a</think><answer>red</answer>", '
INTEGER_FIELDS = [
    ("/probe/counterfactual", '{"image": "IMG", "question": "q", "counterfactual": "blank", '
                              '"max_new_tokens": %s}', "max_new_tokens", "4"),
    ("/probe/score", SPAN + '"mask": {"seed": %s}}', "mask.seed", "3"),
    ("/probe/score", SPAN + '"mask": {"target": [0, %s]}}', "mask.target.1", "9"),
    ("/probe/score_batch", '{"image": "IMG", "question": "q", "trajectories": [{"response": '
                           '"<think>a</think><answer>red</answer>", "mask": {"seed": %s}}]}',
     "trajectories.0.mask.seed", "3"),
]


@pytest.mark.parametrize("path, body, field, whole", INTEGER_FIELDS)
def test_every_integer_field_of_the_probes_reads_numbers_as_max_new_tokens_does(
        api, path, body, field, whole):
    """One rule for every integer field: a whole number with a fraction is that integer,
    any other number or type is refused with one message naming the field and its range."""
    def post(value: str):
        return api.post(path, content=(body % value).replace("IMG", IMG),
                        headers={"content-type": "application/json"})

    as_int, as_float = post(whole), post(whole + ".0")
    assert as_int.status_code == as_float.status_code == 200, as_float.text
    for bad in (whole + ".5", f'"{whole}"', "true", "NaN", "-1", "1e30"):
        detail = assert_error(post(bad), 422, f"{field}: must be an integer from ")["detail"]
        assert "; " not in detail, detail             # one message, not one per choice


def test_the_documented_multipart_part_says_what_it_takes(api):
    doc = api.get("/openapi.json").json()
    form = doc["paths"]["/answer"]["post"]["requestBody"]["content"]["multipart/form-data"]
    part = form["schema"]["properties"]["max_new_tokens"]
    assert part["type"] == "integer" and "8.0" in part["description"]
    assert form["encoding"]["max_new_tokens"]["contentType"] == "application/json"


# ------------------------------------------------------------------ 2. plain messages
R = "<think>a red circle</think><answer>red</answer>"
# What each hostile value got before: pydantic's names for a union's choices in the path
# ("mask.target.(field)"), or a bound for a value that is no number at all.
SCORE = '{"image": "IMG", "question": "q", "response": "RESP", "mask": %s}'
PLAIN = [
    ("/probe/score", SCORE % '{"ratio": NaN}', "mask.ratio: must be a number from 0 to 1"),
    ("/probe/score", SCORE % '{"ratio": -Infinity}', "mask.ratio: must be a number from 0 to 1"),
    ("/probe/score", SCORE % '{"ratio": 1.5}', "mask.ratio: must be a number from 0 to 1"),
    ("/probe/score", SCORE % '{"target": "foo"}',
     "mask.target: must be 'think', 'answer' or 'response', or an array"),
    ("/probe/score", SCORE % '{"target": [0, 1.5]}',
     "mask.target.1: must be an integer from 0 to 20000"),
    ("/probe/score", SCORE % '{"seed": -1}', "mask.seed: must be an integer from 0 to "),
    ("/probe/score_batch", '{"image": "IMG", "question": "q", "trajectories": '
                           '[{"response": "RESP", "mask": {"ratio": NaN}}]}',
     "trajectories.0.mask.ratio: must be a number from 0 to 1"),
    ("/probe/counterfactual", '{"image": "IMG", "question": "q", "counterfactual": 5}',
     "counterfactual: must be 'blank' or a base64 string of a PNG, JPEG or DICOM file"),
    ("/probe/counterfactual", '{"image": "IMG", "question": "q", "counterfactual": "abc"}',
     "counterfactual: must have at least 4 characters"),
    ("/answer", '{"image": "IMG", "question": "q", "max_new_tokens": NaN}',
     "max_new_tokens: must be an integer from 1 to 1024"),
]


@pytest.mark.parametrize("path, body, detail", PLAIN)
def test_validation_messages_name_the_request_s_fields_in_plain_words(api, path, body,
                                                                      detail):
    r = api.post(path, content=body.replace("IMG", IMG).replace("RESP", R),
                 headers={"content-type": "application/json"})
    got = assert_error(r, 422, detail)["detail"]
    assert "(field)" not in got and "Input should be" not in got and "literal[" not in got
    assert "less than" not in got and "greater than" not in got, got


def test_the_openai_route_names_its_fields_in_plain_words(api):
    """The OpenAI route shares the messages: a content part by its index, not pydantic's
    `content.str` or `content.(field).0.text.text`."""
    uri = "data:image/png;base64," + IMG
    image = {"type": "image_url", "image_url": {"url": uri}}
    cases = [
        ([{"type": "text", "text": 5}, image], {}, "messages[0].content[0].text: "),
        ([image, {"type": "image_url", "image_url": {"url": uri, "x": 1}}], {},
         "messages[0].content[1].image_url: unexpected field"),
        (5, {}, "messages[0].content: must be a string or an array"),
        ([image, {"type": "text", "text": Q}], {"temperature": float("nan")},
         "temperature: must be a number from 0 to 2"),
        ([image, {"type": "text", "text": Q}], {"n": 2}, "n: must be an integer equal to 1"),
    ]
    for content, extra, detail in cases:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                           **extra})
        r = api.post("/v1/chat/completions", content=body,
                     headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(detail), (detail, message)
        assert "(field)" not in message and ".str" not in message and "text.text" not in \
            message and "image_url.image_url" not in message, message


# ------------------------------------------------------------------ 3. a clean answer field
# (response, finished, answer): responses that do not parse, each deferred
UNUSABLE = [
    ("<think>I see a red circle, so the", False, ""),          # cut off in its reasoning
    ("<think>a red circle</think><ans", False, ""),            # cut off inside the tag
    ("<think>a red circle</think><answer", False, ""),
    ("<think>a red circle</think> red <conf", False, "red"),
    ("<think>a red circle</think><answer>red</answer><answer>blue</answer>", True, ""),
    ("<think>a red circle</think><answer></think></answer>", True, ""),
]


@pytest.mark.parametrize("text, finished, answer", UNUSABLE)
def test_answer_holds_no_piece_of_a_tag_when_the_response_does_not_parse(
        api, service, monkeypatch, text, finished, answer):
    from tests.helpers import stub_answers

    stub_answers(monkeypatch, service, text, finished=finished)
    body = api.post("/answer", json={"image": IMG, "question": Q}).json()
    assert body["response"] == text
    assert body["answer"] == answer, body["answer"]
    assert body["defer"] and set(body["defer_reasons"]) & {
        "no_answer_tag", "empty_answer", "truncated", "degenerate_repetition"}, body


@pytest.mark.parametrize("text, answer", [
    ("<think>a</think><answer>red</think></answer><confidence>9</confidence>", "red"),
    ("<think>a</think><answer><think>b</think> red </answer>", "red"),
    ("<think>a</think>red</answer>", "red"),               # no answer tag: after reasoning
    ("  Left kidney \n", "Left kidney"),                  # a plain-format actor's answer
    ("x < 5", "x < 5"),                                  # a "<" that starts no tag stays
    ("<think>a</think>\n<answer>red</answer><confidence>8</confidence>", "red"),
])
def test_parse_keeps_the_answer_and_drops_only_the_format_s_markup(text, answer):
    from models.parse import parse_response

    assert parse_response(text).answer == answer


# ------------------------------------------------------------------ 4. decode_wait
def test_the_wait_for_a_decode_slot_is_reported_in_the_timings(service, monkeypatch):
    """With one decode slot, a small request sent while a large image decodes waits for
    it before it is queued: `timings_ms.decode_wait` says how long; its own queue time does
    not hold that wait, and a request that found a slot free reports about nothing."""
    import concurrent.futures as cf
    import threading
    import time

    import app.serving as serving_module
    from tests.helpers import small_limits_client

    big = png_bytes(random_image(1, 64, 64))
    opened = serving_module.open_image
    decoding = threading.Event()

    def slow_for_big(raw, max_pixels):
        if raw == big:
            decoding.set()
            time.sleep(0.8)                   # a large image's decode, holding the slot
        return opened(raw, max_pixels)

    monkeypatch.setattr(serving_module, "open_image", slow_for_big)
    with small_limits_client(service, max_decodes=1) as c, cf.ThreadPoolExecutor(1) as pool:
        lone = c.post("/answer", json={"image": IMG, "question": Q}).json()["timings_ms"]
        held = pool.submit(c.post, "/answer", json={"image": b64(big), "question": Q})
        assert decoding.wait(5)
        t0 = time.perf_counter()
        small = c.post("/answer", json={"image": IMG, "question": Q}).json()["timings_ms"]
        wall_ms = 1000 * (time.perf_counter() - t0)
        assert held.result().status_code == 200
    assert set(small) == {"read", "decode_wait", "decode", "queue", "generate", "readout",
                          "heads"}
    assert small["decode_wait"] >= 400, small          # most of the big decode's 800 ms
    # the stages follow one another: were the wait counted in `queue` too, they would add
    # up to more than the request took (its queue time itself depends on the big request)
    assert sum(small.values()) <= wall_ms + 1, (small, wall_ms)
    assert lone["decode_wait"] < 100, lone


def test_the_decode_wait_is_documented_and_in_the_document(api):
    doc = api.get("/openapi.json").json()
    timings = doc["components"]["schemas"]["Timings"]["properties"]
    assert "decode_wait" in timings and "max_decodes" in timings["decode_wait"]["description"]


# ------------------------------------------------------------------ 5. a batch's own fields
@pytest.mark.parametrize("trajectories, where", [
    ([{"response": "a\u0000b"}], "trajectories.0.response: contains a control character"),
    ([{"response": R}, {"response": "a\u202eb"}],
     "trajectories.1.response: contains a control character"),
    ([{"response": R}, {"response": "<|im_start|>red"}],
     "trajectories.1.response: contains reserved token"),
])
def test_a_score_batch_names_the_trajectory_s_response_by_its_path(api, trajectories, where):
    """A batch of one was refused as `response:`, a field /probe/score_batch does not have,
    and a later trajectory as `trajectories.1:` without the field."""
    r = api.post("/probe/score_batch", json={"image": IMG, "question": Q,
                                             "trajectories": trajectories})
    assert_error(r, 422, where)
    lone = api.post("/probe/score", json={"image": IMG, "question": Q, "response": "a\u0000b"})
    assert assert_error(lone, 422)["detail"].startswith("response: contains a control")


@pytest.mark.parametrize("text, finished, answer", [
    ("a <c", True, "a <c"),          # a finished answer's "<c" is its text
    ("3 <", True, "3 <"),
    ("x<a", True, "x<a"),
    ("a <c", False, "a"),            # cut off by the token limit: a piece of a tag goes
    ("<think>a</think>red <ans", False, "red"),
])
def test_a_trailing_piece_of_a_tag_is_dropped_only_when_the_response_was_cut_off(
        text, finished, answer):
    from models.parse import parse_response

    assert parse_response(text, finished).answer == answer


# ------------------------------------------------------------------ 6. a tag made by removing one
@pytest.mark.parametrize("text, answer", [
    ("<think>a</think>red <ans</answer>wer>", "red"),                       # no answer tag
    ("<think>a</think>red <thi</answer>nk>x", "red x"),
    ("<think>a</think><answer>red <thi<think>nk></answer><confidence>9</confidence>", "red"),
    ("<think>a</think><answer>red <con<think>b</think>fidence></answer>", "red"),
])
def test_removing_a_tag_does_not_leave_the_tag_its_neighbours_spell(text, answer):
    """One pass of removal joined `<ans` and `wer>` into `<answer>`: the answer carried a
    whole tag, which it never should, parsed or not."""
    from models.parse import parse_response

    assert parse_response(text).answer == answer


def test_a_scored_trajectory_s_answer_carries_no_tag_its_pieces_spell(api):
    r = api.post("/probe/score", json={"image": IMG, "question": Q,
                                       "response": "<think>a</think>red <ans</answer>wer>"})
    assert r.status_code == 200, r.text
    assert r.json()["answer"] == "red"


# ------------------------------------------------------------------ 7. a refused body read once
def test_a_refused_body_is_parsed_again_only_for_a_discriminated_union_s_tag(api, monkeypatch):
    """The second parse (for field names) holds the GIL as the first does, so every other
    request waited twice as long on a refused 30 MB body; only a tag in an error's location
    (the OpenAI route's content parts) needs it, and the messages are the same."""
    import app.errors as errors

    calls = []
    parse = errors.from_json
    monkeypatch.setattr(errors, "from_json", lambda raw: calls.append(1) or parse(raw))
    bad = f'{{"image": "{IMG}", "question": "{Q}", "max_new_tokens": "8", "Extra": 1}}'
    r = api.post("/answer", content=bad, headers={"content-type": "application/json"})
    assert assert_error(r, 422)["detail"] == \
        "max_new_tokens: must be an integer from 1 to 1024; body: unexpected field"
    uri = "data:image/png;base64," + IMG
    chat = {"model": "m", "max_tokens": "8", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": Q}]}]}
    r = api.post("/v1/chat/completions", json=chat)
    assert r.json()["error"]["message"] == "max_tokens: must be an integer from 1 to 1024"
    assert calls == []
    chat["max_tokens"] = 8
    chat["messages"][0]["content"][1]["text"] = 5
    r = api.post("/v1/chat/completions", json=chat)
    assert r.json()["error"]["message"].startswith("messages[0].content[1].text: "), r.text
    assert calls == [1]


# ------------------------------------------------------------------ 8. every message in plain words
# pydantic's own wording: what its messages say, which the service's replace
PYDANTIC_WORDS = ("Input should", "should have", "after validation", "Unable to",
                  "Field required", "literal[", "(field)", "Value error", "Invalid JSON",
                  "invalid value")
SCORE_BODY = {"image": IMG, "question": Q, "response": R, "mask": {"target": "think"}}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + IMG}},
    {"type": "text", "text": Q}]}]}


def _message_of(r) -> str:
    assert r.status_code == 422, r.text
    body = r.json()
    return body["error"]["message"] if "error" in body else body["detail"]


@pytest.mark.parametrize("path, body, detail", [
    ("/probe/score", {**SCORE_BODY, "mask": 5}, "mask: must be an object"),
    ("/probe/score", {**SCORE_BODY, "mask": []}, "mask: must be an object"),
    ("/probe/score", {**SCORE_BODY, "mask": {"target": [1, 2, 3]}},
     "mask.target: must have at most 2 items"),
    ("/probe/score", {**SCORE_BODY, "mask": {"target": [1]}}, "mask.target.1: required"),
    ("/probe/score_batch", {"image": IMG, "question": Q, "trajectories": []},
     "trajectories: must have at least 1 item"),
    ("/probe/score_batch", {"image": IMG, "question": Q, "trajectories": 5},
     "trajectories: must be an array"),
    ("/probe/counterfactual", {"image": IMG, "question": Q, "counterfactual": ["blank"]},
     "counterfactual: must be 'blank' or a base64 string of a PNG, JPEG or DICOM file"),
    ("/probe/counterfactual", {"image": 5, "question": Q, "counterfactual": "blank"},
     "image: must be a base64 string of a PNG, JPEG or DICOM file"),
    ("/answer", {"question": Q}, "image: required"),
    ("/feedback", {"request_id": "x" * 65, "correct": True},
     "request_id: must have at most 64 characters"),
    ("/feedback", {"request_id": "x", "correct": 1}, "correct: must be true or false"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": []},
     "messages: must have at least 1 item"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [{}]}]},
     "messages[0].content[0].type: required"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [
        {"type": "video"}]}]}, "messages[0].content[0].type: must be 'text' or 'image_url'"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "robot", "content": "a"}]},
     "messages[0].role: must be 'system', 'developer', 'user' or 'assistant'"),
])
def test_pydantic_s_wording_is_replaced_by_the_service_s(api, path, body, detail):
    """The review's leftovers ("mask: Input should be a valid dictionary or object to
    extract fields from", "Tuple should have at most 2 items after validation, not 3",
    "List should have at least 1 item after validation", "Unable to extract tag using
    discriminator 'type'"), each said plainly under the request's own field."""
    got = _message_of(api.post(path, json=body))
    assert got == detail, got


def _core_schema_kinds(model) -> set[str]:
    from typing import get_args

    from pydantic_core.core_schema import CoreSchemaType

    known, found, todo = set(get_args(CoreSchemaType)), set(), [model.__pydantic_core_schema__]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            if isinstance(x.get("type"), str) and x["type"] in known:
                found.add(x["type"])
            todo.extend(x.values())
        elif isinstance(x, list | tuple):
            todo.extend(x)
    return found


# The errors pydantic-core raises per kind of schema node (its validators' error types;
# `default`, `nullable` and `union` add none of their own), and in parsing JSON.
RAISES = {
    "str": {"string_type", "string_too_short", "string_too_long", "string_pattern_mismatch",
            "string_unicode"},
    "int": {"int_type", "int_parsing", "int_from_float", "greater_than_equal",
            "less_than_equal", "greater_than", "less_than"},
    "float": {"float_type", "float_parsing", "finite_number", "greater_than_equal",
              "less_than_equal", "greater_than", "less_than"},
    "bool": {"bool_type", "bool_parsing"},
    "literal": {"literal_error"},
    "list": {"list_type", "too_short", "too_long"},
    "tuple": {"tuple_type", "too_short", "too_long", "missing"},
    "model": {"model_type", "model_attributes_type"},
    "model-fields": {"missing", "extra_forbidden", "dict_type", "model_attributes_type"},
    "tagged-union": {"union_tag_invalid", "union_tag_not_found", "dict_type",
                     "model_attributes_type"},
    "function-before": {"value_error", "assertion_error"},
    "union": set(), "nullable": set(), "default": set(),
}
PARSING = {"json_invalid", "json_type", "recursion_loop"}


def test_every_error_type_a_request_can_raise_has_the_service_s_message():
    """Every request model's kinds of field (walked from its core schema, so a new kind is
    caught) and the errors each can raise: each has a message of the service's own (a
    type without one is answered "invalid value")."""
    import app.errors as errors
    from app.routers.calibration import PinRequest
    from app.routers.openai import ChatRequest
    from app.schemas import (
        AnswerRequest,
        CounterfactualRequest,
        FeedbackRequest,
        ScoreBatchRequest,
        ScoreRequest,
    )

    kinds = set().union(*(_core_schema_kinds(m) for m in (
        AnswerRequest, CounterfactualRequest, ScoreRequest, ScoreBatchRequest, FeedbackRequest,
        ChatRequest, PinRequest)))
    assert kinds <= set(RAISES), kinds - set(RAISES)
    reachable = set().union(PARSING, *(RAISES[k] for k in kinds))
    said = set(errors._PLAIN) | set(errors._KINDS) | errors._OWN
    assert reachable <= said, reachable - said
    assert {"integer_range", "number_range", "image_type"} <= errors._OWN
    for kind in reachable - errors._OWN:        # none falls back on pydantic's message
        msg = errors._message({"type": kind, "msg": "Input should be X", "loc": ("a",),
                               "ctx": {"min_length": 2, "max_length": 3, "ge": 0, "le": 1,
                                       "gt": 0, "lt": 1, "expected": "'a' or 'b'",
                                       "expected_tags": "'a', 'b'", "discriminator": "'t'"}})
        assert "Input should" not in msg and msg != "invalid value" or kind in (
            "value_error", "assertion_error"), (kind, msg)


def _paths(node, here=()):
    """Every field and item of a body, containers too, as (path, value)."""
    if here:
        yield here
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*here, k))
    elif isinstance(node, list):
        for k, v in enumerate(node):
            yield from _paths(v, (*here, k))


def _with(body, path, value):
    body = json.loads(json.dumps(body))
    node = body
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return body


HOSTILE = [5, 2.5, "", "ab", True, None, [], [1, 2, 3], {}, {"type": "x"}, [{}]]


@pytest.mark.parametrize("route, base", [
    ("/answer", {"image": IMG, "question": Q, "max_new_tokens": 4}),
    ("/probe/counterfactual", {"image": IMG, "question": Q, "counterfactual": "blank",
                               "reference_answer": "red"}),
    ("/probe/score", {**SCORE_BODY, "mask": {"target": [0, 5], "ratio": 1.0, "seed": 0}}),
    ("/probe/score_batch", {"image": IMG, "question": Q, "trajectories": [
        {"response": R, "mask": {"target": "think"}}]}),
    ("/feedback", {"request_id": "x", "correct": True}),
    ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": 4, "temperature": 0}),
])
def test_a_hostile_value_anywhere_is_refused_in_plain_words_under_its_own_field(
        api, monkeypatch, route, base):
    """Each field and item of each route's body replaced by values of every JSON kind:
    every refusal names a path of the body sent and none is pydantic's wording or the
    fallback for an error type without a message of the service's."""
    import app.errors as errors

    seen = []
    message = errors._message
    monkeypatch.setattr(errors, "_message", lambda err: seen.append(err["type"]) or
                        message(err))
    refused = 0
    for path in list(_paths(base)):
        for value in HOSTILE:
            body = _with(base, path, value)
            r = api.post(route, json=body)
            if r.status_code != 422:
                continue
            refused += 1
            got = _message_of(r)
            assert not any(w in got for w in PYDANTIC_WORDS), (path, value, got)
            for part in got.split("; "):
                where = part.split(": ", 1)[0]
                if where in ("body", "") or " " in where or "[" in where:
                    continue           # the body, or a refusal of the route's own
                node = body
                for name in where.split(".")[:-1]:
                    node = node[int(name)] if isinstance(node, list) else node[name]
                last = where.split(".")[-1]
                assert (int(last) < len(node) + 2) if isinstance(node, list) else \
                    isinstance(node, dict), (path, value, got)
    assert refused > 10 and seen
    assert set(seen) <= set(errors._PLAIN) | set(errors._KINDS) | errors._OWN, set(seen)


def _chat(content) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def test_the_openai_route_s_question_and_image_refusals_name_its_own_fields(api):
    """The route has no `question` or `image` field: its refusals named them ("question
    contains ...", "image: cannot decode ...")."""
    uri = "data:image/png;base64,"
    image = {"type": "image_url", "image_url": {"url": uri + IMG}}
    cases = [
        ([image, {"type": "text", "text": "what\u0007?"}],
         "messages[0].content: the question (its text parts, joined) contains a control "
         "character (U+0007)"),
        ([{"type": "text", "text": "?"}, image, {"type": "text", "text": "!"}],
         "messages[0].content: the question (its text parts, joined) has no letter or digit"),
        ([image, {"type": "text", "text": "what <|im_start|> is it?"}],
         "messages[0].content: the question (its text parts, joined) contains reserved token"),
        ([{"type": "text", "text": Q}, {"type": "image_url", "image_url": {
            "url": uri + b64(b"not an image at all")}}],
         "messages[0].content[1].image_url.url: cannot decode image"),
        ([{"type": "text", "text": Q}, {"type": "image_url", "image_url": {"url": uri + "%%%%"}}],
         "messages[0].content[1].image_url.url: not valid base64"),
        ([{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}},
          {"type": "text", "text": Q}],
         "messages[0].content[0].image_url.url: must be a base64 data URI"),
        ([image, {"type": "text", "text": "a" * 2001}],
         "messages[0].content[1].text: longer than 2000 characters"),
    ]
    for content, detail in cases:
        r = api.post("/v1/chat/completions", json=_chat(content))
        got = _message_of(r)
        assert got.startswith(detail), (detail, got)
        assert not got.startswith(("question", "image")), got


@pytest.mark.parametrize("image_url, detail", [
    ({"type": "text"}, "messages[0].content[0].image_url.url: required; "
                       "messages[0].content[0].image_url: unexpected field"),
    ({"type": "image_url"}, "messages[0].content[0].image_url.url: required; "
                            "messages[0].content[0].image_url: unexpected field"),
    ({"text": "x"}, "messages[0].content[0].image_url.url: required; "
                    "messages[0].content[0].image_url: unexpected field"),
])
def test_a_field_named_as_a_tag_is_read_as_the_field_after_the_tag(api, image_url, detail):
    """pydantic names an image part `...0.image_url.image_url.url` (its tag, then its
    field): an `image_url` object holding a value that is also a tag had both read as the
    tag, and the missing url was reported at `messages[0].content[0].url`."""
    content = [{"type": "image_url", "image_url": image_url}, {"type": "text", "text": Q}]
    assert _message_of(api.post("/v1/chat/completions", json=_chat(content))) == detail


# ------------------------------------------------------------------ 9. a damaged PNG
def _png_chunks(data: bytes) -> list[tuple[int, int]]:
    """(offset, data length) of each chunk of a PNG."""
    out, i = [], 8
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        out.append((i, n))
        i += 12 + n
    return out


def _with_chunk(data: bytes, before: int, kind: bytes, payload: bytes) -> bytes:
    """`data` with a chunk inserted before its chunk number `before`, its CRC one bit off."""
    import struct
    import zlib

    at = _png_chunks(data)[before][0]
    crc = zlib.crc32(kind + payload) ^ 1
    return data[:at] + struct.pack(">I", len(payload)) + kind + payload + \
        struct.pack(">I", crc) + data[at:]


def _bad_crc(data: bytes, chunk: int) -> tuple[bytes, int]:
    at, n = _png_chunks(data)[chunk]
    bad = bytearray(data)
    bad[at + 8 + n] ^= 1
    return bytes(bad), at


PALETTE = png_bytes(random_image(0).convert("P"))        # IHDR, PLTE, IDAT, IEND


@pytest.mark.parametrize("data, chunk", [(PNG, 0), (PNG, 1), (PNG, 2),   # IHDR, IDAT, IEND
                                         (PALETTE, 1)])                  # PLTE
def test_a_png_with_one_bad_crc_is_called_damaged_not_another_format(api, data, chunk):
    """One flipped bit in a critical chunk's CRC: PIL refused the header's as "not a PNG,
    JPEG or DICOM file" and took the image data's unchecked (altered pixels decode as
    pixels)."""
    bad, at = _bad_crc(data, chunk)
    for r in (api.post("/answer", json={"image": b64(bad), "question": Q}),
              api.post("/answer", files={"image": ("x.png", bad)},
                       data={"question": Q})):
        body = assert_error(r, 422, "image: cannot decode image: damaged PNG file (chunk "
                                    f"{chunk + 1}, at byte {at}, fails its CRC checksum)")
        assert "not a PNG" not in body["detail"]


def test_an_ancillary_chunk_with_a_bad_crc_after_the_image_data_is_served(api):
    """libpng warns about and drops an ancillary chunk (lowercase first letter) whose CRC
    fails; PIL reads one after the image data unchecked: the image decodes, unchanged."""
    from models.images import open_image

    bad = _with_chunk(PNG, 2, b"tEXt", b"Comment\x00hello")       # before IEND
    assert (np.asarray(open_image(bad)) == np.asarray(open_image(PNG))).all()
    r = api.post("/answer", json={"image": b64(bad), "question": Q})
    assert r.status_code == 200, r.text


def test_an_ancillary_chunk_with_a_bad_crc_before_the_image_data_is_called_damaged(api):
    """PIL checks every chunk before the image data and refuses the file: still damaged."""
    bad = _with_chunk(PNG, 1, b"tEXt", b"Comment\x00hello")       # before IDAT
    at = _png_chunks(PNG)[1][0]
    r = api.post("/answer", json={"image": b64(bad), "question": Q})
    assert_error(r, 422, "image: cannot decode image: damaged PNG file (chunk 2, at byte "
                         f"{at}, fails its CRC checksum)")


def test_a_png_cut_inside_its_header_is_called_damaged(api):
    r = api.post("/answer", json={"image": b64(PNG[:40]), "question": Q})
    assert_error(r, 422, "image: cannot decode image: damaged PNG file (its header cannot be "
                         "read)")


# ------------------------------------------------------------------ 10. stages that add up
def test_the_timings_cover_reading_the_request_and_decoding_its_image(service, monkeypatch):
    """A large image's request took ~5 s while its stages added up to ~2.1 s: its image's
    decoding (and the body's parsing) were in none. With decoding slowed by 0.6 s and
    parsing by 0.3 s, `decode` and `read` hold them and the stages add up to the
    request's time in the app (the access log's latency, measured around it)."""
    import time

    import app.routers.answer as answer_module
    import app.serving as serving_module
    from tests.helpers import small_limits_client

    opened, parse = serving_module.open_image, answer_module._validate_json

    def slow_open(raw, max_pixels):
        time.sleep(0.6)
        return opened(raw, max_pixels)

    def slow_parse(raw):
        time.sleep(0.3)
        return parse(raw)

    monkeypatch.setattr(serving_module, "open_image", slow_open)
    monkeypatch.setattr(answer_module, "_validate_json", slow_parse)
    with small_limits_client(service) as c:
        for send in (lambda: c.post("/answer", json={"image": IMG, "question": Q}),
                     lambda: c.post("/answer", files={"image": ("x.png", PNG)},
                                    data={"question": Q})):
            t = time.perf_counter()
            r = send()
            took = (time.perf_counter() - t) * 1000
            assert r.status_code == 200, r.text
            timings = r.json()["timings_ms"]
            assert list(timings) == ["read", "decode_wait", "decode", "queue", "generate",
                                     "readout", "heads"]
            assert timings["decode"] >= 600, timings
            assert timings["decode_wait"] < 100, timings
            assert sum(timings.values()) <= took, (timings, took)
            # all but writing the response and the test client's own work: without the
            # read and decode stages the sum would miss the slowed 0.6 s (0.9 s for JSON)
            assert sum(timings.values()) >= took - 300, (timings, took)
        parsed = c.post("/answer", json={"image": IMG, "question": Q}).json()["timings_ms"]
    assert parsed["read"] >= 300, parsed                   # the JSON body's slowed parsing
    assert timings["read"] < 300, timings                  # multipart: not parsed by it
    chat = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + IMG}},
        {"type": "text", "text": Q}]}]}
    with small_limits_client(service) as c:
        ext = c.post("/v1/chat/completions", json=chat).json()["dualread"]["timings_ms"]
    assert ext["decode"] >= 600, ext


def test_the_new_stages_are_documented_in_order(api):
    doc = api.get("/openapi.json").json()
    timings = doc["components"]["schemas"]["Timings"]["properties"]
    assert list(timings) == ["read", "decode_wait", "decode", "queue", "generate", "readout",
                             "heads"]
    from pathlib import Path

    api_md = Path(__file__).parents[1].joinpath("docs", "api.md").read_text()
    for key in timings:
        assert f"`{key}`" in api_md, key
