import json

from typer.testing import CliRunner

from app.cli import app
from tests.conftest import random_image


def test_help_lists_subcommands():
    out = CliRunner().invoke(app, ["--help"]).output
    for cmd in ("answer", "train-actor", "evaluate-actor"):
        assert cmd in out


def test_answer_json(actor_dirs, tmp_path):
    img = tmp_path / "x.png"
    random_image(5).save(img)
    res = CliRunner().invoke(app, ["answer", "--actor", actor_dirs["qwen3_vl"], "--image",
                                   str(img), "--question", "what color?", "--json",
                                   "--max-new-tokens", "5"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"answer", "response", "readout_shapes"} <= set(out)
    assert out["readout_shapes"]["h_pre"] == [64]


def test_answer_missing_actor_is_a_clear_error(tmp_path):
    img = tmp_path / "x.png"
    random_image(5).save(img)
    res = CliRunner().invoke(app, ["answer", "--actor", str(tmp_path), "--image", str(img),
                                   "--question", "q"])
    assert res.exit_code != 0
    assert "no actor at" in str(res.exception)
