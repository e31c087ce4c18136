"""The development split (docs/method.md, "Development split"): `easyvqa:dev` is image-
disjoint from the heads' fitting pool, from the actor's images and from test, and
carving it out leaves `easyvqa:heldout` (what the shipped heads were fitted on) as it was."""

from __future__ import annotations

import pytest

from models.data import HEADS_SLICE_MOD, easyvqa_part, image_number, load


@pytest.fixture(scope="module")
def parts() -> dict[str, list]:
    return {s: load(f"easyvqa:{s}") for s in ("train", "test", "actor", "heldout", "dev", "fit")}


def _images(items: list) -> set[str]:
    return {it.image_id for it in items}


def test_dev_is_disjoint_from_fitting_actor_and_test_images(parts):
    dev = _images(parts["dev"])
    assert dev and not dev & _images(parts["fit"]) and not dev & _images(parts["actor"])
    assert not {it.image_path for it in parts["dev"]} & {it.image_path for it in parts["test"]}
    # about one heldout image in five, every one of its questions with it
    assert 0.15 < len(dev) / len(_images(parts["heldout"])) < 0.25
    assert all(easyvqa_part(image_number(it)) == "dev" for it in parts["dev"])


def test_heldout_is_unchanged_and_is_fit_plus_dev(parts):
    """Same items in the same order as before the split existed (n % 5 == 0 of train), so
    `sample(load("easyvqa:heldout"), N)` still draws what the shipped heads were fitted on."""
    old = [it.id for it in parts["train"] if image_number(it) % HEADS_SLICE_MOD == 0]
    assert [it.id for it in parts["heldout"]] == old
    assert sorted(it.id for it in parts["fit"] + parts["dev"]) == sorted(old)


def test_unknown_part_is_refused():
    with pytest.raises(ValueError, match="dev or fit"):
        load("easyvqa:validation")


def test_flip_sweep_takes_the_development_split(monkeypatch, tmp_path):
    """`python -m studies.flip_sweep --data easyvqa:dev` sweeps on dev (the protocol), and its
    default still reproduces the committed sweep's items."""
    import studies.flip_sweep as fs

    seen = []
    monkeypatch.setattr(fs, "run", lambda out, cache, limit, n, command, data="?":
                        seen.append((data, command)) or {"chosen": {}})
    fs.main(["--out", str(tmp_path), "--data", "easyvqa:dev"])
    fs.main(["--out", str(tmp_path)])
    assert seen[0][0] == "easyvqa:dev" and "--data easyvqa:dev" in seen[0][1]
    assert seen[1][0] == "easyvqa:heldout"


def _q_row(q: float, auroc: float, ece: float, drop: float) -> dict:
    return {"q": q, "auroc": auroc, "ece": ece, "answer_drop": drop}


def test_q_rule_takes_a_larger_q_only_for_a_clear_gain_that_keeps_calibration():
    """The declared rule of `studies.consistency_quantile` (docs/method.md §9)."""
    from studies.consistency_quantile import choose

    ref = _q_row(0.01, 0.80, 0.020, 0.10)
    # each step up gains ≥ .01 and stays within the slacks: the largest q
    assert choose([ref, _q_row(0.05, 0.797, 0.024, 0.12), _q_row(0.10, 0.80, 0.02, 0.13)]) == 0.10
    # 10% gains only .005 over 5%: ties stay with the smaller q
    assert choose([ref, _q_row(0.05, 0.80, 0.02, 0.12), _q_row(0.10, 0.80, 0.02, 0.125)]) == 0.05
    # natural calibration decides before the answer axis: ECE .006 worse, AUROC .006 worse
    assert choose([ref, _q_row(0.05, 0.80, 0.026, 0.5), _q_row(0.10, 0.794, 0.02, 0.5)]) == 0.01
    # slacks are measured from the reference, not from the current pick
    assert choose([ref, _q_row(0.05, 0.80, 0.024, 0.2), _q_row(0.10, 0.80, 0.026, 0.3)]) == 0.05
    # rows in any order
    assert choose([_q_row(0.10, 0.80, 0.02, 0.3), ref, _q_row(0.05, 0.80, 0.02, 0.2)]) == 0.10
