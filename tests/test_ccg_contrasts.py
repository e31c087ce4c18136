"""CCG beyond docs/method.md §2's table: paired contrasts between interfaces, CCG per answer type,
and open questions on their own (where strict CCG can differ from natural)."""

from __future__ import annotations

import numpy as np
import pytest

from clients.probes import ccg as ccg_probe
from clients.probes.runner import Config
from models.data import Item

CFG = Config(data="test", bootstrap=200)


def rec(image: str, kind: str, real: dict, hn: dict, a_real="red", a_hn="red",
        z_hn=False) -> dict:
    return {"eligible": True, "image_id": image, "donor": "d", "donor_image": "D" + image,
            "answer_type": kind, "real": {"z": True, "a": a_real, "c": real},
            "hn": {"z": z_hn, "a": a_hn, "c": hn}}


def _records() -> list[dict]:
    """`good` drops on every donor, `blind` never moves. 20 yes/no pairs (no strict pair:
    the answers differ) and 20 open colour pairs, half of them strict."""
    out = []
    for i in range(20):
        out.append(rec(f"y{i}", "yes/no", {"good": 0.9, "blind": 0.5},
                       {"good": 0.2, "blind": 0.5}, "yes", "no"))
        strict = i % 2 == 0
        out.append(rec(f"c{i}", "color", {"good": 0.9, "blind": 0.5},
                       {"good": 0.2 if strict else 0.95, "blind": 0.5},
                       "red", "red" if strict else "blue"))
    return out


def test_paired_contrast_between_interfaces():
    s = ccg_probe.summarise(_records(), CFG)
    c = s["contrasts"]["good − blind"]
    # good: φ = 1 on 30 pairs, 0 on 10; blind: ½ everywhere → difference .75 − .5
    assert c["natural"]["difference"] == pytest.approx(30 / 40 - 0.5)
    assert c["natural"]["n"] == 40
    lo, hi = c["natural"]["ci"]
    assert 0 < lo <= c["natural"]["difference"] <= hi
    assert c["strict"]["difference"] == pytest.approx(0.5) and c["strict"]["n"] == 10
    assert list(s["contrasts"]) == ["good − blind"]          # one pair of two interfaces


def test_ccg_by_answer_type_and_open_questions_on_their_own():
    s = ccg_probe.summarise(_records(), CFG)
    by = s["by_answer_type"]
    assert set(by) == {"open", "yes/no", "color"}
    assert (by["open"]["n_decisive"], by["open"]["n_strict"]) == (20, 10)
    assert by["yes/no"]["n_strict"] == 0
    assert by["yes/no"]["good"]["natural"] == 1.0
    assert by["open"]["good"]["natural"] == pytest.approx(0.5)        # 10 drops, 10 rises
    assert by["open"]["good"]["strict"] == 1.0                       # strict ≠ natural here
    assert np.isnan(by["yes/no"]["good"]["strict"])
    md = ccg_probe.markdown(s)
    assert "| open |" in md and "| good − blind |" in md


def test_kind_reads_the_items_label_or_falls_back_to_yes_no_or_open():
    it = Item(id="a", image_path="x", question="q", answer="Yes", image_id="i")
    assert ccg_probe.kind(it) == "yes/no"
    assert ccg_probe.kind(Item(id="a", image_path="x", question="q", answer="left lung",
                               image_id="i")) == "open"
    assert ccg_probe.kind(Item(id="a", image_path="x", question="q", answer="red",
                               image_id="i", answer_type="color")) == "color"
