"""`studies.recert_carry`: the service's store driven window after window over a served
stream, and the active rule at each checkpoint applied to the next items."""

from __future__ import annotations

import json

import numpy as np

from heads.recert import shipped_rule
from studies.recert_carry import run, save_cost, stream_change, summary
from studies.recert_study import rule_on
from tests.test_recert import _base, stream


def _rows(base, n: int, **kw) -> list[dict]:
    return [{"id": rid, "served": s.to_dict(), "correct": bool(z)}
            for rid, s, z in stream(np.random.default_rng(5), n, base, shift=6.0, **kw)]


def test_each_checkpoint_applies_the_rule_then_active_to_the_next_items(tmp_path):
    base = _base()
    rows = _rows(base, 700, accuracy_offset=6.0)
    got = run(base, rows, 100, 300, [100, 300, 600], 100, seed=2, flip=0.0,
              state=tmp_path / "s.json")
    assert got["switches"] and got["switches"][0] % 100 == 0     # only at a test
    assert set(got["at"]) == {100, 300, 600}
    assert got["at"][600]["switched"]
    # the figures are the rule's own on the next 100 of the same seeded order: redo them
    from heads.recert import RuleStore, Served, Settings

    order = np.random.default_rng(2).permutation(len(rows))
    store = RuleStore(tmp_path / "again.json", base, "x", Settings(window=100, max_window=300,
                                                                  min_per_class=10))
    for i in order[:600]:
        store.add(rows[i]["id"], Served.from_dict(rows[i]["served"]), rows[i]["correct"], "t")
    released, risk, _ = rule_on(base, store.active, [rows[j] for j in order[600:700]])
    assert (got["at"][600]["released"], got["at"][600]["risk"]) == (released, risk)
    assert got["at"][600]["tau"] == store.active.tau
    # no next items past the stream's end
    tail = run(base, rows, 100, 300, [700], 100, seed=2, flip=0.0, state=tmp_path / "t.json")
    assert tail["at"][700]["released"] is None


def test_a_stream_the_actor_gets_half_wrong_never_switches(tmp_path):
    base = _base()
    rows = _rows(base, 400, accuracy_offset=0.0)
    for flip in (0.0, 0.2):
        got = run(base, rows, 100, 300, [200, 300], 100, seed=0, flip=flip,
                  state=tmp_path / "s.json")
        assert got["switches"] == [] and not any(x["switched"] for x in got["at"].values())


def test_summary_counts_orders_at_the_floor_and_over_r():
    runs = [{"at": {10: {"switched": s, "released": rel, "risk": risk}}}
            for s, rel, risk in ((True, 0.8, 0.04), (True, 0.7, 0.06), (False, 0.1, 0.2),
                                 (True, 0.0, 0.0), (True, 0.9, 0.08))]
    got = summary(runs, 10, floor=0.75, r=0.05)
    # the worst risk of a certified rule leaves out the run still on the shipped one; at
    # the floor within r leaves out the run released at the floor with risk above r
    assert got == {"runs": 5, "switched": 4, "released_mean": 0.5, "released_min": 0.0,
                   "risk_mean": 0.095, "risk_max": 0.2, "risk_max_switched": 0.08,
                   "risk_above_r": 3, "at_floor": 2, "at_floor_within_r": 1}
    # no floor (not the benign stream), and a checkpoint no run reached
    assert summary(runs, 10, floor=None, r=0.05)["at_floor"] is None
    assert summary(runs, 20, floor=0.75, r=0.05)["runs"] == 0


def test_the_state_file_write_is_timed_on_a_full_window(tmp_path):
    base = _base()
    got = save_cost(base, _rows(base, 50), 40, tmp_path, rounds=3)
    assert got["verdicts"] == 40 and got["rounds"] == 3 and got["median_ms"] > 0
    assert got["bytes"] == (tmp_path / "cost.json").stat().st_size and got["rules"] == 1
    rows = _rows(base, 700, accuracy_offset=6.0)
    rule = run(base, rows, 100, 300, [600], 50, seed=2, flip=0.0, state=tmp_path / "s.json")["rule"]
    assert rule.version.startswith("r")                          # certified
    kept = save_cost(base, rows, 40, tmp_path, rule, rounds=1)
    assert kept["rules"] == 20 and kept["bytes"] > got["bytes"]
    saved = json.loads((tmp_path / "cost.json").read_text())
    assert len(saved["rules"]) == 20 and saved["rules"]["r3"] == rule.to_dict()


def test_a_stream_change_keeps_the_old_streams_rule_unless_reset(tmp_path):
    base = _base()
    good = _rows(base, 400, accuracy_offset=5.0)
    bad = [{**x, "id": "bad-" + x["id"]} for x in _rows(base, 300, accuracy_offset=0.0)]
    kept = stream_change(base, good, bad, 100, 300, 300, 100, 100, 2, False,
                         tmp_path / "a.json")
    assert kept["switched_on_first"] and not kept["serving_shipped"]
    fresh = stream_change(base, good, bad, 100, 300, 300, 100, 100, 2, True,
                          tmp_path / "b.json")
    assert fresh["switched_on_first"] and fresh["serving_shipped"]
    # the figures are the served rule's on the second stream's next items
    order = np.random.default_rng(2).permutation(len(bad))[100:200]
    assert (fresh["released"], fresh["risk"]) == rule_on(
        base, shipped_rule(base), [bad[j] for j in order])[:2]
