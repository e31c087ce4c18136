"""The OpenAPI document tells the truth: schemathesis, every check, against live servers.

`schemathesis run --checks all` (positive and negative data, every phase, no check or
status turned off) against `dualread serve` as `make serve` starts it (the embedded actor
and heads): without an API key, with one, and with an API key and an operator key.

- The outsider's run: no hooks, as anyone would run it against the document. Its only
  failures may be the rules the document says a JSON Schema cannot state (docs/api.md, "The
  OpenAPI document"): an image that does not decode, a question or trajectory over its
  token limit, a letter posing as a Latin one, a reserved template token, and the
  multipart values schemathesis counts as invalid but sends as valid text. Any other
  failure fails the test, so every rule the document can state is checked without help.
- With tests/schemathesis_hooks.py, which gives positive requests values for exactly those
  rules (and adds two checks: one error shape, a 2xx from every operation), there may be
  no failure at all.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import LiveServer

pytest.importorskip("schemathesis")

ROOT = Path(__file__).resolve().parents[1]
KEY = "conformance-key"
OPERATOR_KEY = "conformance-operator-key"
# Examples per operation and phase: with the coverage phase's fixed cases, a few hundred
# requests a run (four runs, a few minutes in all on two idle cores).
EXAMPLES = 8
SEED = 20261201
# What a failure of the outsider's run may be: the rules docs/api.md lists as beyond a JSON
# Schema, by the server's message (service's shape or OpenAI's)
BEYOND_SCHEMA = re.compile(
    r"cannot decode image|empty image|tokens, over the limit|posing as a Latin one|"
    r"reserved token")


def schemathesis(url: str, workdir: Path, *extra: str, hooks: bool = True
                 ) -> subprocess.CompletedProcess:
    """The CLI run, from `workdir` (it keeps its crash files under ./.schemathesis and its
    report under ./report)."""
    cli = Path(sys.executable).parent / "schemathesis"
    env = {k: v for k, v in os.environ.items() if k != "SCHEMATHESIS_HOOKS"}
    if hooks:
        env["SCHEMATHESIS_HOOKS"] = "tests.schemathesis_hooks"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                          os.environ.get("PYTHONPATH")]))
    args = [str(cli), "run", f"{url}/openapi.json", "--checks", "all", "--mode", "all",
            "-n", str(EXAMPLES), "--seed", str(SEED), "--request-timeout", "60",
            "--no-color", "--generation-database", "none", *extra]
    return subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """`dualread serve` processes of the embedded model: without a key, with an API key,
    and with an API key and an operator key (its rule state in a temporary folder)."""
    # the default queue (64 jobs): a full batch of 64 trajectories is admitted
    flags = {"max_new_tokens": 8, "max_batch_size": 8, "batch_wait_ms": 5, "threads": 1}
    state = tmp_path_factory.mktemp("recert") / "recert_state.json"
    started = [LiveServer(None, None, **flags).start(),
               LiveServer(None, None, api_key=KEY, **flags).start(),
               LiveServer(None, None, api_key=KEY, operator_key=OPERATOR_KEY,
                          recert_state=str(state), **flags).start()]
    try:
        for s in started:
            s.wait_ready()
        yield [s.url for s in started]
    finally:
        for s in started:
            s.close()


def _passed(run: subprocess.CompletedProcess, url: str, **headers: str) -> None:
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "No issues found" in out, out[-6000:]
    # every operation of the document the server serves
    doc = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30).json()
    assert f"Tested: {len(_operations(doc))}\n" in out, out[-3000:]


def test_every_check_passes_without_a_key(servers, tmp_path):
    _passed(schemathesis(servers[0], tmp_path), servers[0])


def test_every_check_passes_with_a_key(servers, tmp_path):
    # with the key, as a client would send it; `ignored_auth` and `missing_required_header`
    # try the keyed operations without it and with a wrong one
    auth = f"Bearer {KEY}"
    _passed(schemathesis(servers[1], tmp_path, "-H", f"Authorization: {auth}"), servers[1],
            Authorization=auth)


def test_every_check_passes_with_an_operator_key(servers, tmp_path):
    # the operator routes (pin, unpin, rollback) are served and documented only here;
    # `ignored_auth` sends them without the operator key (403) and with a wrong one (401)
    auth = f"Bearer {KEY}"
    run = schemathesis(servers[2], tmp_path, "-H", f"Authorization: {auth}",
                       "-H", f"X-Operator-Key: {OPERATOR_KEY}")
    _passed(run, servers[2], Authorization=auth)
    assert "/calibration/rollback" in httpx.get(f"{servers[2]}/openapi.json", timeout=30,
                                                headers={"Authorization": auth}).text


def _failures(report: Path) -> list[dict]:
    """Each failed check of a run's NDJSON report: the check, the case (mode, media type,
    body) and the response (status, error message)."""
    out = []
    for line in report.read_text().splitlines():
        event = json.loads(line)
        recorder = (event.get("ScenarioFinished") or {}).get("recorder") or {}
        for cid, checks in recorder.get("checks", {}).items():
            failed = [c["name"] for c in checks if c["status"] != "success"]
            if not failed:
                continue
            case = recorder["cases"][cid]["value"]
            response = (recorder.get("interactions", {}).get(cid) or {}).get("response")
            message = ""
            if response and response.get("content"):
                text = base64.b64decode(response["content"]["$base64"]).decode("utf-8",
                                                                               "replace")
                try:
                    body = json.loads(text)
                    message = body.get("detail") or body.get("error", {}).get("message", "")
                except (ValueError, AttributeError):
                    message = text
            out.append({"checks": failed, "path": case["path"], "body": case.get("body"),
                        "mode": ((case.get("meta") or {}).get("generation") or {}).get(
                            "mode"), "media_type": case.get("media_type") or "",
                        "status": response and response["status_code"],
                        "message": message})
    return out


def _valid_per_document(doc: dict, f: dict) -> bool:
    """Whether the case's body is valid per the document, as a JSON Schema validator reads
    it (a multipart file part as any bytes)."""
    import jsonschema_rs

    content = doc["paths"][f["path"]]["post"]["requestBody"]["content"]
    media = f["media_type"].split(";")[0]
    if media not in content or not isinstance(f["body"], dict):
        return False
    body = {k: "x" if k in ("image", "file") else v for k, v in f["body"].items()}
    schema = {**content[media]["schema"], "components": doc["components"]}
    return jsonschema_rs.validator_for(schema).is_valid(body)


def _beyond_schema(f: dict, doc: dict) -> bool:
    """Whether a failure is one of the rules the document says it cannot state, or a case
    schemathesis counts as invalid that the document's schema admits."""
    if f["checks"] == ["positive_data_acceptance"] and f["status"] == 422:
        return bool(BEYOND_SCHEMA.search(f["message"]))
    if f["checks"] == ["negative_data_rejection"]:
        if f["media_type"].startswith("multipart"):
            # a part is text: a value drawn as a list, an object or a number (negative for
            # a string or an integer field) is sent as valid text, or as no part at all
            # for an empty list
            body = f["body"] if isinstance(f["body"], dict) else {}
            if any(not isinstance(v, str) for k, v in body.items()
                   if k in ("question", "max_new_tokens")):
                return True
        # schemathesis 4.32 reads \p{L} and \p{N} as Latin letters and digits only: a
        # question it takes for invalid can be valid per the document (and served)
        return _valid_per_document(doc, f)
    return False


def test_the_outsiders_run_fails_only_on_rules_beyond_a_json_schema(servers, tmp_path):
    """No hooks: every failure is one docs/api.md lists as beyond a JSON Schema (a run that
    reports an undecodable image is expected; one that reports a control character in a
    question, an empty mask span or an ungradable reference is not)."""
    run = schemathesis(servers[0], tmp_path, "--continue-on-failure", "--report", "ndjson",
                       "--report-dir", "report", hooks=False)
    out = run.stdout + run.stderr
    assert "Tested: " in out, out[-3000:]
    [report] = glob.glob(str(tmp_path / "report" / "*.ndjson"))
    failures = _failures(Path(report))
    doc = httpx.get(f"{servers[0]}/openapi.json", timeout=30).json()
    other = [f for f in failures if not _beyond_schema(f, doc)]
    assert not other, json.dumps(other[:5], default=str)[:6000]


# ------------------------------------------------------------------ the document itself
CHAT = "/v1/chat/completions"
KEYED = {("post", "/answer"), ("post", "/feedback"), ("post", "/probe/counterfactual"),
         ("post", "/probe/score"), ("post", "/probe/score_batch"), ("get", "/v1/models"),
         ("get", "/calibration"), ("post", CHAT)}


def _operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}


def test_without_a_key_nothing_asks_for_one():
    from app.main import create_app
    from app.settings import Settings

    doc = create_app(Settings()).openapi()
    assert "securitySchemes" not in doc.get("components", {})
    for op in _operations(doc).values():
        assert "security" not in op and "401" not in op["responses"]


def test_with_a_key_exactly_the_checked_operations_declare_it():
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(api_key=KEY))
    ops = _operations(app.openapi())
    assert {k for k, op in ops.items() if op.get("security")} == KEYED
    assert {k for k, op in ops.items() if "401" in op["responses"]} == KEYED
    # each 401 in the shape of its operation's other errors: OpenAI's on the OpenAI route
    for key, op in ops.items():
        shape = "OpenAIError" if key == ("post", CHAT) else "ErrorResponse"
        for code, r in op["responses"].items():
            if int(code) >= 400:
                assert r["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{shape}"}, (key, code)
    c = TestClient(app)                   # no lifespan: the model is not needed for these
    assert c.post("/answer", json={}).status_code == 401
    assert c.get("/v1/models").status_code == 401
    assert c.get("/health/live").status_code == 200
    # a method a path lacks is the router's 405 (with Allow), not the key check's 401
    r = c.post("/health/live", content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == 405 and r.headers["allow"] and set(r.json()) == {
        "detail", "request_id"}


def test_limits_that_are_settings_are_the_configured_ones():
    from app.main import create_app
    from app.settings import Settings

    doc = create_app(Settings(max_question_chars=100, max_image_bytes=3000,
                              queue_limit=10)).openapi()
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/answer"]["post"]["requestBody"]["content"]
    for fields in (schemas["ScoreRequest"]["properties"],
                   body["application/json"]["schema"]["properties"],
                   body["multipart/form-data"]["schema"]["properties"]):
        assert fields["question"]["maxLength"] == 100          # as sent
    assert schemas["ScoreRequest"]["properties"]["image"]["maxLength"] == 4000
    assert schemas["ScoreBatchRequest"]["properties"]["trajectories"]["maxItems"] == 10
    text, image = _chat_parts(doc)
    assert text["properties"]["text"]["maxLength"] == 100
    assert image["properties"]["image_url"]["properties"]["url"]["maxLength"] == \
        len("data:application/dicom;base64,") + 4000
    assert create_app(Settings()).openapi()["components"]["schemas"]["ScoreBatchRequest"][
        "properties"]["trajectories"]["maxItems"] == 64
    # the document carries no marker of its own making
    assert '"x-limit"' not in str(doc).replace("'", '"')


def _chat_parts(doc: dict) -> tuple[dict, dict]:
    """The OpenAI route's text part and image part, as its document states them."""
    body = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    parts = body["properties"]["messages"]["items"]["properties"]["content"]["items"]["oneOf"]
    by_type = {p["properties"]["type"]["const"]: p for p in parts}
    return by_type["text"], by_type["image_url"]


def test_the_document_refuses_what_the_server_refuses():
    """The issue's examples: an empty image, or an empty counterfactual, is invalid per the
    document (minLength, pattern), as it is to the server. Validated as schemathesis does
    (ECMA-262 regular expressions: `$` is the end of the text, never before a newline)."""
    import jsonschema_rs

    from app.main import create_app
    from app.settings import Settings

    doc = create_app(Settings()).openapi()

    def valid(name: str, body: dict) -> bool:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        return jsonschema_rs.validator_for(schema).is_valid(body)

    assert not valid("ScoreRequest", {"image": "", "question": "0", "response": "x"})
    assert not valid("ScoreRequest", {"image": "AAAA\n", "question": "0", "response": "x"})
    assert not valid("ScoreRequest", {"image": "AAAA====", "question": "0", "response": "x"})
    assert valid("ScoreRequest", {"image": "AAAA", "question": "0", "response": "x"})
    assert not valid("CounterfactualRequest", {"image": "AAAA", "question": "q",
                                               "counterfactual": ""})
    assert valid("CounterfactualRequest", {"image": "AAAA", "question": "q",
                                           "counterfactual": "blank"})


def test_the_chat_document_states_what_the_route_serves():
    """The OpenAI route: one user message, exactly one image (a base64 data URI of a PNG,
    JPEG or DICOM file) and text parts, `stream` false, no unknown field; what the server
    refuses for its shape is invalid per the document too."""
    import jsonschema_rs

    from app.main import create_app
    from app.settings import Settings
    from clients.schemas import B64_EXAMPLE

    doc = create_app(Settings()).openapi()
    schema = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"][
        "schema"]
    validator = jsonschema_rs.validator_for(schema)
    png = "data:image/png;base64," + B64_EXAMPLE
    image = {"type": "image_url", "image_url": {"url": png}}
    text = {"type": "text", "text": "what color is the shape?"}

    def body(*parts: dict, role: str = "user", **extra) -> dict:
        return {"model": "m", "messages": [{"role": role, "content": list(parts)}], **extra}

    def with_url(url: str) -> dict:
        return body({"type": "image_url", "image_url": {"url": url}}, text)

    assert validator.is_valid(body(image, text))
    assert validator.is_valid(body(text, image, text, max_tokens=8, stream=False))
    assert validator.is_valid(with_url("data:image/jpeg;base64,AAAA"))
    assert validator.is_valid(with_url("data:application/dicom;base64,AAA="))
    # the data URI: a documented media type, base64 (padded, one line), not empty
    for url in ("data:image/png;base64,iVBORw0KGgo...", "data:image/png;base64,",
                "data:image/png;base64,AAA", "data:image/png;base64,AAAA\n",
                "data:image/gif;base64,AAAA", "data:image/png,AAAA",
                "DATA:image/png;base64,AAAA", "http://127.0.0.1/x.png", png + " "):
        assert not validator.is_valid(with_url(url)), url
    assert not validator.is_valid(body(text))                        # no image
    assert not validator.is_valid(body(image))                       # no question
    assert not validator.is_valid(body(image, image, text))          # two images
    assert not validator.is_valid(body(image, text, role="system"))
    assert not validator.is_valid(body(image, text, stream=True))
    assert not validator.is_valid(body(image, text, n=2))
    assert not validator.is_valid(body(image, text, temperature="1"))
    assert not validator.is_valid(body(image, text, seed=1))
    assert not validator.is_valid({"model": "m", "messages": [
        {"role": "user", "content": "what color is the shape?"}]})   # a string: no image
    two = body(image, text)
    two["messages"] *= 2
    assert not validator.is_valid(two)


def test_the_letter_or_digit_class_is_the_services_rule():
    """The question's "letter or digit" (`\\p{L}` or `\\p{N}`, not a Hangul filler) is
    what `Service.check_question` looks for once the text is plain: Python's `isalnum` is
    exactly categories L and N, `plain_question` keeps every such character but the
    fillers, and makes none of a character that is not one; a JSON Schema validator
    reads the class alike (on the characters assigned in the server's Unicode)."""
    import unicodedata

    import jsonschema_rs

    from app.text import plain_question
    from clients.schemas import FILLERS, VISIBLE_LETTER_OR_DIGIT

    every = [chr(c) for c in range(0x110000)]
    assert all(c.isalnum() == (unicodedata.category(c)[0] in "LN") for c in every)
    alnum = [c for c in every if c.isalnum()]
    fillers = set(FILLERS.encode().decode("unicode_escape"))
    assert {c for c in alnum if not any(x.isalnum() for x in plain_question(c))} == fillers
    # a character changes under plain_question by NFC, the full-width and mathematical
    # forms, the blanks; none that is not a letter or digit becomes one
    others = [c for c in every if not c.isalnum() and (
        unicodedata.normalize("NFC", c) != c or 0xFF01 <= ord(c) < 0xFF5F
        or 0x1D400 <= ord(c) < 0x1D800 or c in "\u2800\U00016fe4\U0001d159")]
    assert len(others) > 100
    assert not any(any(x.isalnum() for x in plain_question(c)) for c in others)
    pattern = jsonschema_rs.validator_for({"type": "string",
                                           "pattern": VISIBLE_LETTER_OR_DIGIT})
    assigned = [c for c in every[::7] if unicodedata.category(c) not in ("Cn", "Cs")]
    assert len(assigned) > 30000
    assert all(pattern.is_valid(c) == (c.isalnum() and c not in fillers) for c in assigned)
    assert not any(pattern.is_valid(c) for c in fillers)


def test_the_document_states_the_rules_it_can():
    """Each rule a JSON Schema can state is in the document, validated as schemathesis
    validates (ECMA-262 regular expressions)."""
    import jsonschema_rs

    from app.main import create_app
    from app.settings import Settings

    doc = create_app(Settings(max_question_chars=50)).openapi()

    def validator(schema: dict):
        return jsonschema_rs.validator_for({**schema, "components": doc["components"]})

    score = validator({"$ref": "#/components/schemas/ScoreRequest"})
    base = {"image": "AAAA", "question": "what color?", "response": "<answer>red</answer>"}
    assert score.is_valid(base)
    for question in ("?", " ?! ", "\u3164", "\u3164?", "what\x1b?", "a\u202eb",
                     "x" * 51):
        assert not score.is_valid({**base, "question": question}), repr(question)
    for question in ("a\tb\nc\r", "\u0447\u0442\u043e?", "\u00bd", "\u3164a", "x" * 50,
                     "\U0001d416hat?", "\u4e00", "\u3164\u3164\u0661"):
        assert score.is_valid({**base, "question": question}), repr(question)
    assert not score.is_valid({**base, "response": "<answer>red\x00</answer>"})
    for span in ([0, 0], [5, 3], [0, 20000]):          # slices: any two in range
        assert score.is_valid({**base, "mask": {"target": span}})
    cf = validator({"$ref": "#/components/schemas/CounterfactualRequest"})
    ref = {"image": "AAAA", "question": "q", "counterfactual": "blank"}
    assert cf.is_valid({**ref, "reference_answer": "a red one"})
    assert not cf.is_valid({**ref, "reference_answer": "?!"})
    assert not cf.is_valid({**ref, "counterfactual_reference_answer": ""})
    # the multipart form: one image part, named either way, never both
    answer = doc["paths"]["/answer"]["post"]["requestBody"]["content"]
    form = validator(answer["multipart/form-data"]["schema"])
    assert form.is_valid({"image": "x", "question": "q"})
    assert form.is_valid({"file": "x", "question": "q", "max_new_tokens": 3})
    assert not form.is_valid({"image": "x", "file": "x", "question": "q"})
    assert not form.is_valid({"question": "q"})
    # the OpenAI route: a letter or digit in some text part; one generation limit
    chat = validator(doc["paths"][CHAT]["post"]["requestBody"]["content"][
        "application/json"]["schema"])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

    def body(*texts: str, **extra) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": [
            image, *({"type": "text", "text": t} for t in texts)]}], **extra}

    assert chat.is_valid(body("?", "what color"))
    assert not chat.is_valid(body("?", " "))
    assert not chat.is_valid(body("what\x07"))
    assert not chat.is_valid(body("x" * 51))
    assert chat.is_valid(body("q", max_tokens=4, max_completion_tokens=None))
    assert not chat.is_valid(body("q", max_tokens=4, max_completion_tokens=4))


def test_operator_routes_declare_the_operator_key():
    from app.main import create_app
    from app.settings import Settings

    doc = create_app(Settings(operator_key="op")).openapi()
    assert doc["components"]["securitySchemes"] == {"OperatorKey": {
        **doc["components"]["securitySchemes"]["OperatorKey"], "type": "apiKey",
        "in": "header", "name": "X-Operator-Key"}}
    ops = _operations(doc)
    for path in ("/calibration/pin", "/calibration/unpin", "/calibration/rollback",
                 "/calibration/window/reset"):
        op = ops[("post", path)]
        assert op["security"] == [{"OperatorKey": []}]
        assert {"401", "403"} <= set(op["responses"])
    assert "404" in ops[("post", "/calibration/pin")]["responses"]
    assert "409" in ops[("post", "/calibration/rollback")]["responses"]
    assert ops[("post", "/feedback")]["security"] == [{}, {"OperatorKey": []}]
    keyed = _operations(create_app(Settings(operator_key="op", api_key=KEY)).openapi())
    assert keyed[("post", "/calibration/pin")]["security"] == [
        {"HTTPBearer": [], "OperatorKey": []}]
    # without an operator key the routes are not served, nor documented
    plain = _operations(create_app(Settings()).openapi())
    assert ("post", "/calibration/pin") not in plain and "security" not in plain[
        ("post", "/feedback")]
