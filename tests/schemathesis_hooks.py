"""Schemathesis hooks: positive requests get the values JSON Schema cannot describe.

The OpenAPI document states every rule a JSON Schema can (types, lengths, the base64
alphabet, the characters of questions and trajectories, a letter or digit, enums, ranges,
item counts, mask spans as slices, one generation limit on the OpenAI route, no unknown
fields). What is left depends on content a schema cannot read; the field's `format` names
it and its description states it:
- an image (`image-base64`, the multipart `image` or `file` part, the OpenAI route's
  `image-data-uri`): bytes of a PNG, JPEG or DICOM file that decodes;
- a question (`question`; on the OpenAI route the text parts, joined by newlines): at most
  the service's token limit (tokens of the model's tokenizer), no letter of another script
  posing as a Latin one (a rule over words), no reserved template token;
- a trajectory (`trajectory`): at most the token limit, no reserved template token.

A case generated as *positive* (valid per the document), in any phase, gets for each such
field whose value may break those rules a value that keeps them; the rest of the case is
left as generated (so the document's own patterns are exercised too). A negative multipart
case whose violation does not survive being sent as text gets one that does
(`wire_negative`). The checks and expected statuses are untouched. Errors are in the
service's shape, or OpenAI's on the OpenAI route (`one_error_shape`).

Used by tests/test_openapi_conformance.py, and by hand:
    SCHEMATHESIS_HOOKS=tests.schemathesis_hooks schemathesis run URL/openapi.json --checks all
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import zlib

import schemathesis
from PIL import Image
from schemathesis.transport.serialization import Binary

from app.routers.openai import PATH as OPENAI_PATH
from app.settings import Settings
from app.text import mixed_script_letter, plain_question
from models.images import ImageError, open_image

# Plain ASCII text for a question that did not keep the rules: one token a character at
# most, no '|' (every reserved marker is `<|...|>`).
_QUESTION = re.compile(r"[A-Za-z0-9 ,.?!'()-]")
# The default token limits (`dualread serve` as the tests start it)
QUESTION_TOKENS = Settings().max_question_tokens
RESPONSE_TOKENS = Settings().max_response_tokens


def _images() -> list[bytes]:
    """A few small real files: PNG and JPEG, colour and grey, square and not."""
    out = []
    for mode, size, colour, fmt in (("RGB", (8, 8), (200, 30, 30), "PNG"),
                                    ("L", (1, 1), 128, "PNG"),
                                    ("RGB", (32, 20), (20, 40, 220), "JPEG"),
                                    ("RGB", (5, 40), (0, 160, 0), "PNG")):
        buf = io.BytesIO()
        Image.new(mode, size, colour).save(buf, format=fmt)
        out.append(buf.getvalue())
    return out


IMAGES = _images()


def _pick(seed: object, options: list):
    """One of `options`, the same for the same generated value (a run stays reproducible)."""
    return options[zlib.crc32(repr(seed).encode()) % len(options)]


def _raw(value: object) -> bytes | None:
    data = getattr(value, "data", value)            # schemathesis wraps binary parts
    return data if isinstance(data, bytes) else None


def _decodes(data: bytes) -> bool:
    try:
        open_image(data)
    except ImageError:
        return False
    return True


def image_b64(value: object) -> str:
    if isinstance(value, str):
        try:
            if _decodes(base64.b64decode(value, validate=True)):
                return value
        except (binascii.Error, ValueError):
            pass
    return base64.b64encode(_pick(value, IMAGES)).decode()


def data_uri(value: object) -> str:
    """A base64 data URI of an image that decodes, under the media type of its bytes."""
    if isinstance(value, str):
        _, comma, payload = value.partition(",")
        try:
            if comma and _decodes(base64.b64decode(payload, validate=True)):
                return value
        except (binascii.Error, ValueError):
            pass
    data = _pick(value, IMAGES)
    kind = "image/jpeg" if data.startswith(b"\xff\xd8") else "image/png"
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_file(value: object) -> object:
    data = _raw(value)
    # wrapped as schemathesis wraps a file: raw bytes fail the schema's `type: string`,
    # and the case would be counted as negative
    return value if data is not None and _decodes(data) else Binary(_pick(value, IMAGES))


def _fits(value: object, budget: int) -> bool:
    """Within `budget` tokens however the text tokenises (a byte-level tokenizer spends at
    most one token a UTF-8 byte), no reserved `<|...|>` marker, no look-alike letter."""
    return isinstance(value, str) and len(value.encode()) <= budget and "<|" not in value \
        and mixed_script_letter(plain_question(value)) is None


def question(value: object, budget: int = 0) -> object:
    """`value` when it keeps the rules above, else a plain ASCII question within `budget`
    (default: the question token limit)."""
    budget = budget or QUESTION_TOKENS
    if _fits(value, budget):
        return value
    kept = "".join(c for c in str(value) if _QUESTION.fullmatch(c))[:200]
    return f"what color is the shape? {kept}"[:max(budget, 25)].strip()


def response(value: object) -> object:
    if _fits(value, RESPONSE_TOKENS):
        return value
    kept = "".join(c for c in str(value) if c.isalnum() or c == " ")[:100]
    return f"<think>a red shape {kept}</think><answer>red</answer>"


def chat(body: dict) -> dict:
    """An OpenAI chat request: each message's image part a data URI that decodes, its text
    parts together within the question's token budget (one `question` once joined)."""
    body = dict(body)
    messages = []
    for m in body["messages"] if isinstance(body["messages"], list) else []:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            texts = [p for p in m["content"] if isinstance(p, dict) and p.get("type") == "text"]
            share = (QUESTION_TOKENS - len(texts)) // max(len(texts), 1)   # newlines join
            parts = []
            for p in m["content"]:
                if p in texts:
                    p = {**p, "text": question(p.get("text"), share)}
                elif isinstance(p, dict) and isinstance(p.get("image_url"), dict):
                    p = {**p, "image_url": {**p["image_url"],
                                            "url": data_uri(p["image_url"].get("url"))}}
                parts.append(p)
            m = {**m, "content": parts}
        messages.append(m)
    body["messages"] = messages
    return body


def repair(body: dict, multipart: bool = False) -> dict:
    """`body` with each field named above given a value that keeps its rules."""
    body = dict(body)
    if multipart:                       # the image part may be named `image` or `file`
        for part in ("image", "file"):
            if part in body:
                body[part] = image_file(body[part])
    elif "image" in body:
        body["image"] = image_b64(body["image"])
    if "counterfactual" in body and body["counterfactual"] != "blank":
        body["counterfactual"] = image_b64(body["counterfactual"])
    if "question" in body:
        body["question"] = question(body["question"])
    if "response" in body:
        body["response"] = response(body["response"])
    if isinstance(body.get("trajectories"), list):
        body["trajectories"] = [{**t, "response": response(t["response"])}
                                if isinstance(t, dict) and "response" in t else t
                                for t in body["trajectories"]]
    if "messages" in body:
        body = chat(body)
    return body


def wire_negative(body: dict) -> dict:
    """A negative multipart body whose text fields stay negative once sent.

    Every part is text on the wire: a `question` drawn as an object, a number or a
    one-item list arrives as a valid string (`{"": 3}` is a question with a digit in it),
    and an empty list or object sends no part at all, which for the optional
    `max_new_tokens` is a valid request. Schemathesis still counts such a case as negative
    (it cannot judge a body with a file in it as sent), so each becomes a value that is
    invalid as sent: an empty question, a `max_new_tokens` that is not an integer."""
    body = dict(body)
    if "question" in body and not isinstance(body["question"], str):
        body["question"] = ""
    if body.get("max_new_tokens") in ([], {}):
        body["max_new_tokens"] = "x"
    return body


@schemathesis.hook
def map_case(context, case):
    meta = case.meta
    if meta is None or not isinstance(case.body, dict):
        return case
    multipart = (case.media_type or "").startswith("multipart/")
    if meta.generation.mode.is_negative:
        if multipart:
            case.body = wire_negative(case.body)
        return case
    case.body = repair(case.body, multipart)
    if multipart:
        # Schemathesis re-checks a body a hook changed against the schema, and a body with a
        # file in it cannot be checked (it then counts the case as negative). `repair` only
        # writes values the schema admits, so the changed body is taken as generated.
        case._record_starting_state()
    return case


@schemathesis.check
def one_error_shape(ctx, response, case):
    """Every error is `{"detail": str, "request_id": str}`, its id also in `x-request-id`
    (405s included: they come from the router, before any route). On the OpenAI route it
    is OpenAI's `{"error": {"message": str, "type": str, "param": str | null, "code": str |
    null}}`, the id in `x-request-id` only."""
    if response.status_code < 400:
        return None
    body = response.json()
    rid = response.headers.get("x-request-id")
    rid = rid[0] if isinstance(rid, list) else rid      # schemathesis: a list per header
    if case.operation.path == OPENAI_PATH:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"message", "type", "param",
                                                          "code"}, body
        assert isinstance(error["message"], str) and error["message"], body
        assert isinstance(error["type"], str) and error["type"], body
        assert all(error[k] is None or isinstance(error[k], str) and error[k]
                   for k in ("param", "code")), body
        assert isinstance(rid, str) and rid, (rid, body)
        return None
    assert isinstance(body, dict) and set(body) == {"detail", "request_id"}, body
    assert isinstance(body["detail"], str) and body["detail"], body
    assert rid == body["request_id"], (rid, body)
    return None


# What an operation answers a valid request with when the state says no, as documented:
# pin an unknown rule version (404), roll back with nothing to roll back to (409: on a
# fresh server, always)
STATE_OUTCOMES = {404, 409}


@schemathesis.check
class EveryOperationAnswers:
    """Fail when an operation never answered 2xx (or a documented state outcome, 404 or
    409): its valid requests were all refused, so the run did not exercise what it
    serves."""

    def __init__(self) -> None:
        self.answered: set[str] = set()
        self.tested: set[str] = set()

    def after_response(self, ctx, response, case):
        self.tested.add(case.operation.label)
        if 200 <= response.status_code < 300 or response.status_code in STATE_OUTCOMES:
            self.answered.add(case.operation.label)

    def after_run(self, ctx):
        missing = sorted(self.tested - self.answered)
        assert not missing, f"no 2xx answer from {missing}"
