"""fit-heads and evaluate end to end on a tiny actor and a constructed dataset."""

import json

import numpy as np
import pytest

from heads import registry
from heads.dualread import Heads
from heads.evaluate import METHODS, evaluate
from heads.fit import fit_heads, image_split
from models.data import load
from tests.helpers import own_or_wrong_dataset

MAX_NEW = 6


@pytest.fixture(scope="module")
def dataset(actors, tmp_path_factory):
    """Two questions per image: the reference is the actor's own answer for the first and
    a wrong one for the second. Every split holds both classes, and the label is a
    function of the question, which the readout carries, so fitted heads can learn it."""
    return own_or_wrong_dataset(actors["gemma3"], tmp_path_factory.mktemp("ds"), 60, 100,
                                MAX_NEW)


def test_image_split_is_disjoint_and_stable():
    ids = [f"img{i}" for i in range(2000)]
    splits = [image_split(i) for i in ids]
    assert splits == [image_split(i) for i in ids]
    share = {s: splits.count(s) / len(ids) for s in set(splits)}
    assert abs(share["reader"] - 0.6) < 0.05 and abs(share["defer"] - 0.2) < 0.05


def test_fit_save_load_and_evaluate(actors, dataset, tmp_path):
    actor = actors["gemma3"]
    items = load(dataset)
    heads, info = fit_heads(actor, items, cache_dir=tmp_path / "cache", max_new_tokens=MAX_NEW,
                            target_risk=0.3, novelty_per_family=3)
    assert info["accuracy"] == pytest.approx(0.5, abs=0.05)
    assert sum(info["splits"][k] for k in ("reader", "temperature", "defer_calibration")) == 120
    assert heads.t_pre > 0 and heads.t_post > 0 and heads.policy is not None
    assert {"sc2", "sc4", "sc8", "semantic"} <= set(heads.platt)
    heads.save(tmp_path / "heads", {"command": "test", "git_commit": "0123abcd4567", **info})
    card = json.loads((tmp_path / "heads" / "heads_card.json").read_text())
    for key in ("actor_fingerprint", "feature_dim", "kappa", "temperatures", "defer", "splits"):
        assert key in card
    assert card["feature_dim"] == actor.hidden_size
    # The cache makes a second run reuse the readouts.
    assert any((tmp_path / "cache").glob("base-*.safetensors"))
    loaded = Heads.load(tmp_path / "heads", actor.fingerprint)
    # every method these heads hold: on this data no answer has a flip rule, so the
    # answer-consistency reader is skipped at fit time
    assert not loaded.has(registry.get("answer_consistency"))
    methods = tuple(m for m in METHODS if loaded.has(registry.get(m)))
    report = evaluate(actor, loaded, [dataset], tmp_path / "eval", methods, bootstrap=20,
                      max_new_tokens=MAX_NEW)
    d = report["datasets"][dataset]
    assert d["n"] == 120 and set(d["methods"]) == set(methods)
    # the question decides correctness: heads that learnt it rank right answers first
    for m in ("dualread", "psr", "per", "p_state"):
        assert d["methods"][m]["auroc"] >= 0.9, (m, d["methods"][m]["auroc"])
    for m, row in d["methods"].items():
        assert {"auroc", "ece", "ece10", "brier", "aurc", "n"} <= set(row), m
        assert 0 <= row["ece"] <= 1 and 0 <= row["brier"] <= 1
        lo, hi = row["brier_ci"]
        assert lo <= hi
    saved = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert saved["datasets"][dataset]["accuracy"] == pytest.approx(d["accuracy"])
    # the heads by the id the service reports for them, not only their fit command
    heads_id = f"{actor.fingerprint}-0123abcd"
    assert saved["heads_id"] == heads_id == loaded.heads_id
    assert saved["actor_fingerprint"] == actor.fingerprint and saved["heads"] == "test"
    md = (tmp_path / "eval" / "report.md").read_text()
    assert f"heads `{heads_id}`" in md and f"Actor `{actor.fingerprint}`" in md
    assert md.count("| dualread |") == 1
    assert len(list((tmp_path / "eval").glob("*.png"))) == 3
    assert np.isfinite(d["methods"]["dualread"]["brier"])
