"""The OpenAPI document tells the truth: schemathesis, every check, against live servers.

`schemathesis run --checks all` (positive and negative data, every phase, no check or
status turned off) against `dualread serve` as `make serve` starts it (the embedded actor
and heads), once without an API key and once with one. Any failure fails the test.
The hooks (tests/schemathesis_hooks.py) give positive requests valid images, questions,
trajectories and mask spans, which a JSON Schema cannot describe, and add two checks:
one error shape, and a 2xx from every operation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LiveServer

pytest.importorskip("schemathesis")

ROOT = Path(__file__).resolve().parents[1]
KEY = "conformance-key"
# Examples per operation and phase: with the coverage phase's fixed cases, about 250
# requests a run (two runs, a few minutes in all on two cores).
EXAMPLES = 15
SEED = 20261201


def schemathesis(url: str, *extra: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).parent / "schemathesis"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    args = [str(cli), "run", f"{url}/openapi.json", "--checks", "all", "--mode", "all",
            "-n", str(EXAMPLES), "--seed", str(SEED), "--request-timeout", "60",
            "--no-color", *extra]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def servers():
    """Two `dualread serve` processes of the embedded model: without and with a key."""
    flags = {"max_new_tokens": 8, "queue_limit": 32, "max_batch_size": 8,
             "batch_wait_ms": 5, "threads": 1}
    plain = LiveServer(None, None, **flags).start()
    keyed = LiveServer(None, None, api_key=KEY, **flags).start()
    try:
        plain.wait_ready()
        keyed.wait_ready()
        yield plain.url, keyed.url
    finally:
        plain.close()
        keyed.close()


def _passed(run: subprocess.CompletedProcess) -> None:
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "No issues found" in out, out[-6000:]
    assert "Tested: 8" in out, out[-3000:]           # every operation of the document


def test_every_check_passes_without_a_key(servers):
    _passed(schemathesis(servers[0]))


def test_every_check_passes_with_a_key(servers):
    # with the key, as a client would send it; `ignored_auth` and `missing_required_header`
    # try the keyed operations without it and with a wrong one
    _passed(schemathesis(servers[1], "-H", f"Authorization: Bearer {KEY}"))
