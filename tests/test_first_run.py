"""A newcomer's first run: heads of another actor (refuse at startup, or answer-only),
`dualread answer` printing exactly `/answer`'s JSON, the multipart `image` part, every
setting as a flag and a variable (and docs/configuration.md), `defer_reasons` codes, and
JSON log lines with time and level."""

import ast
import dataclasses
import inspect
import io
import json
import logging
import textwrap
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from app import cli
from app.defer_codes import PROBLEM_CODES, RULE_CODES, defer_codes, problem_code
from app.heads_match import mismatch
from app.logs import JsonLines
from app.main import create_app
from app.routers.answer import TWO_IMAGES
from app.service import Service
from app.settings import Settings
from app.settings_cli import env_var, flag, markdown_table
from clients.schemas import DEFER_CODES, AnswerResponse, DeferCode
from heads.dualread import FingerprintMismatch
from models import quality
from models.quality import TRUNCATED, response_problem
from tests.conftest import random_image
from tests.helpers import assert_reports_close, b64, png_bytes, random_heads, stub_answers

Q = "what color is the shape?"
ROOT = Path(__file__).resolve().parents[1]
# every field of /answer but the two that differ between any two requests
VOLATILE = ("request_id", "timings_ms")


@pytest.fixture(scope="module")
def heads_dir(actors, tmp_path_factory) -> str:
    return random_heads(tmp_path_factory.mktemp("heads"), actors["qwen3_vl"])


@pytest.fixture(scope="module")
def other_heads(actors, tmp_path_factory) -> str:
    """Heads fitted for another actor (qwen2_vl) than the one served (qwen3_vl)."""
    return random_heads(tmp_path_factory.mktemp("other-heads"), actors["qwen2_vl"])


@pytest.fixture(scope="module")
def service(actor_dirs, heads_dir):
    return Service(actor_dirs["qwen3_vl"], heads_dir)


@pytest.fixture(scope="module")
def answer_only(actor_dirs, other_heads):
    return Service(actor_dirs["qwen3_vl"], other_heads, heads_mismatch="answer-only")


def client(service, **kw) -> TestClient:
    return TestClient(create_app(Settings(max_new_tokens=8, batch_wait_ms=5, **kw), service))


@pytest.fixture
def png(tmp_path) -> Path:
    path = tmp_path / "x.png"
    random_image(0).save(path)
    return path


def fingerprints(actors) -> tuple[str, str]:
    return actors["qwen3_vl"].fingerprint, actors["qwen2_vl"].fingerprint


# ------------------------------------------------------------------ 1. heads mismatch
class Started(Exception):
    """Raised where the server would start listening."""


@pytest.fixture
def no_listen(monkeypatch):
    """`serve` stops where it would start uvicorn; the settings it got are kept."""
    import uvicorn

    got = {}

    def run(self, *a, **k):
        got["settings"] = self.config.app.state.settings
        raise Started()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return got


def test_serve_refuses_heads_of_another_actor_before_it_starts(actor_dirs, actors,
                                                               other_heads, no_listen):
    res = CliRunner().invoke(cli.app, ["serve", "--actor", actor_dirs["qwen3_vl"],
                                       "--heads", other_heads])
    assert res.exit_code == 2, res.output
    assert "settings" not in no_listen                       # never got to listening
    msg = " ".join(res.output.split())
    actor_fp, heads_fp = fingerprints(actors)
    assert actor_fp in msg and heads_fp in msg
    for way_out in ("--heads", "dualread fit-heads", "--heads-mismatch answer-only",
                    "DUALREAD_HEADS_MISMATCH=answer-only"):
        assert way_out in msg, way_out


def test_serve_starts_answer_only_when_asked(actor_dirs, other_heads, no_listen, monkeypatch):
    monkeypatch.setenv("DUALREAD_HEADS_MISMATCH", "answer-only")
    res = CliRunner().invoke(cli.app, ["serve", "--actor", actor_dirs["qwen3_vl"],
                                       "--heads", other_heads])
    assert isinstance(res.exception, Started), res.output
    assert no_listen["settings"].heads_mismatch == "answer-only"
    assert "answer-only" in res.output


def test_matching_heads_are_no_mismatch(actor_dirs, actors, heads_dir, other_heads):
    assert mismatch(actor_dirs["qwen3_vl"], heads_dir) is None
    msg = mismatch(actor_dirs["qwen3_vl"], other_heads)
    assert msg is not None and all(fp in msg for fp in fingerprints(actors))
    # a problem that is not a mismatch is the loader's to report, as before
    assert mismatch(actor_dirs["qwen3_vl"], str(Path(heads_dir) / "missing")) is None


def test_refuse_is_the_default_and_names_both_fingerprints(actor_dirs, actors, other_heads):
    with pytest.raises(FingerprintMismatch) as e:
        Service(actor_dirs["qwen3_vl"], other_heads)
    assert all(fp in str(e.value) for fp in fingerprints(actors))


def test_answer_only_answers_without_confidence(answer_only, actors):
    with client(answer_only) as c:
        r = c.post("/answer", json={"image": b64(png_bytes(random_image(0))), "question": Q})
        assert r.status_code == 200, r.text
        body = r.json()
        AnswerResponse.model_validate(body)                   # the documented shape
        assert body["confidence"] is None and body["defer"] is True
        assert body["defer_reasons"][0] == "no_heads"
        assert body["defer_reason"].startswith("no heads for this model")
        assert body["heads"] is None and body["defer_threshold"] is None
        assert body["novelty"] is None and "image_check" not in body
        assert body["model"] == actors["qwen3_vl"].fingerprint
        # the response's own problem, if any, is coded after no_heads
        res = answer_only.actor.answer([random_image(0)], [Q], 8, readout="none")[0]
        problem = response_problem(res.parsed, res.token_ids, res.finished,
                                   answer_only.needs_tag)
        assert body["defer_reasons"] == ["no_heads"] + (
            [problem_code(problem)] if problem else [])
        # the probes compute confidences: a clear 503, not a 500
        for path, extra in (("/probe/score", {"response": "red"}),
                            ("/probe/counterfactual", {"counterfactual": "blank"})):
            r = c.post(path, json={"image": b64(png_bytes(random_image(0))), "question": Q,
                                   **extra})
            assert r.status_code == 503 and "no heads for this model" in r.json()["detail"]
        assert c.get("/health/ready").status_code == 200
        assert c.get("/v1/models").json()["heads"]["mismatch"]
        assert "dualread_defer_total 1.0" in c.get("/metrics").text


def test_answer_only_with_an_unusable_response_codes_both(answer_only, monkeypatch):
    monkeypatch.setattr(answer_only, "needs_tag", True)
    stub_answers(monkeypatch, answer_only, ["red red blue"])
    with client(answer_only) as c:
        body = c.post("/answer", json={"image": b64(png_bytes(random_image(0))),
                                       "question": Q}).json()
    assert body["defer_reasons"] == ["no_heads", "no_answer_tag"]
    assert body["defer_reason"] == "no heads for this model; no answer tag"


# ------------------------------------------------------------------ 2. dualread answer
def test_cli_answer_prints_what_http_answer_returns(actor_dirs, heads_dir, service, png):
    res = CliRunner().invoke(cli.app, ["answer", "--actor", actor_dirs["qwen3_vl"], "--heads",
                                       heads_dir, "--max-new-tokens", "8", "--image", str(png),
                                       "--question", Q])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    AnswerResponse.model_validate(printed)
    with client(service) as c:
        http = c.post("/answer", files={"image": ("x.png", png.read_bytes())},
                      data={"question": Q}).json()
    assert set(printed) == set(http)
    assert {"confidence", "defer", "defer_reason", "defer_reasons"} <= set(printed)
    for k in VOLATILE:
        printed.pop(k), http.pop(k)
    assert_reports_close(printed, http)


def test_cli_answer_only_and_refusal(actor_dirs, other_heads, png, answer_only):
    args = ["answer", "--actor", actor_dirs["qwen3_vl"], "--heads", other_heads,
            "--max-new-tokens", "8", "--image", str(png), "--question", Q]
    refused = CliRunner().invoke(cli.app, args)
    assert refused.exit_code == 2 and "dualread fit-heads" in refused.output
    res = CliRunner().invoke(cli.app, [*args, "--heads-mismatch", "answer-only"])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    with client(answer_only) as c:
        http = c.post("/answer", files={"file": ("x.png", png.read_bytes())},
                      data={"question": Q}).json()
    assert printed["confidence"] is None and printed["defer_reasons"][0] == "no_heads"
    for k in VOLATILE:
        printed.pop(k), http.pop(k)
    assert printed == http


def test_cli_answer_refusal_is_the_route_s_error(actor_dirs, heads_dir, service, png):
    res = CliRunner().invoke(cli.app, ["answer", "--actor", actor_dirs["qwen3_vl"], "--heads",
                                       heads_dir, "--image", str(png), "--question", "   "])
    assert res.exit_code == 1
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    with client(service) as c:
        http = c.post("/answer", json={"image": b64(png.read_bytes()), "question": "   "})
    assert http.status_code == 422 and "422" in res.output
    assert printed["detail"] == http.json()["detail"]


# ------------------------------------------------------------------ 3. multipart image part
def test_multipart_takes_image_or_file_but_not_both(service):
    raw = png_bytes(random_image(0))
    with client(service) as c:
        by_image = c.post("/answer", files={"image": ("x.png", raw, "image/png")},
                          data={"question": Q})
        by_file = c.post("/answer", files={"file": ("x.png", raw, "image/png")},
                         data={"question": Q})
        assert by_image.status_code == by_file.status_code == 200, by_image.text
        assert by_image.json()["response"] == by_file.json()["response"]
        for parts in ([("image", ("x.png", raw)), ("file", ("y.png", raw))],
                      [("file", ("x.png", raw)), ("image", ("y.png", raw))],
                      [("image", ("x.png", raw)), ("image", ("y.png", raw))]):
            r = c.post("/answer", files=parts, data={"question": Q})
            assert r.status_code == 422 and r.json()["detail"] == TWO_IMAGES
        # an image sent as text, not as a file: told how to send it
        r = c.post("/answer", files=[("image", (None, "abc"))], data={"question": Q})
        assert r.status_code == 422 and "-F image=@" in r.json()["detail"]
        schema = c.get("/openapi.json").json()
    form = schema["paths"]["/answer"]["post"]["requestBody"]["content"][
        "multipart/form-data"]["schema"]
    assert {"image", "file"} <= set(form["properties"])
    # one complete form per name of the image part (docs/api.md)
    assert sorted(branch["required"] for branch in form["oneOf"]) == [
        ["file", "question"], ["image", "question"]]
    assert all(branch["additionalProperties"] is False for branch in form["oneOf"])


# ------------------------------------------------------------------ 4. settings everywhere
def test_docs_configuration_is_the_generated_table():
    assert (ROOT / "docs" / "configuration.md").read_text() == markdown_table(), \
        "regenerate: dualread settings --markdown > docs/configuration.md"
    res = CliRunner().invoke(cli.app, ["settings", "--markdown"])
    assert res.exit_code == 0 and res.stdout == markdown_table()
    for name in Settings.model_fields:
        assert f"`{env_var(name)}`" in markdown_table() and f"`{flag(name)}`" in \
            markdown_table()


def test_readme_configuration_is_the_generated_table():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- settings:start -->\n", 1)[1].split("\n<!-- settings:end -->", 1)[0]
    rows = [line for line in markdown_table().splitlines() if line.startswith("|")]
    assert block.splitlines() == rows, "regenerate README from: dualread settings --markdown"


def test_every_setting_is_a_serve_flag():
    command = typer.main.get_command(cli.app).commands["serve"]
    opts = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    for name in Settings.model_fields:
        for spelling in flag(name).split("/"):
            assert spelling in opts, name


def _other_value(name: str):
    """A valid value of a setting other than its default (and other than the env's)."""
    field = Settings.model_fields[name]
    kind = field.annotation
    if type(None) in get_args(kind):                          # X | None → X
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Literal:
        return next(v for v in get_args(kind) if v != field.default)
    if kind is bool:
        return not field.default
    if kind in (int, float):
        # inside every bound: the tightest upper one minus one, else the default plus one
        top = [m.le for m in field.metadata if getattr(m, "le", None) is not None]
        return kind(top[0] - 1) if top else kind((field.default or 1) + 1)
    return f"value-of-{name}"


def test_every_flag_reaches_the_settings(monkeypatch, no_listen):
    """Each flag given a non-default value arrives in the app's Settings; unset flags leave
    the variable to decide, and a flag wins over its variable."""
    import app.heads_match

    monkeypatch.setattr(app.heads_match, "mismatch", lambda *a: None)
    monkeypatch.setattr("app.main.Service", None)            # nothing may load a model
    monkeypatch.setattr("app.settings.apply_threads", lambda s: None)   # torch's, global
    want = {n: _other_value(n) for n in Settings.model_fields}
    want["port"] = 8123
    args = ["serve"]
    for name, value in want.items():
        spellings = flag(name).split("/")
        if isinstance(value, bool):
            args.append(spellings[0] if value else spellings[1])
        else:
            args += [spellings[0], str(value)]
    res = CliRunner().invoke(cli.app, args)
    assert isinstance(res.exception, Started), res.output
    got = no_listen["settings"]
    assert {n: getattr(got, n) for n in want} == want
    # a variable applies when its flag is not given; the flag wins when it is
    monkeypatch.setenv(env_var("max_question_chars"), "77")
    res = CliRunner().invoke(cli.app, ["serve"])
    assert isinstance(res.exception, Started), res.output
    assert no_listen["settings"].max_question_chars == 77
    CliRunner().invoke(cli.app, ["serve", "--max-question-chars", "78"])
    assert no_listen["settings"].max_question_chars == 78


def test_a_bad_setting_is_a_usage_error_naming_flag_and_variable():
    res = CliRunner().invoke(cli.app, ["serve", "--max-batch-size", "0"])
    assert res.exit_code == 2
    out = " ".join(res.output.split())
    assert "--max-batch-size" in out and "DUALREAD_MAX_BATCH_SIZE" in out
    res = CliRunner().invoke(cli.app, ["serve", "--heads-mismatch", "ignore"])
    assert res.exit_code == 2 and "answer-only" in res.output


# ------------------------------------------------------------------ 5. defer_reasons
def _returned_problems() -> set[str]:
    """Every value `response_problem` can return, read off its source (so a new problem
    added there without a code fails here)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(response_problem)))
    out: set[str] = set()

    def values(node):
        if isinstance(node, ast.IfExp):
            yield from values(node.body)
            yield from values(node.orelse)
        elif isinstance(node, ast.Constant):
            yield node.value
        elif isinstance(node, ast.Name):
            yield getattr(quality, node.id)
        else:
            raise AssertionError(f"response_problem returns {ast.dump(node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and node.value is not None:
            out.update(v for v in values(node.value) if v is not None)
    return out


def test_every_response_problem_has_a_code_of_its_own():
    problems = _returned_problems()
    assert TRUNCATED in problems and len(problems) >= 4
    assert problems == set(PROBLEM_CODES)
    assert len(set(PROBLEM_CODES.values())) == len(PROBLEM_CODES)
    assert problem_code("a problem added later") is DeferCode.unusable_response


def test_every_code_has_a_description_and_the_schema_lists_them(service):
    assert set(DEFER_CODES) == set(DeferCode)
    with client(service) as c:
        schema = c.get("/openapi.json").json()["components"]["schemas"]
    assert set(schema["DeferCode"]["enum"]) == {c.value for c in DeferCode}


def test_the_rule_s_flags_are_the_ones_coded(service):
    """Every flag of `Heads.defer_reasons` but "problem" has its code (a flag added to the
    rule without one fails here)."""
    assert set(service.heads.defer_reasons([0.5])) == set(RULE_CODES) | {"problem"}


def test_codes_and_defer_agree_on_the_real_rule(service):
    heads = service.heads
    tau = heads.defer_threshold
    for p in (0.0, tau - 1e-6, tau, min(1.0, tau + 1e-3), 1.0):
        for problem in (None, *PROBLEM_CODES):
            codes = defer_codes(heads, p, None, problem)
            defer, reason = heads.decide(p, None, problem)
            assert bool(codes) == defer, (p, problem)
            assert (DeferCode.low_confidence in codes) == (p < tau)
            assert (problem_code(problem) in codes) == (problem is not None)
            assert (reason is None) == (not codes or codes == [DeferCode.low_confidence])


@pytest.mark.parametrize("flag_name, code", [("tau", "low_confidence"),
                                             ("novelty", "novel_states")])
def test_each_flag_of_the_rule_reaches_answer_as_its_code(service, monkeypatch, flag_name,
                                                          code):
    import numpy as np

    real = service.heads.defer_reasons

    def only(p, novelty_p=None, problems=None):
        why = real(p, novelty_p, problems)
        return {k: np.full(len(v), k == flag_name) for k, v in why.items()}

    monkeypatch.setattr(service.heads, "defer_reasons", only)
    stub_answers(monkeypatch, service, ["<think>a</think><answer>red</answer>"])
    with client(service) as c:
        body = c.post("/answer", json={"image": b64(png_bytes(random_image(0))),
                                       "question": Q}).json()
        pair = c.post("/probe/counterfactual", json={
            "image": b64(png_bytes(random_image(0))), "question": Q,
            "counterfactual": "blank"}).json()
    assert body["defer"] is True and body["defer_reasons"] == [code]
    assert pair["real"]["defer_reasons"] == [code]


@pytest.mark.parametrize("text, finished, code", [
    ("red red blue", True, "no_answer_tag"),
    ("<think>a</think><answer></answer>", True, "empty_answer"),
    ("<think>a a a a a a a a a a</think><answer>red</answer>", True,
     "degenerate_repetition"),
    ("<think>a red circle on a", False, "truncated"),
])
def test_each_response_problem_reaches_answer_as_its_code(service, monkeypatch, text,
                                                          finished, code):
    monkeypatch.setattr(service, "needs_tag", True)
    monkeypatch.setattr(service.heads, "policy",
                        dataclasses.replace(service.heads.policy, tau=0.0))   # trust anything
    stub_answers(monkeypatch, service, [text], finished=finished)
    with client(service) as c:
        body = c.post("/answer", json={"image": b64(png_bytes(random_image(0))),
                                       "question": Q}).json()
    assert body["defer"] is True and body["defer_reasons"] == [code], body["defer_reason"]


def test_a_released_answer_has_no_code(service, monkeypatch):
    monkeypatch.setattr(service, "needs_tag", True)
    monkeypatch.setattr(service.heads, "policy",
                        dataclasses.replace(service.heads.policy, tau=0.0))
    stub_answers(monkeypatch, service, ["<think>a</think><answer>red</answer>"])
    with client(service) as c:
        body = c.post("/answer", json={"image": b64(png_bytes(random_image(0))),
                                       "question": Q}).json()
    assert body["defer"] is False and body["defer_reasons"] == []


# ------------------------------------------------------------------ 6. log lines
def _utc(stamp: str) -> datetime:
    when = datetime.fromisoformat(stamp)
    assert when.utcoffset() == timedelta(0), stamp
    return when


def test_log_lines_are_json_with_time_and_level():
    fmt = JsonLines()
    rec = logging.LogRecord("dualread.access", logging.INFO, __file__, 1,
                            json.dumps({"route": "/answer", "status": 200}), None, None)
    line = json.loads(fmt.format(rec))
    assert line["level"] == "INFO" and line["route"] == "/answer" and line["status"] == 200
    assert abs(_utc(line["time"]).timestamp() - rec.created) < 1e-3
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        exc = sys.exc_info()
    rec = logging.LogRecord("dualread.service", logging.ERROR, __file__, 1,
                            "item failed: %s", ("ValueError",), exc)
    line = json.loads(fmt.format(rec))
    assert line["level"] == "ERROR" and line["message"] == "item failed: ValueError"
    assert "boom" in line["traceback"]


def test_the_service_logs_through_json_lines(service):
    with client(service) as c:
        handler = logging.getLogger("dualread.access").handlers[0]
        # swapped by hand: the stream it holds may be an earlier test's captured stderr,
        # closed since (setStream would flush it)
        buf, old = io.StringIO(), handler.stream
        handler.stream = buf
        try:
            assert c.get("/health/live").status_code == 200
        finally:
            handler.stream = old
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines and all({"time", "level", "logger"} <= set(x) for x in lines)
    access = [x for x in lines if x.get("route") == "/health/live"]
    assert access and access[0]["level"] == "INFO"
    _utc(access[0]["time"])
