"""The pixel image check is retired (issue 27): heads whose defer rule was certified with it
are refused when they load, never served without it; the shipped heads have none; a
stored response that carries its field or code still parses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.defer_codes import RULE_CODES
from clients.schemas import AnswerResponse, DeferCode
from heads.defer import DeferPolicy
from heads.dualread import Heads, RetiredImageCheck

ROOT = Path(__file__).resolve().parents[1]
OLD_RULE = ("defer if DualRead < tau or novelty p-value < alpha or image-check p-value < "
            "alpha or the response does not parse")
# what an earlier version wrote for a fitted check (heads/embedded before issue 27's rule)
OLD_ENTRY = {"kind": "knn", "feature": "pixels", "alpha": 0.01, "n_fit": 150,
             "n_calibration": 199, "files": ["image_check.safetensors", "image_check.json"]}


def _policy(tau: float = 0.5) -> DeferPolicy:
    return DeferPolicy(tau=tau, target_risk=0.05, delta=0.1, coverage=0.5, empirical_risk=0.0,
                       risk_upper_bound=0.05, n_calibration=100, feasible=True)


def _older(folder: Path, **card_changes) -> Path:
    """Heads as an earlier version saved them with an image check: the card names the
    check and the rule's term, the check's files lie beside it."""
    Heads(dim=2, policy=_policy()).save(folder, {"command": "test"})
    card = json.loads((folder / "heads_card.json").read_text())
    card.update({"image_check": OLD_ENTRY, "defer_rule": OLD_RULE, **card_changes})
    (folder / "heads_card.json").write_text(json.dumps(card))
    (folder / "image_check.json").write_text("{}")
    return folder


def test_heads_certified_with_the_check_are_refused_at_load(tmp_path):
    with pytest.raises(RetiredImageCheck, match="fit-detectors"):
        Heads.load(_older(tmp_path / "both"))
    # either trace of the check is enough: the card's entry, or the term of its rule
    with pytest.raises(RetiredImageCheck):
        Heads.load(_older(tmp_path / "entry", defer_rule="defer if DualRead < tau"))
    with pytest.raises(RetiredImageCheck):
        Heads.load(_older(tmp_path / "rule", image_check=None))


def test_heads_without_the_check_load_as_before(tmp_path):
    """A card whose check entry is null (heads fitted since the check was off by default,
    or refitted by `fit-detectors`) states a rule without it: it loads."""
    folder = _older(tmp_path / "h", image_check=None,
                    defer_rule="defer if DualRead < tau or the response does not parse")
    heads = Heads.load(folder)
    assert heads.policy.tau == 0.5 and "image-check" not in heads.defer_rule


def test_only_the_detector_refit_may_drop_the_check(tmp_path):
    """`dualread fit-detectors` replaces the detectors, so it loads such heads without the
    check; saving them again writes neither the check's entry nor its term."""
    folder = _older(tmp_path / "h")
    heads = Heads.load(folder, drop_image_check=True)
    assert not hasattr(heads, "image_check")
    heads.save(folder, heads.card)
    card = json.loads((folder / "heads_card.json").read_text())
    assert "image_check" not in card and "image-check" not in card["defer_rule"]
    assert Heads.load(folder).defer_rule == "defer if DualRead < tau or the response does " \
                                            "not parse"


def test_the_service_refuses_such_heads(actor_dirs, actors, tmp_path):
    """Serving fails to start rather than serve a rule other than the certified one."""
    from app.service import Service
    from tests.helpers import random_heads

    folder = Path(random_heads(tmp_path / "h", actors["qwen3_vl"]))
    card = json.loads((folder / "heads_card.json").read_text())
    card.update({"image_check": OLD_ENTRY})
    (folder / "heads_card.json").write_text(json.dumps(card))
    with pytest.raises(RetiredImageCheck):
        Service(actor_dirs["qwen3_vl"], str(folder))
    assert Heads.load(folder, actors["qwen3_vl"].fingerprint, drop_image_check=True)


def test_the_shipped_heads_have_no_image_check():
    heads = Heads.load(ROOT / "heads" / "embedded")
    assert "image-check" not in heads.defer_rule and not heads.card.get("image_check")
    assert set(heads.novelty.parts) == {"image", "question", "pixels", "layout"}
    assert not list((ROOT / "heads" / "embedded").glob("image_check*"))


def test_the_check_is_gone_from_the_code():
    for module in ("image_check", "check_process", "image_check_study"):
        assert not (ROOT / "heads" / f"{module}.py").exists()
    assert set(Heads(dim=2).defer_reasons([0.5])) == {"tau", "novelty", "problem"}
    assert DeferCode.image_flagged not in RULE_CODES.values()       # never emitted


def test_a_stored_response_with_the_check_still_parses():
    """Responses stored by earlier versions carry `image_check` and may carry the code
    `image_flagged`: the client model still reads them (the code stays in the enum)."""
    stored = {"answer": "red", "response": "<answer>red</answer>",
              "confidence": {"dualread": 0.97, "psr": 0.95, "per": 0.98, "verbalized": 0.9},
              "defer": True,
              "defer_reason": "image quality unlike the fitting images (image-check p < 0.01)",
              "defer_reasons": ["image_flagged"], "defer_threshold": 0.71,
              "novelty": None, "image_check": {"score": 9.1, "p_value": 0.002, "flagged": True},
              "model": "m", "heads": "h", "request_id": "r",
              "timings_ms": {"queue": 1.0, "generate": 2.0, "readout": 3.0, "heads": 0.4}}
    back = AnswerResponse.model_validate(stored)
    assert back.defer_reasons == [DeferCode.image_flagged]
    assert "image_check" not in back.model_dump()
