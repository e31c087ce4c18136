"""Re-certification of the defer rule (heads.recert) and input drift (heads.drift): the
certificate, the guards, persistence, and what the rule serves."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from heads.defer import DeferPolicy, clopper_pearson_upper
from heads.drift import DriftWindow
from heads.dualread import Heads
from heads.methods.dualread import DualRead
from heads.monitor import FeedbackMonitor
from heads.novelty import Novelty
from heads.recert import (
    SHIPPED,
    RuleStore,
    Served,
    Settings,
    Verdict,
    _loo_p_values,
    branch_logits,
    certify,
    dualread_at,
    in_temperature_part,
    shipped_rule,
)

R, DELTA = 0.1, 0.1


def _policy(tau: float, r: float = R) -> DeferPolicy:
    return DeferPolicy(tau, r, DELTA, 0.7, 0.05, 0.08, 500, True)


def _check(seed: int = 0) -> Novelty:
    """A kNN detector on 2-D features; its clean scores are distances of about 0.1-1."""
    rng = np.random.default_rng(seed)
    return Novelty("knn", "pixels").fit(torch.from_numpy(rng.normal(size=(300, 2)))) \
        .calibrate(torch.from_numpy(rng.normal(size=(299, 2))))


def _base(tau: float = 0.8, check: bool = True) -> Heads:
    h = Heads(dim=2, policy=_policy(tau))
    h.temperatures = {"psr": 1.0, "per": 1.0}
    h.novelty = _check() if check else None
    return h


def _clean_scores(det: Novelty, rng, n: int) -> np.ndarray:
    return det.score(torch.from_numpy(rng.normal(size=(n, 2))))


def stream(rng, n: int, base: Heads, *, shift: float = 0.0, accuracy_offset: float = 3.0,
           informative: float = 2.5, tag: str = "x") -> list[tuple[str, Served, bool]]:
    """Synthetic served answers: a latent ease drives both the branch log-odds (with
    `informative` weight) and correctness; `shift` moves the novelty detector's input (the
    detector sees the stream as new); `accuracy_offset` sets how often the actor is right."""
    ease = rng.normal(size=n)
    correct = rng.uniform(size=n) < 1 / (1 + np.exp(-(2.5 * ease + accuracy_offset)))
    pre = informative * ease + 0.7 * rng.normal(size=n) + 1.5
    post = informative * ease + 0.7 * rng.normal(size=n) + 1.5
    feats = rng.normal(size=(n, 2)) + shift
    scores = base.novelty.score(torch.from_numpy(feats))
    p = base.novelty.p_values_of(scores)
    # the same floats and bools as indexing each array, read off in one pass each
    cols = zip(pre.tolist(), post.tolist(), scores.tolist(), p.tolist(), correct.tolist())
    return [(f"{tag}-{i}", Served(SHIPPED, (a, b, 0.0), {"novelty": s}, {"novelty": q}, False),
             z) for i, (a, b, s, q, z) in enumerate(cols)]


def verdicts(rows, flip_wrong: float = 0.0, rng=None) -> list[Verdict]:
    out = []
    for rid, s, z in rows:
        said = z or (flip_wrong > 0 and rng.uniform() < flip_wrong)
        out.append(Verdict(rid, s, bool(said), 0.0, "operator:test"))
    return out


def released(rule_heads: Heads, rows) -> tuple[float, float]:
    """(released share, risk among released) of `rows` under a rule's heads."""
    x = np.array([s.logits for _, s, _ in rows])
    p = dualread_at(x, rule_heads.temperature("psr"), rule_heads.temperature("per"))
    pv = rule_heads.novelty.p_values_of(np.array([s.scores["novelty"] for _, s, _ in rows]))
    keep = rule_heads.defer_mask(p, pv, None) == 0
    z = np.array([c for _, _, c in rows])
    return float(keep.mean()), float(1 - z[keep].mean()) if keep.any() else 0.0


# ------------------------------------------------------------------ scoring parity
def test_dualread_at_equals_the_served_confidence():
    """Re-scoring from the stored branch log-odds at the artefact's temperatures gives
    exactly what the heads serve, consistency term included."""
    torch.manual_seed(0)
    heads = Heads.new(6)
    for reader in heads.readers.values():
        reader.eval()                            # as loaded heads are (no dropout)
    heads.temperatures = {"psr": 1.7, "per": 0.6}
    heads.offsets = {"psr": 0.3, "consistency": -0.4}
    f = {"h_pre": torch.randn(50, 6), "h_close": torch.randn(50, 6),
         "phi": torch.randn(50, 24)}
    lg = branch_logits(heads, f)
    assert (lg[:, 2] < 0).any() and (lg[:, 2] == 0).any()     # the term bites on some
    served = DualRead().score(heads, f)
    assert np.allclose(dualread_at(lg, 1.7, 0.6), served, atol=1e-12)
    assert not np.allclose(dualread_at(lg, 1.0, 1.0), served, atol=1e-3)


# ------------------------------------------------------------------ the certificate
def test_benign_stream_is_recertified_and_released():
    """A stream the novelty detector flags but the actor answers as well as on clean inputs:
    the shipped rule defers it; the rule certified on its window releases the next 500
    items at the coverage the same protocol reaches on clean inputs (less 0.05, mean of 30
    draws: one window's coverage varies by ±0.15) with risk ≤ r on average and ≤ r + 0.02
    (docs/method.md §8's benign criterion) in all but a few windows: the certificate
    holds with probability 1 − δ per window, and 500 items are a finite sample."""
    base = _base()
    shipped = shipped_rule(base).apply(base)
    clean, benign, risks = [], [], []
    for seed in range(30):
        rng = np.random.default_rng(seed)
        clean_rule, _ = certify(verdicts(stream(rng, 300, base, tag="c")), base, "clean",
                                target_risk=R, delta=DELTA, min_per_class=10)
        clean.append(0.0 if clean_rule is None else
                     released(clean_rule.apply(base), stream(rng, 500, base, tag="c2"))[0])
        window = stream(rng, 300, base, shift=6.0, tag="w")
        assert released(shipped, window)[0] < 0.05     # the detector flags it: deferred
        rule, cert = certify(verdicts(window), base, "r1", target_risk=R, delta=DELTA,
                             min_per_class=10)
        assert cert["holds"] and rule is not None, cert
        assert cert["detector_references"]["novelty"].startswith("extended")
        assert cert["risk_upper_bound"] <= R
        assert set(rule.temperatures) == {"psr", "per"}
        cov, risk = released(rule.apply(base), stream(rng, 500, base, shift=6.0, tag="n"))
        risks.append(risk)
        benign.append(cov)
    assert np.mean(benign) >= np.mean(clean) - 0.05, (benign, clean)
    assert np.mean(risks) <= R, risks
    assert sum(r > R + 0.02 for r in risks) <= 2 * DELTA * len(risks), risks
    # the shipped detector is unchanged: the extension lives in the rule's copy
    assert len(base.novelty.t["calibration"]) == 299


def test_harmful_stream_is_refused_and_says_why():
    base = _base()
    rng = np.random.default_rng(2)
    window = stream(rng, 300, base, shift=6.0, accuracy_offset=-0.5, informative=0.0)
    rule, cert = certify(verdicts(window), base, "r1", target_risk=R, delta=DELTA,
                         min_per_class=10)
    assert rule is None and not cert["holds"]
    assert "Clopper-Pearson" in cert["reason"]


def test_label_balance_and_temperature_part_are_checked():
    base = _base()
    rng = np.random.default_rng(3)
    rows = stream(rng, 300, base)
    all_right = [Verdict(v.request_id, v.served, True, 0.0, "") for v in verdicts(rows)]
    rule, cert = certify(all_right, base, "r1", target_risk=R, delta=DELTA, min_per_class=10)
    assert rule is None and cert["reason"].startswith("label balance")
    # too few verdicts to refit a temperature on: the base's are kept, and said so
    _, cert = certify(verdicts(rows[:40]), base, "r1", target_risk=0.3, delta=DELTA,
                      min_per_class=1)
    assert cert["temperatures_kept"].startswith("temperature part has")
    assert cert["temperatures"] == {"psr": 1.0, "per": 1.0}


def test_poisoned_windows_cannot_push_released_risk_past_2r():
    """An operator client that marks 20% of the wrong answers in a window as correct:
    whenever the certificate holds, the next 500 items' risk among released stays ≤ 2r."""
    base = _base()
    held = 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        rows = stream(rng, 300, base, shift=6.0, accuracy_offset=1.2, tag=f"p{seed}")
        rule, cert = certify(verdicts(rows, 0.2, rng), base, f"r{seed}", target_risk=R,
                             delta=DELTA, min_per_class=10)
        if rule is None:
            continue
        held += 1
        _, risk = released(rule.apply(base), stream(rng, 500, base, shift=6.0,
                                                    accuracy_offset=1.2, tag=f"q{seed}"))
        assert risk <= 2 * R, (seed, risk, cert)
    assert held >= 10          # the claim is about certificates that hold: enough of them


def test_leave_one_out_p_values_by_hand():
    win = np.array([0.2, 0.6, 0.6, 2.0])
    got = _loo_p_values(win, np.arange(4))
    for i, s in enumerate(win):
        others = np.delete(win, i)
        assert got[i] == pytest.approx((1 + (others >= s).sum()) / (len(others) + 1))


def test_split_is_by_request_id():
    ids = [f"id{i}" for i in range(2000)]
    share = np.mean([in_temperature_part(i, 0.3) for i in ids])
    assert 0.25 < share < 0.35
    assert in_temperature_part("id7", 0.3) == in_temperature_part("id7", 0.3)


def test_extend_reference_only_raises_p_values():
    """Clean inputs keep at least their p-value; inputs like the added stream pass at the
    rate α would flag them among themselves, not at the stream's share of a pool."""
    det = _check()
    rng = np.random.default_rng(5)
    far = det.score(torch.from_numpy(rng.normal(size=(300, 2)) + 6.0))
    ext = det.extend_reference(far)
    clean = _clean_scores(det, rng, 200)
    assert (ext.p_values_of(clean) >= det.p_values_of(clean)).all()
    fresh = det.score(torch.from_numpy(rng.normal(size=(1000, 2)) + 6.0))
    assert (det.p_values_of(fresh) < 0.01).all()
    assert (ext.p_values_of(fresh) < 0.01).mean() <= 0.02
    # it reads as the detector it wraps, from features too
    x = torch.from_numpy(rng.normal(size=(5, 2)) + 6.0)
    assert [r.p_value for r in ext.read({"pixels": x}, 0.01)] == \
        pytest.approx(ext.p_value(x).tolist())
    assert ext.kind == "knn" and len(det.t["calibration"]) == 299


# ------------------------------------------------------------------ the store
def _store(tmp_path, base=None, window=300, **kw) -> RuleStore:
    base = base or _base()
    return RuleStore(tmp_path / "state.json", base, "heads-1",
                     Settings(window=window, min_per_class=10), **kw)


def test_window_survives_a_restart_and_counts_once(state_dir):
    base = _base()
    rows = stream(np.random.default_rng(6), 50, base)
    s = _store(state_dir, base)
    for rid, served, z in rows[:30]:
        assert s.add(rid, served, z, "operator:a")["counted"]
    assert s.add(rows[0][0], rows[0][1], True, "operator:a") == \
        {"counted": False, "reason": "already_counted"}
    again = _store(state_dir, base)                # a restart
    assert [v.request_id for v in again.window] == [r[0] for r in rows[:30]]
    assert [v.correct for v in again.window] == [r[2] for r in rows[:30]]
    assert again.window[3].served == rows[3][1]
    assert not again.add(rows[0][0], rows[0][1], True, "operator:a")["counted"]


def test_concurrent_verdicts_on_one_id_count_once(state_dir):
    base = _base()
    [(rid, served, _)] = stream(np.random.default_rng(7), 1, base)
    monitor = FeedbackMonitor()
    monitor.record(rid, 0.5, True, served)
    store = _store(state_dir, base)
    start = threading.Barrier(16)
    results = []

    def verdict():
        start.wait()
        got = monitor.take_served(rid)
        results.append(got is not None and store.add(rid, got, True, "op")["counted"])

    threads = [threading.Thread(target=verdict) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1 and len(store.window) == 1


def test_switch_is_audited_persisted_and_served(state_dir):
    base = _base()
    switched = []
    s = _store(state_dir, base, on_switch=switched.append)
    rows = stream(np.random.default_rng(8), 300, base, shift=6.0)
    for rid, served, z in rows:
        out = s.add(rid, served, z, "operator:a")
    assert out["attempt"] == "switch", out
    new = s.active
    assert new.version != SHIPPED and switched == [new] and s.window == []
    [event] = [e for e in s.events if e["event"] == "switch"]
    assert event["who"] == "operator:a" and event["at"]
    assert event["old"] == {"version": SHIPPED, "tau": 0.8}
    assert event["new"] == {"version": new.version, "tau": new.tau}
    assert event["window"]["n"] == 300 and event["certificate"]["holds"]
    text = json.dumps(s.events)
    assert not any(rid in text for rid, _, _ in rows)       # no request in the audit
    served_heads = new.apply(base)
    assert served_heads.policy.tau == new.tau and served_heads.rule_version == new.version
    assert served_heads.temperature("psr") == new.temperatures["psr"]
    again = _store(state_dir, base)
    assert again.active.version == new.version and again.chain == [SHIPPED, new.version]
    # rollback returns to the shipped rule and pins it; a pin brings a kept rule back
    assert again.rollback("operator:b").version == SHIPPED and again.pinned
    with pytest.raises(Exception, match="nothing to roll back"):
        again.rollback("operator:b")
    assert again.pin(new.version, "operator:b").version == new.version
    again.unpin("operator:b")
    assert [e["event"] for e in again.events][-3:] == ["rollback", "pin", "unpin"]
    assert _store(state_dir, base).active.version == new.version


def test_pinning_the_shipped_rule_keeps_it_reachable_by_rollback(state_dir):
    """pin r, pin shipped, rollback: the shipped rule stays first in the chain, so a
    rollback never strands an operator on a re-certified rule, and a 409 names the rule
    that is active (it used to say "shipped" while another rule served)."""
    base = _base()
    s = _store(state_dir, base)
    for rid, served, z in stream(np.random.default_rng(8), 300, base, shift=6.0):
        s.add(rid, served, z, "operator:a")
    new = s.active.version
    assert new != SHIPPED
    assert s.pin(SHIPPED, "operator:b").version == SHIPPED and s.chain == [SHIPPED]
    with pytest.raises(Exception, match=f"{SHIPPED} is the only rule"):
        s.rollback("operator:b")
    assert s.pin(new, "operator:b").version == new and s.chain == [SHIPPED, new]
    assert s.rollback("operator:b").version == SHIPPED
    with pytest.raises(Exception) as e:
        s.pin("\x00odd", "operator:b")
    assert "odd" not in str(e.value)                        # client text not echoed


def test_a_detector_refit_sets_the_re_certified_rules_aside(state_dir):
    """A rule's references are scores of the detector it extended: after `fit-detectors`
    (same fit-heads commit, new detector) the state file is set aside and the shipped rule
    serves, instead of the old references wrapping the new detector."""
    base = _base()
    s = _store(state_dir, base)
    for rid, served, z in stream(np.random.default_rng(8), 300, base, shift=6.0):
        s.add(rid, served, z, "operator:a")
    assert s.active.version != SHIPPED and s.active.references
    assert _store(state_dir, base).active.version == s.active.version     # same detector
    refit = _base()
    refit.novelty = _check(seed=5)                  # another calibration of the detector
    again = _store(state_dir, refit)
    assert again.active.version == SHIPPED and again.window == []
    assert list(state_dir.glob("state.json.stale-*"))


def test_a_refused_window_keeps_the_rule(state_dir):
    base = _base()
    s = _store(state_dir, base, window=300)
    rows = stream(np.random.default_rng(9), 300, base, shift=6.0, accuracy_offset=-0.5,
                  informative=0.0)
    for rid, served, z in rows:
        out = s.add(rid, served, z, "operator:a")
    assert out["attempt"] == "refused"
    assert s.active.version == SHIPPED and s.last_attempt["certificate"]["reason"]
    assert s.events[-1]["event"] == "refused" and s.events[-1]["new"] is None


def test_pinned_rule_is_not_switched(state_dir):
    base = _base()
    s = _store(state_dir, base)
    s.pin(None, "operator:a")
    for rid, served, z in stream(np.random.default_rng(8), 300, base, shift=6.0):
        out = s.add(rid, served, z, "operator:a")
    assert out["attempt"] == "held_pinned" and s.active.version == SHIPPED


def test_state_of_other_heads_is_set_aside(state_dir):
    base = _base()
    s = _store(state_dir, base)
    for rid, served, z in stream(np.random.default_rng(6), 5, base):
        s.add(rid, served, z, "op")
    other = _base(tau=0.6)                        # another artefact's shipped rule
    fresh = _store(state_dir, other)
    assert fresh.window == [] and fresh.active.tau == 0.6
    assert list(state_dir.glob("state.json.stale-*"))


def test_shipped_rule_is_the_artefacts():
    base = _base(tau=0.77)
    rule = shipped_rule(base)
    assert rule.version == SHIPPED and rule.tau == 0.77
    assert rule.apply(base).novelty is base.novelty   # nothing extended


# ------------------------------------------------------------------ drift
def test_drift_window_ks_against_the_reference():
    rng = np.random.default_rng(10)
    d = DriftWindow(200)
    d.set_reference({"s": rng.normal(size=1000)})
    for _ in range(10):
        d.record({"s": rng.normal()}, False)
    assert d.stats() == {}                        # too few to say
    for _ in range(200):
        d.record({"s": rng.normal()}, False)
    same = d.stats()
    assert same["ks"]["s"][1] > 0.001 and same["flagged_share"] == 0.0
    for _ in range(200):
        d.record({"s": rng.normal() + 1.5}, True)
    moved = d.stats()
    assert moved["ks"]["s"][0] > 0.4 and moved["ks"]["s"][1] < 1e-6
    assert moved["flagged_share"] == 1.0 and moved["n"] == 200


def test_clopper_pearson_is_the_offline_bound():
    """The certificate's bound is the offline one (heads.defer), not a copy."""
    base = _base()
    rows = stream(np.random.default_rng(11), 300, base)
    rule, cert = certify(verdicts(rows), base, "r", target_risk=R, delta=DELTA,
                         min_per_class=10)
    assert rule is not None
    assert cert["risk_upper_bound"] <= R
    assert clopper_pearson_upper(0, 0, DELTA) == 1.0
