"""The OpenAPI document tells the truth: schemathesis, every check, against live servers.

`schemathesis run --checks all` (positive and negative data, every phase, no check or
status turned off) against `dualread serve` as `make serve` starts it (the embedded actor
and heads), once without an API key and once with one. Any failure fails the test.
The hooks (tests/schemathesis_hooks.py) give positive requests valid images, questions,
trajectories and mask spans, which a JSON Schema cannot describe, and add two checks:
one error shape (OpenAI's on the OpenAI route), and a 2xx from every operation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import LiveServer

pytest.importorskip("schemathesis")

ROOT = Path(__file__).resolve().parents[1]
KEY = "conformance-key"
# Examples per operation and phase: with the coverage phase's fixed cases, about 250
# requests a run (two runs, a few minutes in all on two cores).
EXAMPLES = 15
SEED = 20261201


def schemathesis(url: str, workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    """The CLI run, from `workdir` (it keeps its crash files under ./.schemathesis)."""
    cli = Path(sys.executable).parent / "schemathesis"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    args = [str(cli), "run", f"{url}/openapi.json", "--checks", "all", "--mode", "all",
            "-n", str(EXAMPLES), "--seed", str(SEED), "--request-timeout", "60",
            "--no-color", *extra]
    return subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def servers():
    """Two `dualread serve` processes of the embedded model: without and with a key."""
    # the default queue (64 jobs): a full batch of 64 trajectories is admitted
    flags = {"max_new_tokens": 8, "max_batch_size": 8, "batch_wait_ms": 5, "threads": 1}
    plain = LiveServer(None, None, **flags).start()
    keyed = LiveServer(None, None, api_key=KEY, **flags).start()
    try:
        plain.wait_ready()
        keyed.wait_ready()
        yield plain.url, keyed.url
    finally:
        plain.close()
        keyed.close()


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
        assert fields["question"]["maxLength"] == 400          # as sent: 4× the limit
    assert schemas["ScoreRequest"]["properties"]["image"]["maxLength"] == 4000
    assert schemas["ScoreBatchRequest"]["properties"]["trajectories"]["maxItems"] == 10
    text, image = _chat_parts(doc)
    assert text["properties"]["text"]["maxLength"] == 400
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
