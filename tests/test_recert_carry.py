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
    assert [d for _, d in tests_run] == [spent_delta(0.1, t) for t in (1, 2, 3, 4)]
    assert [o.get("attempt") for o in outcomes if "attempt" in o] == ["refused"] * 4
    assert [e["window"]["n"] for e in store.events] == [100, 200, 250, 250]
    # what waits for the next test: the last 150, none of them since that test
    assert [v.request_id for v in store.window] == ids[250:400] and store.since_test == 0
    assert store.counted == set(ids[250:400])
    view = store.view()["window"]
    assert (view["counted"], view["needed"], view["max"], view["since_test"]) == \
        (150, 100, 250, 0)


def test_without_max_window_each_test_reads_its_own_verdicts_only(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 300)
    store = _store(state_dir, base, window=100, max_window=None)
    for rid, s, z in rows:
        store.add(rid, s, z, "op")
    ids = [r[0] for r in rows]
    assert [got for got, _ in tests_run] == [ids[:100], ids[100:200], ids[200:300]]
    assert store.window == [] and store.counted == set()
    # a max_window under the window reads as the window
    assert _store(state_dir, base, window=100, max_window=40).max_window == 100


def test_a_carried_window_certifies_where_separate_windows_do_not(state_dir):
    """The same 300 verdicts: three separate windows of 100 never certify; carried, the
    third test reads all 300 and does (at its own, smaller level δ/12)."""
    base = _base()
    rows = stream(np.random.default_rng(0), 300, base, shift=6.0, accuracy_offset=3.5)
    (state_dir / "apart").mkdir()
    apart = _store(state_dir / "apart", base, window=100, max_window=None)
    carried = _store(state_dir, base, window=100, max_window=300)
    tried = [(apart.add(rid, s, z, "op").get("attempt"), carried.add(rid, s, z, "op")
              .get("attempt")) for rid, s, z in rows]
    attempts = [t for t in tried if t != (None, None)]
    assert attempts == [("refused", "refused")] * 2 + [("refused", "switch")]
    assert apart.active.version == SHIPPED and carried.active.version != SHIPPED
    cert = carried.active.certificate
    assert cert["alpha_spending"]["test"] == 3 and cert["delta"] == spent_delta(0.1, 3)


def test_the_carried_window_and_its_count_survive_a_restart(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 230)
    store = _store(state_dir, base, window=100, max_window=300)
    for rid, s, z in rows[:130]:
        store.add(rid, s, z, "op")
    again = _store(state_dir, base, window=100, max_window=300)     # a restart
    assert len(again.window) == 130 and again.since_test == 30
    for rid, s, z in rows[130:230]:
        again.add(rid, s, z, "op")
    ids = [r[0] for r in rows]
    # the restart's test came after 100 new verdicts (70 of them after the restart)
    assert [got for got, _ in tests_run] == [ids[:100], ids[:200]]
    assert again.since_test == 30 and len(again.window) == 230


def test_a_state_file_from_before_counts_its_window_as_new(state_dir):
    """Files written before carried windows held only the verdicts since the last test."""
    base = _base()
    rows = _refused_stream(base, 40)
    store = _store(state_dir, base, window=100, max_window=300)
    for rid, s, z in rows:
        store.add(rid, s, z, "op")
    path = state_dir / "state.json"
    state = json.loads(path.read_text())
    del state["since_test"]
    path.write_text(json.dumps(state))
    assert _store(state_dir, base, window=100, max_window=300).since_test == 40


def test_a_reset_drops_the_window_and_is_audited(state_dir, tests_run):
    base = _base()
    rows = _refused_stream(base, 260)
    store = _store(state_dir, base, window=100, max_window=300)
    for rid, s, z in rows[:130]:
        store.add(rid, s, z, "op")
    assert store.reset_window("operator") == {"dropped": 130}
    assert store.window == [] and store.since_test == 0 and store.counted == set()
    [event] = [e for e in store.events if e["event"] == "window_reset"]
    assert event["who"] == "operator" and event["dropped"] == 130
    assert event["old"]["version"] == store.active.version and event["new"] is None
    again = _store(state_dir, base, window=100, max_window=300)     # persisted
    assert again.window == [] and again.since_test == 0
    for rid, s, z in rows[130:260]:
        again.add(rid, s, z, "op")
    ids = [r[0] for r in rows]
    # the test before the reset read 100; the one after it reads only what followed it
    assert [got for got, _ in tests_run] == [ids[:100], ids[130:230]]
    # an input still in the window is refused; one the reset dropped counts again
    assert again.add("again-1", rows[200][1], True, "op") == \
        {"counted": False, "reason": "duplicate_input"}
    assert again.add("again-2", rows[0][1], True, "op")["counted"]
