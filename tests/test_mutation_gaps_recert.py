"""Fast tests of heads/recert.py and of heads/detectors.py's refit-free paths (mutation gaps:
before these, no selected test read the stored records' optional fields, the input key,
`/calibration`'s view, the base detector's flags from served p-values, a closed window's
α-spending and audit record, the rollback/pin/unpin records, a state file set aside or
read back with its defaults, the temporary file of a write, the detectors' digest, every
field of a certificate, or what `add_clean_sample` and `refit_detectors` hand the
collector and the detector stage). Every expectation is computed by hand (a certificate
from heads.calibration and heads.defer, step by step); no actor is built (a stand-in
collector returns fixed feature rows).
"""

from __future__ import annotations

import calendar
import hashlib
import inspect
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import heads.detectors as detectors
import heads.recert as recert
from heads.calibration import fit_temperature, fuse
from heads.defer import (
    DeferPolicy,
    choose_threshold,
    choose_threshold_sequence,
    sequence_grid,
)
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
from heads.novelty import CompositeNovelty, Novelty
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
    assert empty["window"] == {"counted": 0, "needed": 300, "max": 300, "since_test": 0,
                               "correct": 0, "wrong": 0, "opened_at": None}
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
    store.since_test = 3
    store.events = [{"event": "unpin", "n": i} for i in range(60)]
    store.last_attempt = {"event": "refused", "version": "r2-def"}
    got = store.view()
    assert list(got) == ["active", "pinned", "window", "last_attempt", "alpha_spending",
                         "rules", "chain", "history"]
    assert got["active"] == rule.summary() and got["pinned"] is True
    assert got["window"] == {"counted": 4, "needed": 300, "max": 300, "since_test": 3,
                             "correct": 3, "wrong": 1,
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
    store.since_test = 119
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


# ------------------------------------------------------------------ reading a state file back
def _state_with_a_kept_rule(tmp_path) -> dict:
    """The state file of `_store` (no detector) with r1-abc (τ 0.6) active above shipped."""
    store = _store(tmp_path)
    store.rules["r1-abc"] = DeferRule("r1-abc", {"psr": 2.0, "per": 1.0}, _policy(0.6))
    store.chain.append("r1-abc")
    store._save()
    return _saved(tmp_path)


def _other_heads_id(s: dict) -> None:
    s["heads_id"] = "heads-2"


def _other_detectors(s: dict) -> None:
    s["detectors"] = "0" * 64


def _other_shipped_policy(s: dict) -> None:
    s["rules"][SHIPPED]["policy"]["tau"] = 0.7


def _other_shipped_temperatures(s: dict) -> None:
    s["rules"][SHIPPED]["temperatures"]["psr"] = 1.5


def _a_reference_of_an_absent_detector(s: dict) -> None:
    s["rules"]["r1-abc"]["references"] = {"novelty": [0.5]}


def _no_shipped_rule(s: dict) -> None:
    del s["rules"][SHIPPED]


def _no_rules(s: dict) -> None:
    del s["rules"]


@pytest.mark.parametrize("change", [
    _other_heads_id, _other_detectors, _other_shipped_policy, _other_shipped_temperatures,
    _a_reference_of_an_absent_detector, _no_shipped_rule, _no_rules])
def test_a_state_file_that_differs_in_one_respect_is_set_aside_and_logged(
        tmp_path, monkeypatch, caplog, change):
    """Each check alone sets the file aside (under its time of day) and says so in the log;
    the file otherwise the same is read back."""
    state = _state_with_a_kept_rule(tmp_path)
    assert _store(tmp_path).active.version == "r1-abc"          # unchanged: kept
    change(state)
    (tmp_path / "state.json").write_text(json.dumps(state))
    monkeypatch.setattr(recert, "time", SimpleNamespace(
        time=lambda: T0 + 0.7, strftime=time.strftime, gmtime=time.gmtime))
    caplog.set_level("WARNING", logger="dualread.audit")
    store = _store(tmp_path)
    monkeypatch.undo()
    assert store.active.version == SHIPPED and store.chain == [SHIPPED]
    assert set(store.rules) == {SHIPPED}
    assert not (tmp_path / "state.json").exists()
    assert json.loads((tmp_path / "state.json.stale-1700000000").read_text()) == state
    [record] = [r for r in caplog.records if r.name == "dualread.audit"]
    assert json.loads(record.getMessage()) == {
        "event": "recert_state_set_aside", "to": "state.json.stale-1700000000",
        "why": "written for other heads"}


def test_a_kept_rule_without_references_is_read_back(tmp_path):
    state = _state_with_a_kept_rule(tmp_path)
    del state["rules"]["r1-abc"]["references"]                 # written before they were kept
    (tmp_path / "state.json").write_text(json.dumps(state))
    store = _store(tmp_path)
    assert store.active.version == "r1-abc" and store.active.references == {}


def test_an_older_state_file_reads_with_the_defaults(tmp_path):
    """Written before windows, events, pins, α-spending or the last attempt were kept: none
    of them, and a history of attempts with no test count spent δ on each."""
    state = _state_with_a_kept_rule(tmp_path)
    for key in ("pinned", "window", "events", "attempts", "tests", "last_attempt",
                "alpha_spending"):
        del state[key]
    (tmp_path / "state.json").write_text(json.dumps(state))
    store = _store(tmp_path)
    assert store.active.version == "r1-abc" and store.chain == [SHIPPED, "r1-abc"]
    assert store.pinned is False and store.window == [] and store.events == []
    assert (store.attempts, store.tests, store.last_attempt) == (0, 0, None)
    assert store.counted == set() and store.keys == set()
    state["attempts"] = 3
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert (_store(tmp_path).attempts, _store(tmp_path).tests) == (3, 3)


def test_a_state_file_is_read_back_whole(tmp_path):
    store = _store(tmp_path)
    keyed = [Served(SHIPPED, (0.0, 0.0, 0.0), key="k-a"), Served(SHIPPED, (0.0, 0.0, 0.0)),
             Served(SHIPPED, (1.0, 0.0, 0.0), key="k-b")]
    for i, s in enumerate(keyed):
        store.add(f"req-{i}", s, i != 1, "op:a")
    store.pinned, store.attempts, store.tests = True, 4, 5
    store.last_attempt = {"event": "refused", "version": "r4-abc"}
    store._event("unpin", "op:b", old=store.active)
    store._save()
    back = _store(tmp_path)
    assert back.window == store.window and back.events == store.events
    assert back.counted == {"req-0", "req-1", "req-2"} and back.keys == {"k-a", "k-b"}
    assert (back.pinned, back.attempts, back.tests) == (True, 4, 5)
    assert back.last_attempt == {"event": "refused", "version": "r4-abc"}
    # the inputs read back are still counted once, under any request id
    assert back.add("req-9", keyed[2], True, "op:a") == \
        {"counted": False, "reason": "duplicate_input"}
    assert back.add("req-1", keyed[1], True, "op:a") == \
        {"counted": False, "reason": "already_counted"}


# ------------------------------------------------------------------ counting a verdict
def test_a_verdict_is_counted_as_given_and_the_file_says_so(tmp_path, monkeypatch):
    store = _store(tmp_path)
    fresh = store.view()
    assert fresh["last_attempt"] is None and fresh["pinned"] is False
    assert (store.attempts, store.tests) == (0, 0)
    served = Served(SHIPPED, (0.5, -0.5, 0.0), key="k-1")
    monkeypatch.setattr(recert, "time", SimpleNamespace(
        time=lambda: T0, strftime=time.strftime, gmtime=time.gmtime))
    assert store.add("req-1", served, 1, "operator:a") == {"counted": True, "window": 1}
    monkeypatch.undo()
    [v] = store.window
    assert v == Verdict("req-1", served, True, T0, "operator:a") and v.correct is True
    assert _saved(tmp_path)["window"] == [v.to_dict()]
    assert _saved(tmp_path)["alpha_spending"] == store.spending()
    # the same input under another request id, and a keyless one under two ids
    assert store.add("req-2", served, False, "operator:a") == \
        {"counted": False, "reason": "duplicate_input"}
    blank = Served(SHIPPED, (0.5, -0.5, 0.0))
    assert store.add("req-3", blank, False, "operator:b")["counted"]
    assert store.add("req-4", blank, False, "operator:b") == {"counted": True, "window": 3}
    assert store.keys == {"k-1"} and store.counted == {"req-1", "req-3", "req-4"}


# ------------------------------------------------------------------ writing the state file
def test_atomic_write_goes_through_a_temporary_file_beside_the_target(tmp_path, monkeypatch):
    target = tmp_path / "new" / "dir" / "state.json"          # folders made as needed
    moved = []
    replace = recert.os.replace

    def recording_replace(src, dst):
        moved.append((Path(src), Path(dst)))
        replace(src, dst)

    monkeypatch.setattr(recert.os, "replace", recording_replace)
    recert.atomic_write(target, '{"a": 1}')
    monkeypatch.undo()
    [(tmp, dst)] = moved
    assert dst == target and tmp.parent == target.parent
    assert tmp.name.startswith("state.json.") and tmp.name.endswith(".tmp")
    assert target.read_text() == '{"a": 1}' and sorted(target.parent.iterdir()) == [target]
    recert.atomic_write(target, "second")                    # over an existing file
    assert target.read_text() == "second"


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "state.json"
    recert.atomic_write(target, "old")
    with pytest.raises(TypeError):
        recert.atomic_write(target, None)                     # fails inside the write
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]


# ------------------------------------------------------------------ the detectors' digest
def _cal_bytes(det: Novelty) -> bytes:
    return det.t["calibration"].numpy().astype("<f8").tobytes()


def test_detectors_digest_by_hand():
    none = Heads(dim=2)
    assert none.novelty is None
    assert recert.detectors_digest(none) == hashlib.sha256(b"novelty-").hexdigest()
    rng = np.random.default_rng(0)
    one = Novelty("knn", "pixels").fit(torch.from_numpy(rng.normal(size=(30, 2)))) \
        .calibrate(torch.from_numpy(rng.normal(size=(20, 2))))
    heads = Heads(dim=2)
    heads.novelty = one
    assert recert.detectors_digest(heads) == hashlib.sha256(
        b"novelty" + b":knn:pixels" + _cal_bytes(one)).hexdigest()
    # an uncalibrated one; a composite, by part name
    bare = Novelty("knn", "h_pre").fit(torch.from_numpy(rng.normal(size=(30, 2))))
    heads.novelty = bare
    assert recert.detectors_digest(heads) == hashlib.sha256(
        b"novelty" + b":knn:h_pre" + b"-").hexdigest()
    heads.novelty = CompositeNovelty({"question": bare, "image": one})
    assert recert.detectors_digest(heads) == hashlib.sha256(
        b"novelty" + b"image:knn:pixels" + _cal_bytes(one) + b"question:knn:h_pre"
        + b"-").hexdigest()


def test_heads_that_defer_everything_set_aside_a_state_file_without_the_shipped_rule(
        tmp_path):
    """With no policy (τ: defer everything) the shipped rule's policy reads None either way:
    its temperatures still have to match."""
    base = Heads(dim=2, policy=None)
    base.temperatures = {"psr": 1.0, "per": 1.0}
    store = RuleStore(tmp_path / "state.json", base, "heads-1", Settings(window=300))
    store._save()
    state = _saved(tmp_path)
    assert state["rules"][SHIPPED]["policy"] is None
    del state["rules"][SHIPPED]
    (tmp_path / "state.json").write_text(json.dumps(state))
    again = RuleStore(tmp_path / "state.json", base, "heads-1", Settings(window=300))
    assert again.active.version == SHIPPED and again.active.policy is None
    assert list(tmp_path.glob("state.json.stale-*"))


# ------------------------------------------------------------------ the certificate, by hand
def _split(request_id: str, share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h / 2 ** 64 < share


def _by_hand(vs: list[Verdict], base: Heads, *, r: float, d: float, share: float,
             search: str = "sequence", step: float = 0.01, given: int | None = None
             ) -> tuple[dict, dict, dict, dict, dict]:
    """The certificate of docs/method.md §8 step by step, from heads.calibration and
    heads.defer alone: (certificate, temperatures unrounded, the policy, references, drift
    reference)."""
    n = len(vs)
    z = np.array([v.correct for v in vs], int)
    x = np.array([v.served.logits for v in vs], float)
    temp = np.array([_split(v.request_id, share) for v in vs])
    idx = np.flatnonzero(~temp)
    cert = {"n": n, "n_correct": int(z.sum()), "n_wrong": int(n - z.sum()), "target_risk": r,
            "delta": d, "min_per_class": 10, "temperature_share": share,
            "duplicates_dropped": (given or n) - n,
            "bound": "one-sided Clopper-Pearson upper bound of the risk among released",
            "holds": False, "reason": None, "n_temperature": int(temp.sum()),
            "n_tau": len(idx)}
    if temp.sum() < 20 or len(set(z[temp])) < 2:
        temps = dict(base.temperatures)
        cert["temperatures_kept"] = (f"temperature part has {int(temp.sum())} verdicts, "
                                     f"{int(z[temp].sum())} correct: needs 20 with both "
                                     "labels to refit")
    else:
        zt = torch.as_tensor(z[temp], dtype=torch.float64)
        temps = {"psr": fit_temperature(torch.as_tensor(x[temp, 0]), zt),
                 "per": fit_temperature(torch.as_tensor(x[temp, 1]), zt)}
    xt = torch.as_tensor(x)
    p = fuse(torch.sigmoid(xt[:, 0] / temps["psr"]),
             torch.sigmoid(xt[:, 1] / temps["per"] + xt[:, 2])).numpy()
    flagged = np.array([v.served.problem for v in vs])
    refs, notes, drift = {}, {}, {"dualread": p.tolist()}
    if base.novelty is not None:
        det, alpha = base.novelty, base.novelty_alpha
        s = np.array([v.served.scores.get("novelty", np.nan) for v in vs])
        if np.isfinite(s).any():
            drift["novelty"] = s[np.isfinite(s)].tolist()
        if hasattr(det, "extend_reference") and np.isfinite(s).all():
            refs["novelty"] = s.tolist()
            loo = np.array([(1 + (np.delete(s, i) >= s[i]).sum()) / n for i in idx])
            flagged[idx] |= np.maximum(det.p_values_of(s[idx]), loo) < alpha
            notes["novelty"] = f"extended by {n} window scores"
        else:
            # judged against the base's reference: rereading the scores where it can
            if hasattr(det, "p_values_of"):
                pv = np.array([det.p_values_of(np.array([s[i]]))[0] if np.isfinite(s[i])
                               else np.nan for i in idx])
            else:
                pv = np.array([vs[i].served.p_values.get("novelty", np.nan) for i in idx])
            flagged[idx] |= pv < alpha
            notes["novelty"] = "skipped: the detector cannot extend its reference" \
                if not hasattr(det, "extend_reference") else \
                "skipped: some verdicts carry no score of this detector"
    cert["detector_references"] = notes or "no detector"
    cand = idx[~flagged[idx]]
    cert["n_tau_other_terms_defer"] = len(idx) - len(cand)
    if search == "sequence" and temp.sum() >= 50:
        grid = sequence_grid(p[temp], len(cand), r, d, step)
        policy = choose_threshold_sequence(p[cand], z[cand], grid, r, d)
        cert["threshold_search"] = (
            f"fixed-sequence testing over {len(grid)} thresholds read off the temperature "
            f"part (released shares {step:g} apart), highest first, each at level delta "
            "(heads.defer.choose_threshold_sequence)")
    else:
        policy = choose_threshold(p[cand], z[cand], r, d)
        cert["threshold_search"] = (
            "binary search, each test at delta / ceil(log2 m) (heads.defer.choose_threshold)"
            + ("" if search == "binary" else f": the temperature part has {int(temp.sum())} "
               "verdicts, fewer than 50 to read thresholds off"))
    kept = cand[p[cand] >= policy.tau]
    cert.update(temperatures={k: round(v, 6) for k, v in temps.items()}, tau=policy.tau,
                feasible=policy.feasible,
                released_share=round(len(kept) / max(1, len(idx)), 6),
                risk_among_released=round(float(1 - z[kept].mean()), 6) if len(kept) else None,
                risk_upper_bound=round(policy.risk_upper_bound, 6))
    if policy.feasible:
        cert["holds"] = True
    else:
        cert["reason"] = (f"no threshold keeps the {1 - d:.0%} Clopper-Pearson bound of the "
                          f"risk among released at or below {r} on the {len(cand)} τ-part "
                          "verdicts the other terms release")
    return cert, temps, policy.to_dict(), refs, drift


def _window(n: int, seed: int, *, offset: float = 2.0, problems: int = 0,
            scores=None) -> list[Verdict]:
    """Verdicts whose branch log-odds tell right from wrong answers (roughly), with a
    consistency term on some and the parse flag on the first `problems`."""
    rng = np.random.default_rng(seed)
    ease = rng.normal(size=n)
    right = rng.uniform(size=n) < 1 / (1 + np.exp(-(2.5 * ease + offset)))
    pre = 2.5 * ease + 0.7 * rng.normal(size=n) + 1.5
    post = 2.5 * ease + 0.7 * rng.normal(size=n) + 1.5
    term = np.where(rng.uniform(size=n) < 0.3, -0.8, 0.0)
    out = []
    for i in range(n):
        sc = {} if scores is None or np.isnan(scores[i]) else {"novelty": float(scores[i])}
        pv = {"novelty": 0.5} if sc else {}
        out.append(Verdict(f"c{seed}-{i}", Served(SHIPPED, (float(pre[i]), float(post[i]),
                                                             float(term[i])),
                                                  sc, pv, i < problems, f"k{seed}-{i}"),
                           bool(right[i]), 0.0, "op"))
    return out


def _plain_base() -> Heads:
    base = Heads(dim=2, policy=DeferPolicy(0.8, 0.1, 0.1, 0.7, 0.05, 0.08, 500, True))
    base.temperatures = {"psr": 1.3, "per": 0.8}
    return base


def test_a_certified_window_by_hand_with_fitted_temperatures_and_the_sequence_search():
    """400 verdicts (a repeat of one input among them, some unparsed answers), no detector:
    every field of the certificate and the rule as the protocol computes them."""
    base = _plain_base()
    vs = _window(400, 1, problems=12)
    repeat = Verdict("again", vs[5].served, not vs[5].correct, 0.0, "op")
    rule, cert = recert.certify(vs[:200] + [repeat] + vs[200:], base, "r7-abc",
                                target_risk=0.1, delta=0.1, min_per_class=10,
                                temperature_share=0.3, who="operator:x", step=0.02)
    want, temps, policy, refs, drift = _by_hand(vs, base, r=0.1, d=0.1, share=0.3,
                                                step=0.02, given=401)
    assert want["n_temperature"] >= 50 and "temperatures_kept" not in want
    assert want["holds"] and want["n_tau_other_terms_defer"] > 0
    assert cert == want
    assert list(cert) == list(want)
    assert rule == DeferRule("r7-abc", temps, policy, refs, drift, want, rule.created_at,
                             "operator:x")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rule.created_at)
    assert rule.temperatures != {"psr": 1.3, "per": 0.8}
    # by default the rule names no one
    assert recert.certify(vs, base, "r8", target_risk=0.1, delta=0.1,
                          min_per_class=10)[0].created_by == ""


def test_a_small_window_by_hand_keeps_the_temperatures_and_searches_by_bisection():
    base = _plain_base()
    vs = _window(160, 2, offset=3.0)
    for search in ("sequence", "binary"):
        rule, cert = recert.certify(vs, base, "r2", target_risk=0.15, delta=0.2,
                                    min_per_class=10, temperature_share=0.1, search=search)
        want, temps, policy, _, drift = _by_hand(vs, base, r=0.15, d=0.2, share=0.1,
                                                 search=search)
        assert want["n_temperature"] < 20 and want["holds"]
        assert cert == want and temps == {"psr": 1.3, "per": 0.8}
        assert rule.temperatures == temps and rule.policy == policy
        assert rule.drift_reference == drift and rule.references == {}


def test_a_refused_window_by_hand_says_which_bound_failed():
    base = _plain_base()
    vs = _window(300, 3, offset=-0.3)
    rule, cert = recert.certify(vs, base, "r3", target_risk=0.05, delta=0.2,
                                min_per_class=10)
    want = _by_hand(vs, base, r=0.05, d=0.2, share=0.3)[0]
    assert rule is None and cert == want and not want["holds"]
    assert cert["reason"].startswith("no threshold keeps the 80% Clopper-Pearson bound")
    assert cert["risk_among_released"] is None and cert["released_share"] == 0


def _knn(seed: int = 0) -> Novelty:
    rng = np.random.default_rng(seed)
    return Novelty("knn", "pixels").fit(torch.from_numpy(rng.normal(size=(200, 2)))) \
        .calibrate(torch.from_numpy(rng.normal(size=(199, 2))))


def test_a_window_by_hand_that_extends_the_detector():
    """Every verdict has a score: the detector's reference grows by the window, and the
    τ part is judged by the larger of its p-values against the base and against the rest
    of the window."""
    base = _plain_base()
    base.novelty = _knn()
    rng = np.random.default_rng(4)
    far = base.novelty.score(torch.from_numpy(rng.normal(size=(300, 2)) + 3.0))
    vs = _window(300, 4, scores=far, problems=8)
    rule, cert = recert.certify(vs, base, "r4", target_risk=0.1, delta=0.1,
                                min_per_class=10)
    want, temps, policy, refs, drift = _by_hand(vs, base, r=0.1, d=0.1, share=0.3)
    assert want["detector_references"] == {"novelty": "extended by 300 window scores"}
    assert cert == want and want["holds"]
    assert rule.references == refs == {"novelty": far.tolist()}
    assert rule.drift_reference == drift and set(drift) == {"dualread", "novelty"}


def test_windows_by_hand_that_skip_the_detector():
    base = _plain_base()
    base.novelty = _knn()
    rng = np.random.default_rng(5)
    s = base.novelty.score(torch.from_numpy(rng.normal(size=(300, 2))))
    s[7] = np.nan                                             # one verdict without a score
    vs = _window(300, 5, scores=s, problems=6)
    rule, cert = recert.certify(vs, base, "r5", target_risk=0.1, delta=0.1,
                                min_per_class=10)
    want, _, _, refs, drift = _by_hand(vs, base, r=0.1, d=0.1, share=0.3)
    assert want["detector_references"] == {
        "novelty": "skipped: some verdicts carry no score of this detector"}
    assert cert == want and refs == {} and rule.references == {}
    assert rule.drift_reference["novelty"] == drift["novelty"] and len(drift["novelty"]) == 299

    class Fixed:
        """A detector that cannot extend its reference (nor reread a score)."""

    base.novelty = Fixed()
    vs = _window(300, 6, scores=np.ones(300))
    _, cert = recert.certify(vs, base, "r6", target_risk=0.1, delta=0.1, min_per_class=10)
    assert cert["detector_references"] == {
        "novelty": "skipped: the detector cannot extend its reference"}
    assert cert == _by_hand(vs, base, r=0.1, d=0.1, share=0.3)[0]


def test_certify_refuses_an_unknown_search_or_step_and_says_which():
    vs = _window(40, 7)
    base = _plain_base()
    with pytest.raises(ValueError) as e:
        recert.certify(vs, base, "r", target_risk=0.1, delta=0.1, min_per_class=1,
                       search="sequential")
    assert str(e.value) == "search is 'sequence' or 'binary'"
    for step in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError) as e:
            recert.certify(vs, base, "r", target_risk=0.1, delta=0.1, min_per_class=1,
                           step=step)
        assert str(e.value) == "step is a released share in (0, 1]"
    # a step of 1: one threshold, released share 1
    _, cert = recert.certify(_window(100, 7), base, "r", target_risk=0.5, delta=0.1,
                             min_per_class=1, step=1.0, temperature_share=0.9)
    assert "released shares 1 apart" in cert["threshold_search"]


def test_the_shipped_rule_reads_the_heads_temperatures_and_names_the_artefact():
    base = _plain_base()
    rule = recert.shipped_rule(base)
    assert rule == DeferRule(SHIPPED, {"psr": 1.3, "per": 0.8}, base.policy.to_dict(),
                             created_by="heads artefact")
    base.policy = None
    assert recert.shipped_rule(base).policy is None


def test_the_part_sizes_are_inclusive_bounds():
    """A temperature part of exactly 20 verdicts refits the temperatures, one of exactly 50
    reads the sequence's thresholds off, and a τ part of one verdict can release it (at
    r = 1, where one verdict is enough)."""
    base = _plain_base()
    vs = _window(120, 8, offset=0.5)
    frac = np.sort([int.from_bytes(hashlib.sha256(v.request_id.encode()).digest()[:8], "big")
                    / 2 ** 64 for v in vs])
    _, cert = recert.certify(vs, base, "r", target_risk=0.3, delta=0.2, min_per_class=10,
                             temperature_share=(frac[19] + frac[20]) / 2)
    assert cert["n_temperature"] == 20 and "temperatures_kept" not in cert
    assert cert == _by_hand(vs, base, r=0.3, d=0.2, share=(frac[19] + frac[20]) / 2)[0]
    _, cert = recert.certify(vs, base, "r", target_risk=0.3, delta=0.2, min_per_class=10,
                             temperature_share=(frac[49] + frac[50]) / 2)
    assert cert["n_temperature"] == 50
    assert cert["threshold_search"].startswith("fixed-sequence testing")
    _, cert = recert.certify(vs, base, "r", target_risk=1.0, delta=0.2, min_per_class=10,
                             temperature_share=(frac[-2] + frac[-1]) / 2, search="binary")
    assert cert["n_tau"] == 1 and cert["holds"] and cert["released_share"] == 1.0


def test_the_temperature_part_is_below_the_share_strictly():
    """An id whose hash fraction is the share itself falls in the τ part: the split is
    fraction < share, so the temperature part's chance is the share exactly."""
    f = int.from_bytes(hashlib.sha256(b"req-7").digest()[:8], "big") / 2 ** 64
    assert not recert.in_temperature_part("req-7", f)
    assert recert.in_temperature_part("req-7", float(np.nextafter(f, 1.0)))


def test_the_sequence_search_spends_the_given_risk_and_delta():
    """r ≠ δ, and δ not `choose_threshold_sequence`'s default (0.1): passing δ as the risk
    target, or dropping δ, changes the threshold (both passed with r = δ = 0.1)."""
    base = _plain_base()
    vs = _window(400, 1, problems=12)
    for r, d in ((0.12, 0.05), (0.1, 0.2)):
        rule, cert = recert.certify(vs, base, "r9", target_risk=r, delta=d, min_per_class=10,
                                    step=0.02)
        want, _, policy, _, _ = _by_hand(vs, base, r=r, d=d, share=0.3, step=0.02)
        assert want["threshold_search"].startswith("fixed-sequence") and want["holds"]
        assert cert == want and rule.policy == policy
        assert (rule.policy["target_risk"], rule.policy["delta"]) == (r, d)


def _relabelled(vs: list[Verdict], wrong: int) -> list[Verdict]:
    """`vs` with exactly the first `wrong` verdicts wrong."""
    return [Verdict(v.request_id, v.served, i >= wrong, v.at, v.who) for i, v in enumerate(vs)]


def test_the_label_balance_bound_is_inclusive_and_an_empty_window_is_refused():
    base = _plain_base()
    vs = _window(200, 7)
    # exactly min_per_class wrong verdicts is enough; one fewer is not
    cert = recert.certify(_relabelled(vs, 10), base, "r", target_risk=0.1, delta=0.1,
                          min_per_class=10)[1]
    assert cert["n_wrong"] == 10 and not str(cert["reason"]).startswith("label balance")
    cert = recert.certify(_relabelled(vs, 9), base, "r", target_risk=0.1, delta=0.1,
                          min_per_class=10)[1]
    assert cert["reason"] == ("label balance: 191 correct and 9 wrong verdicts; each needs "
                              "at least 10")
    # no verdict at all is refused whatever the per-class minimum (even 0)
    rule, cert = recert.certify([], base, "r", target_risk=0.1, delta=0.1, min_per_class=0)
    assert rule is None and cert["reason"] == ("label balance: 0 correct and 0 wrong "
                                               "verdicts; each needs at least 0")


def test_an_extended_detector_keeps_the_shipped_references_p_value():
    """The τ part is judged by the larger of its p-values against the shipped reference and
    against the rest of the window: a score typical of the reference but the window's
    largest is released. Judged by the window alone it would be flagged."""
    base = _plain_base()
    base.novelty = _knn()
    rng = np.random.default_rng(8)
    s = base.novelty.score(torch.from_numpy(rng.normal(size=(300, 2)))) * 1e-3
    vs0 = _window(300, 8)
    tau_part = [i for i, v in enumerate(vs0) if not _split(v.request_id, 0.3)]
    typical = float(np.median(base.novelty.score(torch.from_numpy(rng.normal(size=(99, 2))))))
    s[tau_part[:2]] = typical
    vs = _window(300, 8, scores=s)
    rule, cert = recert.certify(vs, base, "r10", target_risk=0.1, delta=0.1, min_per_class=10)
    want = _by_hand(vs, base, r=0.1, d=0.1, share=0.3)[0]
    assert cert == want
    idx = np.flatnonzero([not _split(v.request_id, 0.3) for v in vs])
    shipped = base.novelty.p_values_of(s[idx])
    window = recert._loo_p_values(s, idx)
    two = np.isin(idx, tau_part[:2])
    # the two: flagged by the window alone, released by the shipped reference
    assert (window[two] < base.novelty_alpha).all() and (shipped[two] >= 0.3).all()
    assert cert["n_tau_other_terms_defer"] == 0


def test_a_rule_without_a_policy_and_a_detector_that_cannot_extend_apply_as_they_are():
    """`apply` of a rule with no τ (heads shipped without a policy) serves no policy, and a
    reference kept for a detector that can no longer extend it leaves that detector as the
    base has it (a kept rule's names are checked on load, not each detector's kind)."""

    class Fixed:
        """A detector that cannot extend its reference."""

    base = Heads(dim=2, policy=None)
    base.temperatures = {"psr": 1.0, "per": 1.0}
    base.novelty = Fixed()
    heads = DeferRule("r1", {"psr": 2.0}, None, references={"novelty": [0.1, 0.2]}).apply(base)
    assert heads.policy is None and heads.novelty is base.novelty
    assert heads.temperatures == {"psr": 2.0, "per": 1.0} and heads.rule_version == "r1"


def test_a_state_file_without_rules_beside_heads_without_a_policy_is_set_aside(tmp_path):
    """With no shipped policy the policy check passes on a file without rules: the
    temperatures' check must read the missing rules as none, not fail."""
    base = Heads(dim=2, policy=None)
    base.temperatures = {"psr": 1.0, "per": 1.0}
    (tmp_path / "state.json").write_text(json.dumps(
        {"heads_id": "heads-1", "detectors": recert.detectors_digest(base), "chain": []}))
    store = RuleStore(tmp_path / "state.json", base, "heads-1", Settings(window=300))
    assert store.active.version == SHIPPED and store.active.policy is None
    assert not (tmp_path / "state.json").exists()
    assert list(tmp_path.glob("state.json.stale-*"))


# ------------------------------------------------------------------ the re-run's survivors
def test_the_spending_scheme_and_the_attempt_refusal_word_for_word():
    """`/calibration` and the state file show the scheme as written; the refusal names the
    count's start."""
    scheme = ("delta_t = delta / (t (t + 1)), t = 1, 2, ... (tests and resets); sum <= delta; "
              "a carried test runs at delta_t / carried_union")
    assert spending_view(0.1, 0)["scheme"] == scheme
    with pytest.raises(ValueError) as refused:
        spent_delta(0.1, 0)
    assert str(refused.value) == "attempts count from 1"


def test_a_state_file_names_its_heads_and_other_heads_set_it_aside(tmp_path):
    """The file records the heads it was written for, so a store of other heads (same
    detectors, policy and temperatures) starts from the shipped rule: no hand-edited id."""
    store = _store(tmp_path)
    store.rules["r1-abc"] = DeferRule("r1-abc", {"psr": 2.0, "per": 1.0}, _policy(0.6))
    store.chain.append("r1-abc")
    store._save()
    assert _saved(tmp_path)["heads_id"] == "heads-1"
    other = RuleStore(tmp_path / "state.json", store.base, "heads-2", Settings(window=300))
    assert other.active.version == SHIPPED and set(other.rules) == {SHIPPED}
    assert list(tmp_path.glob("state.json.stale-*"))


def test_audit_times_are_utc_on_a_server_in_another_time_zone(monkeypatch):
    """The records' times end in Z: read off the UTC clock, not local time (UTC+14 here)."""
    monkeypatch.setenv("TZ", "Etc/GMT-14")
    time.tzset()
    try:
        stamp = recert._now()
        now = time.time()
    finally:
        monkeypatch.undo()
        time.tzset()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)
    at = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    assert abs(at - now) < 60
