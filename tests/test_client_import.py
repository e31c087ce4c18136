"""The client side installs without the model stack (the `client` extra).

Each check runs in a fresh interpreter whose `sys.modules` maps the heavy packages to
None, so any import of them, however indirect, raises ImportError there and the block
cannot leak into the rest of the test session.
"""

import re
import subprocess
import sys
import tomllib
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


def test_counterfactual_constants_import_without_pillow():
    """The blank image's definition lives client-side; only building it needs Pillow."""
    r = run_blocked("import clients.counterfactual as c\n"
                    "print(c.BLANK_SIZE, c.BLANK_RGB)\n"
                    "try:\n    c.blank_image()\nexcept ImportError:\n    print('needs PIL')",
                    HEAVY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["(224, 224) (128, 128, 128)", "needs PIL"]


def test_cli_without_the_server_stack_says_what_to_install():
    r = run_blocked("import app.cli", ("typer",))
    assert r.returncode == 1
    assert 'pip install "dualread[server]"' in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ the declared dependencies
MODEL_STACK = {"torch", "transformers", "pillow", "scikit-learn", "scipy"}


def requirement_names(reqs: list[str]) -> set[str]:
    """PEP 508 strings → normalised project names (PEP 503: lower case, runs of -_. → -)."""
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r)[0]).lower()
            for r in reqs}


def test_requirement_names_by_hand():
    assert requirement_names(["Pillow>=10", "scikit_learn", "ray[serve]>=2.50",
                              "torch ; sys_platform == 'linux'"]) == \
        {"pillow", "scikit-learn", "ray", "torch"}


def test_client_install_declares_no_model_stack():
    """`pip install dualread` / `dualread[client]` must not pull torch & co (read from
    pyproject.toml, so a regression fails without a network)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base, client = requirement_names(project["dependencies"]), requirement_names(extras["client"])
    assert {"httpx", "pydantic", "numpy"} <= base and client == base
    assert not (base | client) & MODEL_STACK
    # the model stack is still declared, as the server extra
    assert MODEL_STACK <= requirement_names(extras["server"])
