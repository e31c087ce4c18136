"""The embedded actor's recipe runs end to end (SFT then GRPO) in smoke mode."""

import json

from models.loading import load_actor
from models.train import reward_brier, reward_correct, reward_format
from models.trajectory import image_facts, parse_question, trajectory, truth


def test_rewards():
    good = "<think>I see a red circle. so</think><answer>red</answer><confidence>9</confidence>"
    wrong = "<think>I see a red circle. so</think><answer>blue</answer><confidence>9</confidence>"
    assert reward_correct([good, wrong], answer=["red", "red"]) == [1.0, 0.0]
    assert reward_format([good, "red"]) == [0.2, 0.0]
    b = reward_brier([good, wrong], answer=["red", "red"])
    assert abs(b[0] - (1 - 0.01)) < 1e-9 and abs(b[1] - (1 - 0.81)) < 1e-9
    conv = [[{"role": "assistant", "content": good}]]
    assert reward_correct(conv, answer=["red"]) == [1.0]


def test_trajectory_truth_table():
    assert truth("red", "circle", parse_question("is there not a blue shape?")) == "yes"
    assert truth("red", "circle", parse_question("is no circle present?")) == "no"
    assert truth("red", "circle", parse_question("what is the red shape?")) == "circle"
    assert truth("red", "circle", parse_question("what color is the circle?")) == "red"
    t = trajectory("red", "circle", "does the image contain a blue shape?", confidence=7)
    assert t == ("<think>I see a red circle. The question asks if there is a blue shape; the "
                 "colour is red, so the answer is no.</think><answer>no</answer>"
                 "<confidence>7</confidence>")


def test_image_facts_agree_with_every_answer():
    from models.data import load

    items = load("easyvqa:test")
    facts = image_facts(items)
    assert len(facts) > 800
    assert all(truth(*facts[i.image_id], parse_question(i.question)) == i.answer
               for i in items if i.image_id in facts)


def test_smoke_recipe_end_to_end(tmp_path):
    from typer.testing import CliRunner

    from app.cli import app

    res = CliRunner().invoke(app, ["train-actor", "--out", str(tmp_path / "a"), "--smoke"])
    assert res.exit_code == 0, res.output
    card = json.loads((tmp_path / "a" / "actor_card.json").read_text())
    assert card["recipe"]["grpo_steps"] == 2 and card["metrics"]["real"]["n"] == 32
    assert any(r["stage"] == "grpo" for r in card["log"])
    assert {"sft_and_grpo", "heads_holdout"} <= set(card["splits"])
    actor = load_actor(tmp_path / "a")
    assert actor.family.name == "qwen3_vl"
