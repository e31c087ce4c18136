"""Windows carried across certificate tests (heads.recert `Settings.max_window`): a test
every `window` new verdicts reads the last `max_window` of them, so evidence a refused test
saw is not thrown away; the operator's reset starts afresh."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import heads.recert as recert
from heads.recert import SHIPPED, RuleStore, Settings, spent_delta
from tests.test_recert import _base, stream


def _store(path, base, window: int, max_window: int | None, **kw) -> RuleStore:
    return RuleStore(path / "state.json", base, "heads-1",
                     Settings(window=window, max_window=max_window, min_per_class=10), **kw)


@pytest.fixture
def tests_run(monkeypatch) -> list[tuple[list[str], float]]:
    """Each certificate test's verdict ids and level, the real test run all the same."""
    seen: list[tuple[list[str], float]] = []
    real = recert.certify

    def spy(verdicts, base, version, **kw):
        seen.append(([v.request_id for v in verdicts], kw["delta"]))
        return real(verdicts, base, version, **kw)

    monkeypatch.setattr(recert, "certify", spy)
    return seen


def _fed(store: RuleStore, rows) -> RuleStore:
    """`store` after an operator's verdicts on `rows`."""
    for rid, s, z in rows:
        store.add(rid, s, z, "op")
    return store


def _refused_stream(base, n: int):
    """A stream the detector flags and the actor answers half the time: never certified;
    each answer on its own input (`Served.key`)."""
    rows = stream(np.random.default_rng(3), n, base, shift=6.0, accuracy_offset=0.0)
    return [(rid, replace(s, key=f"input-{rid}"), z) for rid, s, z in rows]


def test_each_test_reads_the_last_max_window_verdicts(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 400)
    store = _store(state_dir, base, window=100, max_window=250)
    outcomes = [store.add(rid, s, z, "op") for rid, s, z in rows]
    ids = [r[0] for r in rows]
    # tests at the 100th, 200th, 300th and 400th verdict, each on the last ≤ 250
    assert [got for got, _ in tests_run] == [ids[:100], ids[:200], ids[50:300], ids[150:400]]
    # each test's δ_t shared among the ⌈250 / 100⌉ starts its verdicts could have
    assert [d for _, d in tests_run] == [spent_delta(0.1, t) / 3 for t in (1, 2, 3, 4)]
    assert [o.get("attempt") for o in outcomes if "attempt" in o] == ["refused"] * 4
    assert [e["window"]["n"] for e in store.events] == [100, 200, 250, 250]
    # what waits for the next test: the last 150, none of them since that test
    assert [v.request_id for v in store.window] == ids[250:400] and store.since_test == 0
    assert store.counted == set(ids[250:400])
    assert store.keys == {s.key for _, s, _ in rows[250:400]}
    view = store.view()["window"]
    assert (view["counted"], view["needed"], view["max"], view["since_test"]) == \
        (150, 100, 250, 0)


def test_without_max_window_each_test_reads_its_own_verdicts_only(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 300)
    store = _fed(_store(state_dir, base, window=100, max_window=None), rows)
    ids = [r[0] for r in rows]
    assert [got for got, _ in tests_run] == [ids[:100], ids[100:200], ids[200:300]]
    assert store.window == [] and store.counted == set()
    # a max_window under the window reads as the window
    assert _store(state_dir, base, window=100, max_window=40).max_window == 100


def test_a_carried_window_certifies_where_separate_windows_do_not(state_dir):
    """The same 300 verdicts: three separate windows of 100 never certify; carried, the
    third test reads all 300 and does (at its own, smaller level δ/12)."""
    base = _base()
    rows = stream(np.random.default_rng(0), 300, base, shift=6.0, accuracy_offset=5.0)
    (state_dir / "apart").mkdir()
    apart = _store(state_dir / "apart", base, window=100, max_window=None)
    carried = _store(state_dir, base, window=100, max_window=300)
    tried = [(apart.add(rid, s, z, "op").get("attempt"), carried.add(rid, s, z, "op")
              .get("attempt")) for rid, s, z in rows]
    attempts = [t for t in tried if t != (None, None)]
    assert attempts == [("refused", "refused")] * 2 + [("refused", "switch")]
    assert apart.active.version == SHIPPED and carried.active.version != SHIPPED
    cert = carried.active.certificate
    assert cert["alpha_spending"]["test"] == 3 and cert["delta"] == spent_delta(0.1, 3) / 3
    assert cert["alpha_spending"]["carried_union"] == 3


def test_the_carried_window_and_its_count_survive_a_restart(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 230)
    _fed(_store(state_dir, base, window=100, max_window=300), rows[:130])
    again = _store(state_dir, base, window=100, max_window=300)     # a restart
    assert len(again.window) == 130 and again.since_test == 30
    for rid, s, z in rows[130:230]:
        again.add(rid, s, z, "op")
    ids = [r[0] for r in rows]
    # the restart's test came after 100 new verdicts (70 of them after the restart)
    assert [got for got, _ in tests_run] == [ids[:100], ids[:200]]
    assert again.since_test == 30 and len(again.window) == 230


def test_a_reset_drops_the_window_spends_delta_and_is_audited(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 260)
    store = _fed(_store(state_dir, base, window=100, max_window=300), rows[:130])
    assert store.keys == {s.key for _, s, _ in rows[:130]}
    assert store.reset_window("operator") == {"dropped": 130, "active": SHIPPED}
    assert store.window == [] and store.since_test == 0 and store.counted == set()
    assert store.keys == set()
    [event] = [e for e in store.events if e["event"] == "window_reset"]
    assert event["who"] == "operator" and event["dropped"] == 130
    assert event["old"]["version"] == SHIPPED and event["new"]["version"] == SHIPPED
    # the reset is the history's second test slot (one test at 100 before it)
    assert event["alpha_spending"]["test"] == 2 and (store.tests, store.resets) == (2, 1)
    again = _store(state_dir, base, window=100, max_window=300)     # persisted
    assert again.window == [] and again.since_test == 0
    assert (again.tests, again.resets, again.carried_union) == (2, 1, 3)
    assert again.spending()["next_delta"] == round(spent_delta(0.1, 3) / 3, 8)
    _fed(again, rows[130:260])
    ids = [r[0] for r in rows]
    # the test before the reset read 100; the one after it reads only what followed it
    # (the reset took slot 2); each at its δ_t shared by the three starts it could have
    assert [got for got, _ in tests_run] == [ids[:100], ids[130:230]]
    assert [d for _, d in tests_run] == [spent_delta(0.1, 1) / 3, spent_delta(0.1, 3) / 3]
    assert again.events[-1]["certificate"]["alpha_spending"]["carried_union"] == 3
    # an input still in the window is refused; one the reset dropped counts again
    assert again.add("again-1", rows[200][1], True, "op") == \
        {"counted": False, "reason": "duplicate_input"}
    assert again.add("again-2", rows[0][1], True, "op")["counted"]


def test_each_test_shares_its_delta_among_its_starts_from_the_first(state_dir, tests_run):
    """Whether and when a reset comes may be decided on the labels seen so far: "no reset
    yet" is one of a test's starts, so the division holds from the first test; separate
    windows have one start and keep δ_t whole."""
    base = _base()
    store = _fed(_store(state_dir, base, window=100, max_window=300), _refused_stream(base, 200))
    assert store.resets == 0 and store.carried_union == 3
    assert store.spending()["carried_union"] == 3
    assert [d for _, d in tests_run] == [spent_delta(0.1, 1) / 3, spent_delta(0.1, 2) / 3]
    (state_dir / "apart").mkdir()
    _fed(_store(state_dir / "apart", base, window=100, max_window=None),
         _refused_stream(base, 100))
    assert tests_run[-1][1] == spent_delta(0.1, 1)


def test_a_reset_serves_the_shipped_rule_again_unless_one_is_pinned(state_dir):
    base = _base()
    switched: list = []
    rows = stream(np.random.default_rng(8), 300, base, shift=6.0)
    store = _fed(_store(state_dir, base, window=300, max_window=300,
                        on_switch=switched.append), rows)
    certified = store.active
    assert certified.version != SHIPPED and switched == [certified]
    # an empty window with the shipped rule already served, or a pinned one: nothing to do
    store.pin(None, "operator")
    assert store.reset_window("operator") == {"dropped": 0, "active": certified.version}
    assert store.active is certified and store.tests == 1
    store.unpin("operator")
    got = store.reset_window("operator")
    assert got == {"dropped": 0, "active": SHIPPED} and switched[-1].version == SHIPPED
    # no verdict dropped: no share of δ spent
    assert (store.tests, store.resets) == (1, 0) and store.chain == [SHIPPED]
    assert certified.version in store.rules                      # kept, to pin again
    assert store.events[-1]["new"]["version"] == SHIPPED
    assert store.reset_window("operator") == {"dropped": 0, "active": SHIPPED}


def test_changed_window_settings_drop_the_window_at_a_restart(state_dir):
    """A lower max_window kept after the labels are known would choose which verdicts the
    next test reads (and a lower window when it runs): verdicts counted under other window
    settings are dropped at load, and that is audited."""
    base = _base()
    rows = _refused_stream(base, 160)
    for window, max_window in ((100, 120), (50, 300)):
        path = state_dir / f"{window}-{max_window}"
        path.mkdir()
        _fed(_store(path, base, window=100, max_window=300), rows[:130])
        same = _store(path, base, window=100, max_window=300)       # a plain restart
        assert len(same.window) == 130 and same.since_test == 30
        lowered = _store(path, base, window=window, max_window=max_window)
        assert lowered.window == [] and lowered.since_test == 0 and lowered.counted == set()
        [event] = [e for e in lowered.events if e["event"] == "window_reset"]
        assert event["who"] == "service" and event["dropped"] == 130
        assert (lowered.tests, lowered.resets) == (2, 1)         # one test, then the drop
        assert "window settings changed" in event["reason"]
        # on disk: a second restart under the new settings finds nothing more to drop
        again = _store(path, base, window=window, max_window=max_window)
        assert again.window == [] and again.events == lowered.events
        # the verdicts after the drop are the next test's only ones
        for rid, s, z in rows[130:160]:
            again.add(rid, s, z, "op")
        assert again.since_test == 30
        assert [v.request_id for v in again.window] == [r[0] for r in rows[130:160]]


def test_a_reset_of_an_empty_window_records_nothing(state_dir):
    store = _store(state_dir, _base(), window=100, max_window=300)
    assert store.reset_window("operator") == {"dropped": 0, "active": SHIPPED}
    assert store.events == [] and not (state_dir / "state.json").exists()


def test_a_reset_that_cannot_be_saved_is_not_done(state_dir, monkeypatch, caplog):
    base = _base()
    rows = _refused_stream(base, 30)
    store = _fed(_store(state_dir, base, window=100, max_window=300), rows)
    events = list(store.events)

    def full_disk() -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(store, "_save", full_disk)
    with caplog.at_level("INFO", logger="dualread.audit"), pytest.raises(OSError):
        store.reset_window("operator")
    assert [v.request_id for v in store.window] == [r[0] for r in rows]
    assert store.since_test == 30 and store.counted == {r[0] for r in rows}
    assert store.keys == {s.key for _, s, _ in rows}
    assert (store.tests, store.resets) == (0, 0)
    assert store.events == events and "window_reset" not in caplog.text
    monkeypatch.undo()
    with caplog.at_level("INFO", logger="dualread.audit"):
        assert store.reset_window("operator") == {"dropped": 30, "active": SHIPPED}
    assert "window_reset" in caplog.text


def test_a_state_file_from_before_window_settings_drops_its_window(state_dir):
    """Under which window settings an older file's verdicts were counted is unknown: a
    changed `recert_window` would let the next test end where the labels looked good."""
    base = _base()
    _fed(_store(state_dir, base, window=100, max_window=300), _refused_stream(base, 60))
    state = json.loads((state_dir / "state.json").read_text())
    del state["window_settings"], state["since_test"]
    (state_dir / "state.json").write_text(json.dumps(state))
    older = _store(state_dir, base, window=100, max_window=300)
    assert older.window == [] and older.since_test == 0 and (older.tests, older.resets) == (1, 1)
    assert older.events[-1]["reason"].endswith("from unknown")
    assert older.events[-1]["dropped"] == 60
