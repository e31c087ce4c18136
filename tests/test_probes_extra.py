"""`pip install "dualread[probes]"` in a fresh venv (no torch) runs `dualread probe` against a
live deployment: the evaluator's install of issue 32. Needs a package index; skipped, with
the reason, when pip cannot reach one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import live_servers, probe_items, random_heads

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dualread", "app", "heads", "models", "clients", "studies", "bench")
# what pip prints when it cannot get at an index (no network, no proxy, no mirror)
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Network is unreachable",
           "Temporary failure in name resolution", "No matching distribution found",
           "Could not find a version that satisfies", "ProxyError", "timed out")


def _source(dst: Path) -> Path:
    """The project as pip would build it, without the embedded actor and heads (package
    data a probe never reads; 14 MB less to copy and pack)."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "embedded")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=skip)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, dst / f)
    return dst


SERVER_STACK = ("torch", "transformers", "fastapi", "uvicorn", "pydantic_settings",
                "matplotlib", "sklearn", "scipy")


def test_probe_command_imports_no_server_stack():
    """Offline half of the check: with the server stack blocked in `sys.modules`, the
    `dualread` script prints its version, parses `probe` and imports every probe."""
    code = ("import sys\n"
            f"for name in {SERVER_STACK!r}:\n"
            "    sys.modules[name] = None\n"
            "from dualread.cli import main\n"
            "sys.argv = ['dualread', '--version']\n"
            "main()\n"
            "import clients.probes.runner, clients.probes.summary\n"
            "sys.argv = ['dualread', 'probe', '--help']\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert r.stdout.startswith(f"dualread {version}\n"), r.stdout[:300]
    assert "Grounding probes over HTTP" in r.stdout


def _wheel(src: Path, dist: Path) -> Path:
    """The project's wheel, built once by this interpreter's setuptools (the one `make`
    builds the editable install with): no isolated build env fetching setuptools first."""
    code = ("import sys\nfrom setuptools import build_meta\n"
            "print(build_meta.build_wheel(sys.argv[1]))\n")
    r = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=src, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return dist / r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def probes_venv(tmp_path_factory) -> Path:
    """A fresh venv holding only what pip resolves from the index for `dualread[probes]`.
    Cheap where it does not weaken the check: the venv gets no pip or setuptools of its own
    (this interpreter's pip installs into it with --python, resolving the same way), and
    no .pyc files are compiled ahead of use."""
    root = tmp_path_factory.mktemp("probes-extra")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    wheel = _wheel(_source(root / "src"), root / "dist")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                        "install", "--quiet", "--disable-pip-version-check", "--no-compile",
                        f"{wheel}[probes]"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        if any(s in r.stdout + r.stderr for s in OFFLINE):
            pytest.skip("pip could not reach a package index to install dualread[probes]: "
                        + (r.stderr.strip().splitlines() or ["?"])[-1][:300])
        pytest.fail(f"pip install dualread[probes] failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return venv


def _run(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # the installed copy only: no PYTHONPATH, and a working folder outside the tree
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_probes_extra_has_no_model_stack(probes_venv, tmp_path):
    for module in ("torch", "transformers", "fastapi", "pydantic_settings"):
        r = _run(probes_venv, [str(probes_venv / "bin" / "python"), "-c", f"import {module}"],
                 tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, module
    # the server's commands say what to install instead of a traceback
    r = _run(probes_venv, [str(probes_venv / "bin" / "dualread"), "serve"], tmp_path)
    assert r.returncode == 1 and 'pip install "dualread[server]"' in r.stderr
    assert "Traceback" not in r.stderr


def test_dualread_probe_runs_against_a_live_server(probes_venv, tmp_path):
    from models.loading import load_actor
    from models.tiny import build_tiny_actor

    actor_dir = str(build_tiny_actor("qwen3_vl", tmp_path / "actor"))
    heads = random_heads(tmp_path / "heads", load_actor(actor_dir))
    data, _ = probe_items(tmp_path, 3, 0, yes_no=True)
    out = tmp_path / "out"
    with live_servers(actor_dir, heads, max_new_tokens=12) as (url,):
        r = _run(probes_venv, [str(probes_venv / "bin" / "dualread"), "probe", "reliance",
                               "--url", url, "--data", data, "--out", str(out),
                               "--bootstrap", "50", "--concurrency", "2", "--no-progress"],
                 tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["items"] == 6
    assert report["reliance"]["n_items"] == 6 and report["reliance"]["n"] == 6
    rows = (out / "reliance.jsonl").read_text().splitlines()
    assert len(rows) == 6
    # no matplotlib in this install: the report is written without its figures
    assert "No figures" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))
