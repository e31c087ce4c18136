"""`evaluate`'s defer accounting on hand-built heads (mutation gaps of heads/evaluate.py):
one reason per part of the rule the heads have, the deferred set as their union, and the
suite row read with it."""

from __future__ import annotations

import numpy as np
import pytest

from heads.defer import DeferPolicy
from heads.dualread import Heads
from heads.evaluate import defer_accounting
from heads.suites import suite_row

C = np.array([0.95, 0.9, 0.85, 0.5, 0.2, 0.99])
Z = np.array([1, 0, 1, 1, 0, 0])


def _heads(novelty: bool = False) -> Heads:
    h = Heads(dim=2, policy=DeferPolicy(tau=0.8, target_risk=0.25, delta=0.1, coverage=0.5,
                                        empirical_risk=0.0, risk_upper_bound=0.05,
                                        n_calibration=100, feasible=True))
    if novelty:
        h.novelty, h.novelty_alpha = object(), 0.05
    return h


def test_only_tau_without_detectors_or_responses():
    got = defer_accounting(_heads(), Z, C, None, None)
    d = got["defer"]
    assert set(d["deferred_share"]) == {"tau"}
    assert "novelty_flag_rate" not in d
    assert d["tau"] == 0.8 and d["target_risk"] == 0.25
    kept = C >= 0.8                                    # 4 kept, 2 of them wrong
    assert d["n_kept"] == 4 and d["coverage"] == pytest.approx(4 / 6)
    assert d["risk"] == pytest.approx(0.5) and d["risk_within_target"] is False
    assert got["suite"] == suite_row(Z, C, ~kept, ~kept)


def test_every_part_defers_and_the_suite_row_sees_the_union():
    nov = [0.5, 0.01, 0.5, 0.5, 0.5, 0.01]            # flags the 0.9 and the 0.99 (wrong)
    problems = ["no answer tag", None, None, None, None, None]   # the 0.95 (right)
    got = defer_accounting(_heads(True), Z, C, nov, problems)
    d = got["defer"]
    assert set(d["deferred_share"]) == {"tau", "novelty", "problem"}
    assert d["novelty_flag_rate"] == pytest.approx(2 / 6)
    assert d["n_kept"] == 1 and d["risk"] == 0.0 and d["risk_within_target"] is True
    deferred = np.array([True, True, False, True, True, True])
    tau_only = C < 0.8
    assert got["suite"] == suite_row(Z, C, deferred, tau_only)
    assert got["suite"]["released"] == pytest.approx(1 / 6)
    assert got["suite"]["released_tau_only"] == pytest.approx(4 / 6)


def test_a_part_the_heads_lack_is_left_out_even_with_its_values():
    got = defer_accounting(_heads(), Z, C, [0.01] * 6, [None] * 6)
    d = got["defer"]
    assert set(d["deferred_share"]) == {"tau", "problem"}
    assert d["n_kept"] == 4
    got = defer_accounting(_heads(novelty=True), Z, C, [0.5] * 6, None)
    assert set(got["defer"]["deferred_share"]) == {"tau", "novelty"}
    assert got["defer"]["n_kept"] == 4


# ------------------------------------------------------------------ the rest of the module
class _Tok:
    """One token per word, plus one for a special token when asked to add them."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split()) + int(add_special_tokens)))


def test_response_problems_encode_without_special_tokens_and_need_a_tag_only_by_card(
        tmp_path):
    from heads.evaluate import response_problems

    actor = type("A", (), {"folder": str(tmp_path), "tokenizer": _Tok()})()
    # no card: no answer tag needed; 7 words < 8 is not truncated (a special token would
    # make it 8)
    got = response_problems(actor, ["I think red", "a b c d e f g"], max_new_tokens=8)
    assert got == [None, None]
    assert response_problems(actor, ["a b c d e f g h"], max_new_tokens=8) == [
        "truncated (no end of response within max_new_tokens)"]
    (tmp_path / "actor_card.json").write_text('{"response_format": "<answer>x</answer>"}')
    assert response_problems(actor, ["I think red"], 8) == ["no answer tag"]
    no_tok = type("B", (), {"folder": str(tmp_path)})()
    assert response_problems(no_tok, ["I think red"], 8) is None


def test_response_problems_keep_a_finished_responses_trailing_tag_piece_as_text(tmp_path):
    from heads.evaluate import response_problems

    actor = type("A", (), {"folder": str(tmp_path), "tokenizer": _Tok()})()
    # a plain response that ended on its own keeps "<c" as its answer text (usable); only a
    # cut-off one loses a trailing piece of a tag, and is truncated either way
    assert response_problems(actor, ["<c"], max_new_tokens=8) == [None]
    assert response_problems(actor, ["a b c d e f g <c"], max_new_tokens=8) == [
        "truncated (no end of response within max_new_tokens)"]


def test_methods_left_out_when_the_tokenizer_cannot_read_p_true():
    from heads import evaluate as ev

    class Many:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [0] * (10 * len(text))

    reads = type("M", (), {"name": "ptrue", "passes": ("follow_up",)})()
    other = type("M", (), {"name": "dualread", "passes": ("readout",)})()
    actor = type("A", (), {"tokenizer": Many()})()
    why = ev._unreadable_follow_up(actor, [reads, other])
    assert list(why) == ["ptrue"] and "P(True) template" in why["ptrue"]
    assert ev._unreadable_follow_up(type("A", (), {"tokenizer": _Tok()})(), [reads]) == {}
    assert ev._unreadable_follow_up(type("A", (), {})(), [reads]) == {}


def test_methods_follow_the_registry_and_other_names_fail():
    from heads import evaluate as ev
    from heads import registry

    assert ev.METHODS == registry.names()
    with pytest.raises(AttributeError, match="NOPE"):
        ev.NOPE  # noqa: B018


def test_score_all_scores_the_chosen_methods_in_order(monkeypatch):
    from heads import evaluate as ev
    from heads import registry

    class M:
        def __init__(self, name: str, v: float) -> None:
            self.name, self.v = name, v

        def score(self, heads, feats):
            return np.full(2, self.v * heads["w"]) + feats["x"]

    ms = {"a": M("a", 1.0), "b": M("b", 2.0)}
    monkeypatch.setattr(registry, "get", lambda n: ms[n])
    monkeypatch.setattr(registry, "names", lambda: ("b", "a"))
    got = ev.score_all({"w": 2.0}, {"x": np.array([0.0, 0.5])}, ("a",))
    assert list(got) == ["a"] and got["a"].tolist() == [2.0, 2.5]       # the heads given
    assert list(ev.score_all({"w": 1.0}, {"x": np.zeros(2)})) == ["b", "a"]


def test_a_cell_shows_its_interval_unless_it_is_undefined():
    from heads.evaluate import _fmt

    assert _fmt({"auroc": 0.81234, "auroc_ci": (0.7, 0.9)}, "auroc") == \
        "0.812 [0.700, 0.900]"
    assert _fmt({"auroc": 0.81234, "auroc_ci": (float("nan"), float("nan"))}, "auroc") == \
        "0.812"
    assert _fmt({"auroc": 0.5}, "auroc") == "0.500"


def test_the_actor_folder_is_shown_relative_to_the_working_directory(tmp_path, monkeypatch):
    from heads.evaluate import _display

    (tmp_path / "actors" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert _display(str(tmp_path / "actors" / "tiny")) == "actors/tiny"
    assert _display("actors/tiny") == "actors/tiny"
    assert _display(str(tmp_path.parent / "elsewhere" / "model")) == "model"
