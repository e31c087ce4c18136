"""The embedded actor's recipe runs end to end (SFT then GRPO) in smoke mode, and so does
the calibration continuation (more GRPO on an existing actor)."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from typer.testing import CliRunner

from app.cli import app
from models.calibrate import confidence_summary
from models.data import load
from models.loading import fingerprint, load_actor
from models.train import SMOKE, grpo, reward_brier, reward_correct, reward_format, split_train
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


@pytest.fixture(scope="module")
def smoke_actor(tmp_path_factory) -> Path:
    """The whole recipe in smoke mode, once for the tests below."""
    out = tmp_path_factory.mktemp("smoke") / "a"
    res = CliRunner().invoke(app, ["train-actor", "--out", str(out), "--smoke"])
    assert res.exit_code == 0, res.output
    return out


def test_smoke_recipe_end_to_end(smoke_actor):
    card = json.loads((smoke_actor / "actor_card.json").read_text())
    assert card["recipe"]["grpo_steps"] == 2 and card["metrics"]["real"]["n"] == 32
    assert any(r["stage"] == "grpo" for r in card["log"])
    # stage 3 ran on the GRPO result, and the card holds its settings
    assert any(r["stage"] == "self_calibration" for r in card["log"])
    assert card["recipe"]["self_calibration"] is True
    assert card["recipe"]["self_calibration_config"]["steps"] == 3
    assert {"sft_and_grpo", "heads_holdout"} <= set(card["splits"])
    actor = load_actor(smoke_actor)
    assert actor.family.name == "qwen3_vl"


def test_calibration_continuation(smoke_actor, tmp_path):
    """--continue-from runs GRPO on an existing actor, leaves its parent untouched and
    writes a card naming the parent, its recipe and the μ(C) metrics."""
    parent_bytes = (smoke_actor / "model.safetensors").read_bytes()
    out = tmp_path / "cal"
    res = CliRunner().invoke(app, [
        "train-actor", "--continue-from", str(smoke_actor), "--out", str(out), "--smoke",
        "--calibration-steps", "2", "--group", "2", "--prompts", "2", "--brier-weight", "2",
        "--hard-share", "0.5", "--scan", "16"])
    assert res.exit_code == 0, res.output
    assert (smoke_actor / "model.safetensors").read_bytes() == parent_bytes
    card = json.loads((out / "actor_card.json").read_text())
    assert card["continued_from"]["fingerprint"] == fingerprint(smoke_actor)
    assert card["recipe"]["grpo_steps"] == 2 and card["recipe"]["grpo_group"] == 2
    assert card["recipe"]["brier_weight"] == 2.0
    assert "--continue-from" in card["command"] and "--brier-weight 2.0" in card["command"]
    conf = card["metrics"]["confidence"]
    assert card["metrics"]["real"]["n"] == 32 and sum(conf["mu_histogram"].values()) == 32
    assert not (out / "_grpo_tmp").exists()
    # pool of 2 steps x 2 prompts x 2 = 8 prompts, half of them misses when there are any
    assert card["mined"]["scanned"] == 16 and card["mined"]["pool"] == 8
    assert card["mined"]["hard_in_pool"] == (4 if card["mined"]["misses"] else 0)
    assert load_actor(out).family.name == "qwen3_vl"
    # the parent folder itself is refused as the output
    res = CliRunner().invoke(app, ["train-actor", "--continue-from", str(smoke_actor),
                                   "--out", str(smoke_actor), "--smoke"])
    assert res.exit_code != 0


def test_self_calibration_end_to_end(smoke_actor, tmp_path):
    """--self-calibrate continues the actor, leaves the parent untouched and writes a
    card naming the parent, the recipe, the log (validation AUROC) and μ(C) metrics."""
    parent_bytes = (smoke_actor / "model.safetensors").read_bytes()
    out = tmp_path / "self"
    res = CliRunner().invoke(app, ["train-actor", "--continue-from", str(smoke_actor),
                                   "--out", str(out), "--smoke", "--self-calibrate"])
    assert res.exit_code == 0, res.output
    assert (smoke_actor / "model.safetensors").read_bytes() == parent_bytes
    assert (out / "model.safetensors").read_bytes() != parent_bytes
    for f in smoke_actor.iterdir():    # only the weights change
        if f.is_file() and f.suffix != ".safetensors" and f.name != "actor_card.json":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    card = json.loads((out / "actor_card.json").read_text())
    assert card["continued_from"]["fingerprint"] == fingerprint(smoke_actor)
    assert card["recipe"]["steps"] == 3 and "--self-calibrate" in card["command"]
    stages = [r["stage"] for r in card["log"]]
    assert stages[0] == "own_answers" and stages.count("self_calibration") >= 2
    assert card["metrics"]["real"]["n"] == 32
    assert load_actor(out).family.name == "qwen3_vl"
    res = CliRunner().invoke(app, ["train-actor", "--out", str(tmp_path / "x"),
                                   "--self-calibrate"])
    assert res.exit_code != 0


def test_self_calibration_leaves_the_model_frozen_even_when_it_fails(smoke_actor,
                                                                      monkeypatch):
    import models.self_calibrate as sc
    from models.self_calibrate import SMOKE_SELF, self_calibrate

    def boom(*_a, **_k):
        raise RuntimeError("a training step failed")

    items = split_train(load("easyvqa:train"))[0][:40]
    for broken in (False, True):
        actor = load_actor(smoke_actor)
        if broken:      # the first training step raises
            monkeypatch.setattr(sc, "loss_of", boom)
            with pytest.raises(RuntimeError, match="training step"):
                self_calibrate(actor, items, SMOKE_SELF, [])
        else:
            self_calibrate(actor, items, SMOKE_SELF, [])
        assert not actor.model.training
        assert not any(p.requires_grad for p in actor.model.parameters())


def test_grpo_resumes_from_its_checkpoint(smoke_actor, tmp_path):
    """An interrupted continuation restarts from the last checkpoint, not from step 0."""
    items = split_train(load("easyvqa:train"))[0][:8]
    two = replace(SMOKE, grpo_steps=2, grpo_group=2, grpo_prompts=1, grpo_save_steps=1)
    grpo(smoke_actor, items, two, tmp_path, [])
    assert (tmp_path / "_grpo_tmp" / "checkpoint-2").is_dir()
    log: list[dict] = []
    grpo(smoke_actor, items, replace(two, grpo_steps=3), tmp_path, log)
    assert {"stage": "grpo", "resumed_from_step": 2} in log
    assert (tmp_path / "_grpo_tmp" / "checkpoint-3").is_dir()


def test_confidence_summary_by_hand():
    rows = [{"type": "yes/no", "correct": True, "mu": 0.9, "digit": 9},
            {"type": "yes/no", "correct": True, "mu": 0.6, "digit": 6},
            {"type": "color", "correct": False, "mu": 0.7, "digit": 10},
            {"type": "color", "correct": False, "mu": None, "digit": None}]
    s = confidence_summary(rows)
    # pairs (correct, wrong) ranked right: 0.9>0.7, 0.9>0.5, 0.6<0.7, 0.6>0.5 -> 3/4
    assert s["mu_auroc"] == 0.75
    # stated digits 0.9, 0.6 vs 1.0, 0.5 (missing): 0.9>0.5, 0.6>0.5 -> 2/4
    assert s["digit_auroc"] == 0.5
    assert s["mu_histogram"]["0.9"] == s["mu_histogram"]["0.5"] == 1
    assert sum(s["mu_histogram"].values()) == 4
    assert s["digit_histogram"] == {"6": 1, "9": 1, "10": 1, "none": 1}
    assert abs(s["mu_mean_wrong"] - 0.6) < 1e-9
    assert abs(s["brier_mu"] - (0.01 + 0.16 + 0.49 + 0.25) / 4) < 1e-4


def test_hard_pool_mixes_in_the_misses():
    """A stand-in actor that misses exactly the items in `miss`: the pool holds the
    requested share of them (repeated when too few) and no other miss."""
    from models.calibrate import hard_pool

    items = list({it.question: it for it in load("easyvqa:test")}.values())[:40]
    miss = {items[3].question, items[17].question}
    reply = {it.question: "wrong" if it.question in miss else it.answer for it in items}

    class Stub:   # run_items only needs .answer(...) -> objects with answer and parsed
        def answer(self, images, questions, max_new_tokens=64, readout="none"):
            return [SimpleNamespace(answer=reply[q], parsed=SimpleNamespace(
                well_formed=True, verbalized=0.5)) for q in questions]

    pool, info = hard_pool(Stub(), items, n=20, share=0.25, seed=9, scan=40)
    assert info == {"scanned": 40, "misses": 2, "hard_in_pool": 5, "pool": 20}
    assert len(pool) == 20 and sum(it.question in miss for it in pool) == 5
    assert {it.question for it in pool if it.question in miss} == miss


def test_grpo_options_keep_every_setting():
    """Each continuation switch reaches the trainer; none overwrites another."""
    from models.calibrate import grpo_options

    tok = load_actor().tokenizer
    opts = grpo_options(SMOKE, split_credit=True, digit_lr_factor=5.0, beta=0.1, tokenizer=tok)
    assert opts["beta"] == 0.1 and opts["reward_weights"] == [1.0, 1.0, 0.0]
    assert issubclass(opts["trainer_cls"], GRPOTrainer) and callable(opts["optimizer"])
    assert grpo_options(SMOKE, False, 1.0, 0.0, tok) == {"beta": 0.0}


def test_row_scaled_adamw_against_plain_adamw():
    """Chosen rows move `factor` times as far as under torch's AdamW; the rest the same."""
    from models.calibrate import RowScaledAdamW

    torch.manual_seed(0)
    w0 = torch.randn(6, 4)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ref = torch.optim.AdamW([a], lr=0.01, weight_decay=0.0)
    opt = RowScaledAdamW([b], b, rows=[1, 4], factor=3.0, lr=0.01, weight_decay=0.0)
    grad = torch.randn(6, 4)
    for o, p in ((ref, a), (opt, b)):
        p.grad = grad.clone()
        o.step()
    step_ref, step = (a - w0).detach(), (b - w0).detach()
    assert torch.allclose(step[[1, 4]], 3.0 * step_ref[[1, 4]], atol=1e-7)
    assert torch.allclose(step[[0, 2, 3, 5]], step_ref[[0, 2, 3, 5]], atol=1e-7)


def test_digit_positions_find_the_level_token():
    from models.calibrate import digit_positions

    tok = load_actor().tokenizer
    head = "<think>I see a red circle. so</think><answer>red</answer><confidence>"
    rows = [tok.encode(head + "7</confidence>", add_special_tokens=False),
            tok.encode("<think>x</think><answer>red</answer>", add_special_tokens=False)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    pos = digit_positions(tok, ids, mask)
    assert pos.tolist() == [len(tok.encode(head, add_special_tokens=False)), -1]
    assert tok.decode([rows[0][pos[0]]]) == "7"


def test_evaluate_actor_confidence_agrees_with_plain_evaluation():
    """--confidence adds μ(C) from the capture readout; accuracy, blank accuracy and
    well-formedness match the plain (readout-free) evaluation of the same items."""
    res = [CliRunner().invoke(app, ["evaluate-actor", "--limit", "24"] + extra)
           for extra in ([], ["--confidence"])]
    assert all(r.exit_code == 0 for r in res), [r.output for r in res]
    plain, conf = (json.loads(r.stdout) for r in res)
    for part in ("real", "blank"):
        assert plain[part] == conf[part]
    c = conf["confidence"]
    assert sum(c["mu_histogram"].values()) == 24 and 0.0 <= c["mu_mean"] <= 1.0
