"""`dualread --version`: the installed distribution's version, before any command runs."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from app.cli import app, package_version

ROOT = Path(__file__).resolve().parents[1]


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_flag_prints_the_package_version():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output == f"dualread {pyproject_version()}\n"


def test_version_is_eager():
    """Printed and exited before a command's own options are checked."""
    res = CliRunner().invoke(app, ["--version", "answer"])
    assert res.exit_code == 0 and res.output == f"dualread {pyproject_version()}\n"


def test_commands_still_run_without_it():
    res = CliRunner().invoke(app, ["probe", "--help"])
    assert res.exit_code == 0 and "Grounding probes" in res.output


def test_the_installed_command():
    exe = Path(sys.executable).parent / "dualread"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"dualread {pyproject_version()}\n"


def test_a_source_tree_never_installed(monkeypatch):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert package_version() == "unknown (not installed)"
