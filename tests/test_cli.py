import json

import numpy as np
import pytest
from typer.testing import CliRunner

from app.cli import app
from tests.conftest import random_image


def test_help_lists_subcommands():
    out = CliRunner().invoke(app, ["--help"]).output
    for cmd in ("answer", "train-actor", "evaluate-actor"):
        assert cmd in out


def test_answer_readout_shapes(actor_dirs, tmp_path):
    img = tmp_path / "x.png"
    random_image(5).save(img)
    res = CliRunner().invoke(app, ["answer", "--actor", actor_dirs["qwen3_vl"], "--image",
                                   str(img), "--question", "what color?", "--readout-shapes",
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


# ------------------------------------------------------------------ fit-heads, evaluate
QS = ["what color is the shape?", "what shape is it?", "is there a red circle?",
      "how many shapes?"]
ANSWERABLE = {"what color is the shape?", "how many shapes?"}


def _image_ids(per_split: dict[str, int]) -> list[str]:
    """Image ids that give each fitting split the stated number of images."""
    from heads.fit import image_split

    out, left = [], dict(per_split)
    for k in range(1000):
        name = f"img{k}"
        if left.get(image_split(name), 0) > 0:
            left[image_split(name)] -= 1
            out.append(name)
    return out


@pytest.fixture(scope="module")
def labelled(actors, tmp_path_factory):
    """Correctness is a function of the question: the reference is the actor's own
    (default-length) answer for two questions and a wrong one for the other two."""
    actor = actors["gemma3"]           # random Qwen tiny actors answer blanks
    root = tmp_path_factory.mktemp("cli-data")
    ids = _image_ids({"reader": 6, "temperature": 3, "defer": 3})
    pairs = [(i, q) for i in ids for q in QS]
    imgs = {i: random_image(300 + k, 32, 32) for k, i in enumerate(ids)}
    for i, img in imgs.items():
        img.save(root / f"{i}.png")
    # one batched call: the default 64 new tokens are the expensive part
    res = actor.answer([imgs[i] for i, _ in pairs], [q for _, q in pairs], readout="none")
    rows = [{"id": f"{i}-{k}", "image": f"{i}.png", "image_id": i, "question": q,
             "answer": r.answer if q in ANSWERABLE else "definitely wrong"}
            for k, ((i, q), r) in enumerate(zip(pairs, res))]
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return f"jsonl:{root / 'd.jsonl'}"


def test_fit_heads_then_evaluate(actor_dirs, labelled, tmp_path):
    from models.data import load, sample
    from models.loading import load_actor

    actor_dir, heads_dir, report_dir = actor_dirs["gemma3"], tmp_path / "heads", tmp_path / "ev"
    res = CliRunner().invoke(app, ["fit-heads", "--actor", actor_dir, "--data", labelled,
                                   "--limit", "48", "--risk", "0.3", "--out", str(heads_dir),
                                   "--cache", str(tmp_path / "cache"), "--allow-dirty",
                                   "--novelty-per-family", "2"])
    assert res.exit_code == 0, res.output
    assert "defer below tau=" in res.output
    card = json.loads((heads_dir / "heads_card.json").read_text())
    # the retired image check: no entry, no term of the rule, no file
    assert "image_check" not in card and "image-check" not in card["defer_rule"]
    assert not list(heads_dir.glob("image_check*"))
    assert card["actor_fingerprint"] == load_actor(actor_dir).fingerprint
    assert card["limit"] == 48 and card["data"] == labelled
    assert sum(card["splits"][k] for k in ("reader", "temperature", "defer_calibration")) == 48
    assert card["defer"]["target_risk"] == 0.3 and card["defer"]["n_calibration"] > 0
    # the command reruns the fit: options off their defaults are in it, defaults are not
    assert " --risk 0.3" in card["command"] and " --limit 48" in card["command"]
    assert "--delta" not in card["command"] and "--seed" not in card["command"]
    # drift's reference: the composite detector's clean sample, saved and loaded back
    from heads.dualread import Heads

    n_clean = card["novelty"]["clean_sample"]["n"]
    assert n_clean > 0 and len(Heads.load(heads_dir).novelty.clean_scores()) == n_clean

    res = CliRunner().invoke(app, ["evaluate", "--actor", actor_dir, "--heads", str(heads_dir),
                                   "--data", labelled, "--limit", "16", "--bootstrap", "5",
                                   "--methods", "dualread,psr,per", "--out", str(report_dir)])
    assert res.exit_code == 0, res.output
    report = json.loads((report_dir / "report.json").read_text())
    d = report["datasets"][labelled]
    assert d["n"] == 16 and set(d["methods"]) == {"dualread", "psr", "per"}
    # the same seeded sample, labelled here from the references alone
    items = sample(load(labelled), 16)
    expected = np.mean([it.answer != "definitely wrong" for it in items])
    assert d["accuracy"] == pytest.approx(expected)
    # heads fitted through the CLI carry the label: the question decides correctness
    assert d["methods"]["dualread"]["auroc"] >= 0.9
    assert "| dualread |" in (report_dir / "report.md").read_text()


def test_evaluate_actor_on_four_items(actors, actor_dirs, tmp_path):
    """Two references are the actor's own greedy answers, two are wrong: real-image
    accuracy is 0.5 exactly, by answer type as labelled; the blank drop is the difference."""
    actor = actors["gemma3"]
    imgs = [random_image(700 + k, 32, 32) for k in range(4)]
    qs = QS
    own = [r.answer for r in actor.answer(imgs, qs, 64, readout="none")]
    rows = []
    for k, (img, q, a) in enumerate(zip(imgs, qs, own)):
        img.save(tmp_path / f"e{k}.png")
        rows.append({"id": f"e{k}", "image": f"e{k}.png", "question": q,
                     "answer": a if k < 2 else "definitely wrong",
                     "answer_type": "mine" if k < 2 else "wrong"})
    (tmp_path / "e.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    res = CliRunner().invoke(app, ["evaluate-actor", "--actor", actor_dirs["gemma3"],
                                   "--data", f"jsonl:{tmp_path / 'e.jsonl'}", "--batch", "4"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert out["real"]["n"] == 4 and out["real"]["accuracy"] == 0.5
    assert out["real"]["by_type"] == {"mine": 1.0, "wrong": 0.0}
    assert out["blank"]["n"] == 4
    assert out["blank_drop"] == pytest.approx(0.5 - out["blank"]["accuracy"], abs=1e-4)


@pytest.mark.parametrize("flag", ["--image-check", "--no-image-check", "--image-data"])
def test_fit_heads_has_no_image_check_options(flag, tmp_path):
    """The pixel image check is retired: its options are gone, not silently ignored."""
    res = CliRunner().invoke(app, ["fit-heads", "--out", str(tmp_path / "h"), flag, "x"])
    assert res.exit_code == 2 and "No such option" in res.output
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("flag,value", [("--risk", "1"), ("--risk", "0"), ("--risk", "1.5"),
                                        ("--delta", "0"), ("--delta", "1"),
                                        ("--delta", "nan"), ("--risk", "-0.1")])
def test_fit_heads_refuses_a_risk_or_delta_outside_the_open_unit_interval(flag, value,
                                                                          tmp_path):
    """r ≥ 1 would certify a threshold that keeps nothing, δ ≥ 1 one without evidence:
    refused as a usage error before the actor is loaded or anything is written."""
    res = CliRunner().invoke(app, ["fit-heads", "--out", str(tmp_path / "h"), flag, value])
    assert res.exit_code == 2, res.output
    assert "strictly between 0 and 1" in res.output
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("args,message", [
    (["--data", "nonexistent:spec"], "bad data spec 'nonexistent:spec'"),
    (["--data", "easyvqa:test~bogus:3"], "unknown family 'bogus'"),
    (["--limit", "0"], "greater than or equal to 1"),
])
def test_fit_heads_refuses_a_wrong_data_spec_or_limit_before_loading_the_actor(
        args, message, tmp_path, monkeypatch):
    import models.loading

    def no_actor(*a, **k):
        raise AssertionError("the actor was loaded before the options were checked")

    monkeypatch.setattr(models.loading, "load_actor", no_actor)
    res = CliRunner().invoke(app, ["fit-heads", "--out", str(tmp_path / "h"),
                                   "--allow-dirty", *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "h").exists()
