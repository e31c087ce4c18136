"""The client side installs without the model stack (the `client` extra).

Each check runs in a fresh interpreter whose `sys.modules` maps the heavy packages to
None, so any import of them, however indirect, raises ImportError there and the block
cannot leak into the rest of the test session.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "PIL", "sklearn", "scipy", "transformers", "numpy")


def run_blocked(code: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    prelude = ("import sys\n"
               f"for name in {blocked!r}:\n"
               "    sys.modules[name] = None\n")
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_block_is_real():
    """Sanity: the same prelude makes `import torch` fail (else the tests below prove
    nothing)."""
    r = run_blocked("import torch", ("torch",))
    assert r.returncode != 0 and "import of torch halted" in r.stderr


def test_http_client_imports_with_httpx_and_pydantic_only():
    r = run_blocked("import clients.http, clients.schemas\n"
                    "print(clients.http.DualReadClient.__name__)", HEAVY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "DualReadClient"


@pytest.mark.parametrize("module", ["clients.maths", "clients.ccg", "clients.grounding"])
def test_probe_maths_needs_numpy_only(module):
    r = run_blocked(f"import {module}", tuple(h for h in HEAVY if h != "numpy"))
    assert r.returncode == 0, r.stderr
