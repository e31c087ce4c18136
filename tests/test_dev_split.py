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
