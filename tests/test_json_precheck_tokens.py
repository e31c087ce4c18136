"""The JSON pre-check stops at the first token that valid JSON cannot hold there.

Tokens such as `{}{}...`, `"a""a"...` or a run of closing brackets count toward none of the
pre-check's bounds (keys, items, depth, values): before this check a 30 MB body of them
kept a worker thread busy for about 100 s. Valid bodies are judged as before."""

from __future__ import annotations

import json

import pytest

import app.middleware as mw
from app.middleware import json_problem

N = 200_000


@pytest.mark.parametrize("body", [
    b"[" + b"{}" * N + b"]",            # siblings without commas
    b"[" + b'"a"' * N + b"]",           # strings without commas
    b'""' * N,                          # top-level strings
    b"}" * N,                           # closes outside every container
    b'{"a":1}' + b",[]" * N,            # tokens after the root value
    b'{"a":1' + b"}" * N,               # closes past the root
])
def test_invalid_token_runs_stop_the_scan(monkeypatch, body: bytes) -> None:
    seen = []
    real = mw._tokens

    def counted(b: bytes):
        for t in real(b):
            seen.append(t)
            yield t

    monkeypatch.setattr(mw, "_tokens", counted)
    assert json_problem(body) is None          # invalid: left to the route's parser
    assert len(seen) < 10                      # not N tokens of Python work
    with pytest.raises(ValueError):
        json.loads(body)


def test_valid_bodies_keep_their_verdicts() -> None:
    assert json_problem(b'{"a": [{}, [], "x", {"b": [1, 2]}], "c": "d"}') is None
    assert json_problem(b'  "root"  ') is None
    assert json_problem(b"[[], [[]], {}]") is None
    assert json_problem(b'{"a": 1, "a": 2}') == "body: an object has a duplicate key"
    deep = b"[" * 17 + b"]" * 17
    assert "deeper than 16" in json_problem(deep)
    assert "more than 32 fields" in json_problem(
        json.dumps({f"k{i}": [{}] for i in range(33)}).encode())
