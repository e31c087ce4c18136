"""The import layering of docs/architecture.md holds: `lint-imports` checks the contracts
in pyproject.toml ([tool.importlinter]): the layers (dualread > studies | bench > app >
heads > models > clients), the client and probes extras' reach, and no import circle
between the modules of a package."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail("lint-imports is missing: it comes with the dev extra (import-linter)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}   # this tree, not an installed copy
    r = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_every_package_is_under_the_rules():
    """A new top-level package outside root_packages would escape every contract."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert found == set(cfg["root_packages"])
    layered = {m.strip() for layer in cfg["contracts"][0]["layers"] for m in layer.split("|")}
    assert layered == found
