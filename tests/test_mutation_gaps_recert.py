"""Fast tests of heads/recert.py and of heads/detectors.py's refit-free paths (mutation gaps:
before these, no selected test read the stored records' optional fields, the input key,
`/calibration`'s view, the base detector's flags from served p-values, a closed window's
α-spending and audit record, the rollback/pin/unpin records, or what
`add_clean_sample` and `refit_detectors` hand the collector and the detector stage). Every
expectation is computed by hand; no actor is built (a stand-in collector returns fixed
feature rows).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import heads.detectors as detectors
import heads.recert as recert
from heads.defer import DeferPolicy
from heads.detectors import (
    AUGMENT_PER_FAMILY,
    DETECTOR_ALPHA,
    IMAGE_FEATURE,
    LAYOUT_FEATURE,
    QUESTION_FEATURE,
    fit_detectors,
    layout_vectors,
)
from heads.dualread import Heads
from heads.fit import fit_heads
from heads.novelty import Novelty
from heads.recert import (
    SHIPPED,
    DeferRule,
    RecertError,
    RuleStore,
    Served,
    Settings,
    Verdict,
    _base_flags,
    distinct_inputs,
    input_key,
    spending_view,
    spent_delta,
)
from models.data import load


# ------------------------------------------------------------------ stored records
def test_served_from_dict_reads_every_field_as_stored():
    d = {"version": "r3-abc", "logits": [1, -2, 0], "scores": {"novelty": 2},
         "p_values": {"novelty": 0.25}, "problem": True, "key": "k" * 32}
    got = Served.from_dict(d)
    assert got == Served("r3-abc", (1.0, -2.0, 0.0), {"novelty": 2.0}, {"novelty": 0.25},
                         True, "k" * 32)
    assert type(got.scores["novelty"]) is float and type(got.logits[0]) is float
    assert Served.from_dict(got.to_dict()) == got


def test_an_older_served_record_reads_with_the_defaults():
    # written before scores, p-values, the parse flag or the input key were kept
    got = Served.from_dict({"version": SHIPPED, "logits": [0.5, 0.5, 0.0]})
    assert got == Served(SHIPPED, (0.5, 0.5, 0.0), {}, {}, False, "")
    assert got.problem is False and got.key == ""


def test_verdict_from_dict_keeps_when_and_who_and_defaults_who():
    served = {"version": SHIPPED, "logits": [0.0, 0.0, 0.0]}
    got = Verdict.from_dict({"request_id": "req-1", "served": served, "correct": 1,
                             "at": 12, "who": "operator:x"})
    assert got == Verdict("req-1", Served(SHIPPED, (0.0, 0.0, 0.0)), True, 12.0, "operator:x")
    assert type(got.at) is float and got.correct is True
    older = Verdict.from_dict({"request_id": "req-2", "served": served, "correct": 0,
                               "at": 3.5})
    assert older.who == "" and older.at == 3.5 and older.correct is False


def test_verdict_to_dict_is_what_from_dict_reads():
    v = Verdict("req-1", Served("r1", (0.5, -1.0, 0.0), {"novelty": 1.5}, {"novelty": 0.2},
                                True, "k1"), False, 1_700_000_000.5, "operator:x")
    d = json.loads(json.dumps(v.to_dict()))
    assert d == {"request_id": "req-1", "served": v.served.to_dict(), "correct": False,
                 "at": 1_700_000_000.5, "who": "operator:x"}
    assert Verdict.from_dict(d) == v


def test_distinct_inputs_keeps_the_first_verdict_of_each_key_and_every_keyless_one():
    keys = ["a", "", "b", "a", "", "b", "c"]
    vs = [Verdict(f"req-{i}", Served(SHIPPED, (0.0, 0.0, 0.0), key=k), True, 0.0, "op")
          for i, k in enumerate(keys)]
    assert [v.request_id for v in distinct_inputs(vs)] == \
        ["req-0", "req-1", "req-2", "req-4", "req-6"]
    assert distinct_inputs([]) == []


# ------------------------------------------------------------------ α-spending
def test_spending_view_by_hand():
    # three tests at δ = 0.2: δ (1 − 1/4) = 0.15 spent, the fourth at 0.2 / 20 = 0.01
    got = spending_view(0.2, 3)
    assert list(got) == ["scheme", "delta_total", "tests", "delta_spent", "next_delta"]
    assert (got["delta_total"], got["tests"], got["delta_spent"], got["next_delta"]) == \
        (0.2, 3, 0.15, 0.01)
    assert isinstance(got["scheme"], str) and got["scheme"]
    assert spending_view(0.1, 0)["delta_spent"] == 0 and \
        spending_view(0.1, 0)["next_delta"] == 0.05
    assert spent_delta(0.1, 1) == 0.05 and spent_delta(0.3, 2) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="count from 1"):
        spent_delta(0.1, 0)


# ------------------------------------------------------------------ the input key
def _key(header: bytes, pixels: bytes, question: str) -> str:
    return hashlib.sha256(header + pixels + b"\0" + question.encode()).hexdigest()[:32]


def _picture(mode: str, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(0)
    if mode == "RGB":
        return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0]), dtype=np.uint8)) \
        .convert(mode)


def test_input_key_of_a_small_picture_and_a_folded_question():
    im = _picture("RGB", (5, 3))                  # under 2 x 256 a side: hashed whole
    want = _key(b"RGB:5x3:", im.tobytes(), "what colour is it?")
    got = input_key(im, "  What COLOUR\tis   it? ")
    assert got == want and len(got) == 32
    assert input_key(im, "what colour is it?") == want            # case and spacing folded
    assert input_key(im, "what colour is it") != want
    assert input_key(im.transpose(Image.Transpose.TRANSPOSE), "what colour is it?") != want


def test_input_key_of_a_large_picture_hashes_a_box_reduced_copy():
    im = _picture("RGB", (600, 300))              # 600 // 256 = 2: reduced by 2
    assert input_key(im, "q") == _key(b"RGB:600x300:", im.reduce(2).tobytes(), "q")
    assert input_key(im, "q") != _key(b"RGB:600x300:", im.tobytes(), "q")
    # a mode PIL cannot reduce is hashed whole
    pal = _picture("P", (600, 300))
    assert input_key(pal, "q") == _key(b"P:600x300:", pal.tobytes(), "q")


def test_input_key_without_a_picture_is_the_question_alone():
    assert input_key(None, "Is it RED?") == \
        hashlib.sha256(b"\0is it red?").hexdigest()[:32]


# ------------------------------------------------------------------ the rule's summary
def _policy(tau: float) -> dict:
    return DeferPolicy(tau, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True).to_dict()


def test_rule_summary_counts_the_extended_references_and_leaves_the_lists_out():
    rule = DeferRule("r1-abc", {"psr": 1.5, "per": 0.5}, _policy(0.6),
                     references={"novelty": [0.1, 0.2, 0.3]},
                     drift_reference={"dualread": [0.4] * 7},
                     certificate={"holds": True}, created_at="2023-11-14T22:13:20Z",
                     created_by="operator:a")
    assert rule.summary() == {
        "version": "r1-abc", "temperatures": {"psr": 1.5, "per": 0.5},
        "policy": _policy(0.6), "certificate": {"holds": True},
        "references_extended": {"novelty": 3}, "created_at": "2023-11-14T22:13:20Z",
        "created_by": "operator:a"}


# ------------------------------------------------------------------ /calibration's view
def _store(tmp_path) -> RuleStore:
    base = Heads(dim=2, policy=DeferPolicy(0.8, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True))
    base.temperatures = {"psr": 1.0, "per": 1.0}
    return RuleStore(tmp_path / "state.json", base, "heads-1", Settings(window=300))


def test_the_view_counts_the_open_window_and_shows_the_last_50_events(tmp_path):
    store = _store(tmp_path)
    empty = store.view()
    assert empty["window"] == {"counted": 0, "needed": 300, "correct": 0, "wrong": 0,
                               "opened_at": None}
    assert empty["active"]["version"] == SHIPPED and empty["chain"] == [SHIPPED]
    # a switched, pinned store with an open window of 3 correct and 1 wrong
    rule = DeferRule("r1-abc", {"psr": 2.0, "per": 1.0}, _policy(0.6), created_by="op")
    store.rules["r1-abc"] = rule
    store.chain.append("r1-abc")
    store.pinned = True
    store.tests = 2
    store.window = [Verdict(f"req-{i}", Served("r1-abc", (0.0, 0.0, 0.0)), z,
                            1_700_000_000.0 + 60 * i, "op")
                    for i, z in enumerate([True, False, True, True])]
    store.events = [{"event": "unpin", "n": i} for i in range(60)]
    store.last_attempt = {"event": "refused", "version": "r2-def"}
    got = store.view()
    assert list(got) == ["active", "pinned", "window", "last_attempt", "alpha_spending",
                         "rules", "chain", "history"]
    assert got["active"] == rule.summary() and got["pinned"] is True
    assert got["window"] == {"counted": 4, "needed": 300, "correct": 3, "wrong": 1,
                             "opened_at": "2023-11-14T22:13:20Z"}       # the first verdict
    assert got["last_attempt"] == {"event": "refused", "version": "r2-def"}
    # two tests at δ = 0.1: 0.1 (1 − 1/3) spent, the next at 0.1 / 12
    assert got["alpha_spending"] == store.spending()
    assert (got["alpha_spending"]["delta_spent"], got["alpha_spending"]["next_delta"]) == \
        (0.06666667, 0.00833333)
    assert got["rules"] == [store.rules[SHIPPED].summary(), rule.summary()]
    assert got["chain"] == [SHIPPED, "r1-abc"] and got["chain"] is not store.chain
    assert [e["n"] for e in got["history"]] == list(range(10, 60))
    assert "req-" not in json.dumps(got)                     # no request id in the view


def test_levels_are_the_settings_else_the_shipped_policy_else_the_defaults(tmp_path):
    store = _store(tmp_path)
    store.rules[SHIPPED].policy = _policy(0.6) | {"target_risk": 0.07, "delta": 0.2}
    assert store.levels() == (0.07, 0.2)
    store.settings = Settings(target_risk=0.03)
    assert store.levels() == (0.03, 0.2)
    store.settings = Settings(delta=0.05)
    assert store.levels() == (0.07, 0.05)
    store.settings = Settings()
    store.rules[SHIPPED].policy = None               # defer everything: no r or δ of its own
    assert store.levels() == (0.05, 0.1)
    assert all(type(x) is float for x in store.levels())


# ------------------------------------------------------------------ closing a window
NO_TEST = "no test ran (label balance); its share is spent all the same"
VERSION = re.compile(r"r(\d+)-[0-9a-f]{6}")


def _add(store: RuleStore, tag: str, labels: list[bool], logits=None, who: str = "op:a"):
    out = None
    for i, z in enumerate(labels):
        lg = (0.0, 0.0, 0.0) if logits is None else logits[i]
        out = store.add(f"{tag}-{i}", Served(SHIPPED, lg), z, who)
    return out


def _without_at(event: dict) -> dict:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", event["at"])
    return {k: v for k, v in event.items() if k != "at"}


def _saved(tmp_path) -> dict:
    return json.loads((tmp_path / "state.json").read_text())


def test_each_closed_window_counts_an_attempt_and_spends_its_delta(tmp_path):
    """Two windows refused for label balance (each spends its δ_t all the same): the
    attempt count names the candidate, the t-th test is at δ / (t (t + 1)), and the
    spending and the settings' split reach the certificate, the audit and the file."""
    base = Heads(dim=2, policy=DeferPolicy(0.8, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True))
    base.temperatures = {"psr": 1.0, "per": 1.0}
    store = RuleStore(tmp_path / "state.json", base, "heads-1",
                      Settings(window=2, min_per_class=10, temperature_share=0.5))
    attempts = []
    for k in (1, 2):
        out = _add(store, f"w{k}", [True, False], who=f"op:{k}")
        attempts.append(out)
        d_k = 0.1 / (k * (k + 1))
        assert out["attempt"] == "refused" and out["counted"] is True
        assert VERSION.fullmatch(out["version"])[1] == str(k)
        assert out["certificate"] == {
            "n": 2, "n_correct": 1, "n_wrong": 1, "target_risk": 0.1, "delta": d_k,
            "min_per_class": 10, "temperature_share": 0.5, "duplicates_dropped": 0,
            "bound": "one-sided Clopper-Pearson upper bound of the risk among released",
            "holds": False,
            "reason": "label balance: 1 correct and 1 wrong verdicts; each needs at least 10",
            "alpha_spending": {"test": k, "delta_total": 0.1, "delta_this_test": d_k,
                               "delta_spent": round(0.1 * k / (k + 1), 8),
                               "note": NO_TEST}}
        assert store.window == [] and store.active.version == SHIPPED
        event = _without_at(store.events[-1])
        assert event == {"event": "refused", "who": f"op:{k}",
                         "old": {"version": SHIPPED, "tau": 0.8}, "new": None,
                         "window": event["window"], "certificate": out["certificate"],
                         "candidate": out["version"]}
        assert event["window"] | {"first_at": "", "last_at": ""} == {
            "n": 2, "first_at": "", "last_at": "", "correct": 1, "wrong": 1,
            "decided_by": [SHIPPED]}
    # the second test at 0.1 / 6, 0.1 (1 - 1/3) spent in all (to 8 places)
    assert attempts[1]["certificate"]["alpha_spending"]["delta_spent"] == 0.06666667
    assert (store.attempts, store.tests) == (2, 2)
    assert store.spending()["delta_spent"] == 0.06666667
    state = json.loads((tmp_path / "state.json").read_text())
    assert (state["attempts"], state["tests"]) == (2, 2)
    assert state["last_attempt"]["version"] == attempts[1]["version"]
    assert state["last_attempt"]["certificate"] == attempts[1]["certificate"]
    again = RuleStore(tmp_path / "state.json", base, "heads-1", store.settings)
    assert (again.attempts, again.tests) == (2, 2)


def test_separate_histories_name_their_first_candidates_apart(tmp_path):
    """A candidate's version carries a digest of when it was made: the first window of a
    history started afresh (its state set aside) is not named as the old one's was."""
    base = Heads(dim=2, policy=DeferPolicy(0.8, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True))
    base.temperatures = {"psr": 1.0, "per": 1.0}
    versions = []
    for name in ("a.json", "b.json"):
        store = RuleStore(tmp_path / name, base, "heads-1", Settings(window=2))
        versions.append(_add(store, "w", [True, True])["version"])
    assert all(VERSION.fullmatch(v)[1] == "1" for v in versions)
    assert versions[0] != versions[1]


T0 = 1_700_000_000.0                         # 2023-11-14T22:13:20Z


def _certifying(tmp_path, monkeypatch, pinned: bool = False):
    """A store one verdict short of a window that certifies (100 right answers with high
    log-odds, 20 wrong with low; too few in the temperature part to refit, so no fit
    runs), its verdicts a minute apart and decided by two rules; then the last verdict."""
    base = Heads(dim=2, policy=DeferPolicy(0.8, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True))
    base.temperatures = {"psr": 1.0, "per": 1.0}
    switched: list = []
    store = RuleStore(tmp_path / "state.json", base, "heads-1",
                      Settings(window=120, min_per_class=10, temperature_share=0.1),
                      on_switch=switched.append)
    if pinned:
        store.pin(None, "operator:p")
    rng = np.random.default_rng(0)
    labels = [i % 6 != 0 for i in range(120)]                   # 100 right, 20 wrong
    logits = [(float(x), float(x), 0.0) for x in
              rng.normal(3.0, 1.0, 120) * np.where(labels, 1, -1)]
    # filled by hand but for its last verdict (a save per verdict is slow)
    store.window = [Verdict(f"w-{i}", Served("r0-old" if i % 2 else SHIPPED, logits[i]),
                            labels[i], T0 + 60 * i, "op") for i in range(119)]
    # the last verdict is counted at T0 + 119 minutes
    monkeypatch.setattr(recert, "time", SimpleNamespace(
        time=lambda: T0 + 60 * 119, strftime=time.strftime, gmtime=time.gmtime))
    out = store.add("w-119", Served(SHIPPED, logits[119]), labels[119], "operator:z")
    monkeypatch.undo()
    return store, switched, out


WINDOW = {"n": 120, "first_at": "2023-11-14T22:13:20Z", "last_at": "2023-11-15T00:12:20Z",
          "correct": 100, "wrong": 20, "decided_by": ["r0-old", SHIPPED]}


def test_a_switched_rule_is_audited_whole_and_created_by_who_closed_the_window(
        tmp_path, monkeypatch):
    """A window that certifies: the new rule names who closed it (in `/calibration`'s
    rules) and carries the first test's spending, without the no-test note; the audit
    record and the last attempt name the window by its first and last verdicts."""
    store, switched, out = _certifying(tmp_path, monkeypatch)
    assert out["attempt"] == "switch", out
    rule, cert = store.active, out["certificate"]
    assert out == {"counted": True, "window": 120, "attempt": "switch",
                   "version": rule.version, "certificate": cert}
    assert switched == [rule] and store.chain == [SHIPPED, rule.version]
    assert VERSION.fullmatch(rule.version)[1] == "1"
    assert rule.created_by == "operator:z"
    assert store.view()["active"]["created_by"] == "operator:z"
    assert rule.certificate == cert and cert["holds"] is True
    assert cert["alpha_spending"] == {
        "test": 1, "delta_total": 0.1, "delta_this_test": 0.05, "delta_spent": 0.05}
    assert cert["temperature_share"] == 0.1 and cert["temperatures_kept"]
    assert _without_at(store.events[-1]) == {
        "event": "switch", "who": "operator:z", "old": {"version": SHIPPED, "tau": 0.8},
        "new": {"version": rule.version, "tau": rule.tau}, "window": WINDOW,
        "certificate": cert, "candidate": rule.version}
    assert _without_at(store.last_attempt) == {"event": "switch", "version": rule.version,
                                               "window": WINDOW, "certificate": cert}
    saved = _saved(tmp_path)
    assert saved["chain"] == [SHIPPED, rule.version] and saved["pinned"] is False
    assert saved["rules"][rule.version] == json.loads(json.dumps(rule.to_dict()))
    assert store.window == [] and store.counted == set() and store.keys == set()


def test_a_certified_window_of_a_pinned_store_is_held_not_switched(tmp_path, monkeypatch):
    store, switched, out = _certifying(tmp_path, monkeypatch, pinned=True)
    assert out["attempt"] == "held_pinned", out
    cert = out["certificate"]
    assert cert["holds"] is True and cert["note"] == "a rule is pinned: not switched"
    assert switched == [] and store.chain == [SHIPPED] and store.pinned
    assert set(store.rules) == {SHIPPED}                   # the candidate is not kept
    assert _without_at(store.events[-1]) == {
        "event": "held_pinned", "who": "operator:z", "old": {"version": SHIPPED, "tau": 0.8},
        "new": None, "window": WINDOW, "certificate": cert, "candidate": out["version"]}
    assert _without_at(store.last_attempt) == {"event": "held_pinned",
                                               "version": out["version"],
                                               "window": WINDOW, "certificate": cert}
    assert _saved(tmp_path)["last_attempt"] == store.last_attempt


# ------------------------------------------------------------------ operator requests
def _kept(tmp_path, switched: list) -> tuple[RuleStore, DeferRule, DeferRule]:
    """A store whose chain is shipped (τ 0.8) then r1-abc (τ 0.6), r1-abc active."""
    base = Heads(dim=2, policy=DeferPolicy(0.8, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True))
    base.temperatures = {"psr": 1.0, "per": 1.0}
    store = RuleStore(tmp_path / "state.json", base, "heads-1", Settings(window=300),
                      on_switch=switched.append)
    rule = DeferRule("r1-abc", {"psr": 2.0, "per": 1.0}, _policy(0.6), created_by="op")
    store.rules["r1-abc"] = rule
    store.chain.append("r1-abc")
    return store, store.rules[SHIPPED], rule


def test_rollback_pin_and_unpin_are_audited_and_persisted_whole(tmp_path, caplog):
    switched: list = []
    store, shipped, rule = _kept(tmp_path, switched)
    SH, R1 = {"version": SHIPPED, "tau": 0.8}, {"version": "r1-abc", "tau": 0.6}
    caplog.set_level("INFO", logger="dualread.audit")

    assert store.rollback("operator:b") is shipped
    assert switched == [shipped] and store.pinned is True
    assert _without_at(store.events[-1]) == {"event": "rollback", "who": "operator:b",
                                             "old": R1, "new": SH}
    assert _saved(tmp_path)["chain"] == [SHIPPED] and _saved(tmp_path)["pinned"] is True

    assert store.pin("r1-abc", "operator:c") is rule
    assert switched == [shipped, rule] and store.chain == [SHIPPED, "r1-abc"]
    assert _without_at(store.events[-1]) == {"event": "pin", "who": "operator:c",
                                             "old": SH, "new": R1}
    # pinning the rule already active switches nothing
    assert store.pin(None, "operator:d") is rule
    assert switched == [shipped, rule]
    assert _without_at(store.events[-1]) == {"event": "pin", "who": "operator:d",
                                             "old": R1, "new": R1}

    store.unpin("operator:e")
    assert store.pinned is False and store.view()["pinned"] is False
    assert _without_at(store.events[-1]) == {"event": "unpin", "who": "operator:e",
                                             "old": R1, "new": R1}
    saved = _saved(tmp_path)
    assert saved["pinned"] is False and saved["chain"] == [SHIPPED, "r1-abc"]
    assert saved["events"] == store.events and len(store.events) == 4
    # the log carries each record as it is kept
    logged = [json.loads(r.getMessage()) for r in caplog.records
              if r.name == "dualread.audit"]
    assert logged == [{"audit": "defer_rule", **e} for e in store.events]


def test_pinning_an_unknown_rule_names_the_known_ones(tmp_path):
    store, _, _ = _kept(tmp_path, [])
    with pytest.raises(RecertError) as e:
        store.pin("r9-zzz", "operator:b")
    assert str(e.value) == "no such rule; known: shipped, r1-abc"
    assert store.events == [] and store.chain == [SHIPPED, "r1-abc"]


# ------------------------------------------------------------------ the base detector's flags
def _verdicts(scores: list[dict], p_values: list[dict]) -> list[Verdict]:
    return [Verdict(f"req-{i}", Served(SHIPPED, (0.0, 0.0, 0.0), s, p), True, 0.0, "op")
            for i, (s, p) in enumerate(zip(scores, p_values))]


class _Reread:
    """A detector that rereads stored scores: here a score is its own p-value."""

    def __init__(self) -> None:
        self.asked: list[list[float]] = []

    def p_values_of(self, s: np.ndarray) -> np.ndarray:
        self.asked.append(np.asarray(s, float).tolist())
        return np.asarray(s, float)


def test_base_flags_reread_the_stored_scores_strictly_below_alpha():
    det = _Reread()
    vs = _verdicts([{"novelty": 0.05}, {"novelty": 0.3}, {}, {"novelty": 0.1},
                    {"other": 0.01}],
                   [{"novelty": 0.9}, {"novelty": 0.01}, {"novelty": 0.01}, {}, {}])
    got = _base_flags(det, 0.1, vs, "novelty")
    # the served p-values are not read (they may be an extended rule's); a missing score is
    # not flagged, nor a p-value equal to α
    assert got.tolist() == [True, False, False, False, False]
    assert det.asked == [[0.05, 0.3, 0.1]]                  # only the scores there


def test_base_flags_of_a_detector_that_cannot_reread_use_the_served_p_values():
    vs = _verdicts([{"novelty": 9.0}] * 5,
                   [{"novelty": 0.05}, {"novelty": 0.1}, {}, {"other": 0.01},
                    {"novelty": 0.0999}])
    got = _base_flags(object(), 0.1, vs, "novelty")
    assert isinstance(got, np.ndarray) and got.tolist() == [True, False, False, False, True]


# ------------------------------------------------------------------ add_clean_sample
class _Collector:
    """Stands in for `heads.collect.Collector`: records how it was built and what it read,
    and returns fixed feature rows."""

    built: list[tuple] = []
    read: list[tuple] = []
    feats: dict = {}
    meta: object = None

    def __init__(self, actor, cache_dir, max_new_tokens=None, kappa=None) -> None:
        _Collector.built.append((actor, cache_dir, max_new_tokens, kappa))

    def run(self, items, label: str = ""):
        _Collector.read.append((items,))
        return _Collector.feats, _Collector.meta


@pytest.fixture
def collector(monkeypatch):
    monkeypatch.setattr(_Collector, "built", [])
    monkeypatch.setattr(_Collector, "read", [])
    monkeypatch.setattr(_Collector, "feats", {})
    monkeypatch.setattr(_Collector, "meta", object())
    monkeypatch.setattr(detectors, "Collector", _Collector)
    return _Collector


SPLITS = {"reader": torch.arange(24), "temperature": torch.arange(24, 36),
          "defer": torch.arange(36, 48)}


def _splits_of(collector, seen: list):
    def splits_of(meta):
        seen.append(meta)
        return SPLITS if meta is collector.meta else {}
    return splits_of


def _images(items, rows) -> list:
    return [items[i].image() for i in torch.as_tensor(rows).tolist()]


def _fitted():
    """16 images, 3 questions each; random readouts; a composite with a layout part (it
    reads the items' images) calibrated on every row of the temperature and defer splits."""
    items = load("render:plain:16")
    rng = np.random.default_rng(4)
    feats = {"img_tokens": torch.from_numpy(rng.normal(size=(48, 3, 4))),
             "h_pre": torch.from_numpy(rng.normal(size=(48, 5)))}
    reader, cal = SPLITS["reader"], torch.arange(24, 48)
    rows = {k: v[cal] for k, v in feats.items()}
    det = fit_detectors({k: v[reader] for k, v in feats.items()}, None, rows, rows,
                        layout=(layout_vectors(_images(items, reader)),
                                layout_vectors(_images(items, cal))))
    rows[LAYOUT_FEATURE] = layout_vectors(_images(items, cal))
    return items, feats, det, rows


def _default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


def test_add_clean_sample_reads_the_fit_readouts_of_the_items_and_their_splits(
        collector, monkeypatch):
    items, feats, det, rows = _fitted()
    assert det.image_features == (LAYOUT_FEATURE,) and det.clean is None
    collector.feats = feats
    seen: list = []
    monkeypatch.setattr(detectors, "splits_of", _splits_of(collector, seen))
    heads = SimpleNamespace(novelty=det, kappa=0.37)
    assert detectors.add_clean_sample("actor", heads, items, "cache-dir") == 24
    # the fit's readouts: the same actor, cache, κ and fit-heads' generation length
    assert collector.built == [("actor", "cache-dir", _default(fit_heads, "max_new_tokens"),
                                0.37)]
    assert len(collector.read) == 1 and collector.read[0][0] is items
    assert seen == [collector.meta]
    # the sample: every temperature and defer row, with its image's layout read again
    assert np.array_equal(det.clean, np.sort(det.clean_sample(rows)))
    detectors.add_clean_sample(None, heads, items, max_new_tokens=32)
    assert collector.built[-1] == (None, None, 32, 0.37)


def test_add_clean_sample_refuses_a_single_detector_and_other_readouts(collector,
                                                                       monkeypatch):
    single = Novelty("knn", QUESTION_FEATURE, k=1)
    with pytest.raises(ValueError, match="no composite novelty detector"):
        detectors.add_clean_sample(None, SimpleNamespace(novelty=single, kappa=1.0), [])
    assert collector.built == []                             # refused before any readout
    items, feats, det, _ = _fitted()
    collector.feats = {k: v + 0.3 for k, v in feats.items()}     # not as at calibration
    monkeypatch.setattr(detectors, "splits_of", _splits_of(collector, []))
    with pytest.raises(ValueError, match="refit with `dualread fit-detectors`"):
        detectors.add_clean_sample(None, SimpleNamespace(novelty=det, kappa=1.0), items)
    assert det.clean is None


# ------------------------------------------------------------------ refit_detectors
def test_refit_detectors_hands_the_fit_readouts_to_the_detector_stage(collector,
                                                                       monkeypatch):
    """Its bookkeeping only: the stage itself is tested with the same stand-in collector
    (tests/test_mutation_gaps_detectors.py)."""
    collector.feats = {IMAGE_FEATURE: "the fit's rows"}
    seen: list = []
    monkeypatch.setattr(detectors, "splits_of", _splits_of(collector, seen))
    staged: list = []
    new_det, log = object(), {"parts": {}}

    def stage(col, items, feats, splits, per_family=AUGMENT_PER_FAMILY, seed=0,
              alpha=DETECTOR_ALPHA, pixels=True, layout=True):
        staged.append((col, items, feats, splits, per_family, seed, alpha, pixels, layout))
        return new_det, log

    monkeypatch.setattr(detectors, "detector_stage", stage)
    items = ["item"]
    heads = SimpleNamespace(novelty="the old detector", novelty_alpha=0.5, kappa=0.37)
    assert detectors.refit_detectors("actor", heads, items, "cache-dir", per_family=3,
                                     seed=5, max_new_tokens=32) is log
    assert collector.built == [("actor", "cache-dir", 32, 0.37)]
    assert collector.read == [(items,)] and seen == [collector.meta]
    [(col, *rest)] = staged
    assert isinstance(col, _Collector)                     # the collector that read the fit
    assert rest == [items, collector.feats, SPLITS, 3, 5, DETECTOR_ALPHA, True, True]
    assert heads.novelty is new_det and heads.novelty_alpha == DETECTOR_ALPHA
    # by default, the detector fit-heads fits: its seed, re-encodings and generation length
    detectors.refit_detectors(None, heads, items)
    assert collector.built[-1] == (None, None, _default(fit_heads, "max_new_tokens"), 0.37)
    assert staged[-1][4:6] == (_default(fit_heads, "novelty_per_family"),
                               _default(fit_heads, "seed"))
