"""The heads card and the defer rule where mutation testing found no fast test: the novelty
detector's card fields, what `load` restores or refuses, `novelty_of`, `defer_reasons` and
`defer_mask` over hand-chosen batches, and the image statistics the detector reads.

No actor is built: heads come from `Heads.new`, the detector is fitted on small random
features, and a readout is a namespace holding the two states `novelty_of` reads.
Expectations are typed out by hand (texts, flags, p-values from counted calibration scores)
or computed with numpy.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from heads.defer import DeferPolicy
from heads.dualread import CardTooNew, Heads, rule_of
from heads.features import image_stats
from heads.fit import fit_novelty
from heads.novelty import Novelty, features
from tests.helpers import drop_fingerprint_scheme

# the rule, reason and messages as docs/method.md §8 and the code state them, typed out here
RULE_NOVELTY = ("defer if DualRead < tau or novelty p-value < alpha or the response does "
                "not parse")
RULE_OLD = "defer if DualRead < tau or the response does not parse"
P_VALUE_TEXT = "(1 + #{i : s_i >= s(x)}) / (n + 1)"
DIM = 3


def _policy(tau: float) -> DeferPolicy:
    return DeferPolicy(tau=tau, target_risk=0.05, delta=0.1, coverage=0.5, empirical_risk=0.0,
                       risk_upper_bound=0.05, n_calibration=100, feasible=True)


def _feats(n: int, seed: int, shift: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = {k: torch.randn(n, DIM, generator=g) for k in ("h_pre", "img_mean", "img_std")}
    f["img_mean"] = f["img_mean"] + shift
    return f


def _detector() -> Novelty:
    # 40 fitting rows and 19 calibration rows: n_fit and n_calibration differ on purpose
    return fit_novelty(_feats(40, 0), _feats(40, 1, shift=3.0), _feats(19, 2))


def _heads_with_detector(alpha: float = 0.05) -> Heads:
    torch.manual_seed(0)
    h = Heads.new(DIM)
    h.policy = _policy(0.5)
    h.actor_fingerprint = "fp1"
    h.novelty = _detector()
    h.novelty_alpha = alpha
    return h


def _bools(a: np.ndarray, expected: list[bool]) -> None:
    """A boolean array of exactly these values (a float or 0-d array is a different one)."""
    assert isinstance(a, np.ndarray) and a.dtype == bool and a.shape == (len(expected),)
    assert a.tolist() == expected


# ------------------------------------------------------------------ the rule in words
def test_rule_of_names_the_novelty_term_only_with_a_detector():
    assert rule_of(None) == RULE_OLD
    assert rule_of(Novelty()) == RULE_NOVELTY
    assert Heads(dim=2).defer_rule == RULE_OLD


def test_platt_map_error_names_the_fix():
    h = Heads(dim=2)
    with pytest.raises(KeyError) as e:
        h.platt_map("sc_2")
    assert e.value.args[0] == ("these heads have no Platt map for 'sc_2'; refit them with "
                               "`dualread fit-heads`")
    assert h.platt_map("sc_2", (1.0, 2.0)) == (1.0, 2.0)


def test_temperature_view_writes_its_own_method():
    h = Heads(dim=2)
    h.t_post = 2
    assert h.temperatures == {"per": 2.0}
    assert h.t_post == 2.0 and h.t_pre == 1.0


# ------------------------------------------------------------------ defer_reasons / mask
def test_defer_reasons_with_policy_detector_and_problems():
    h = _heads_with_detector(alpha=0.05)
    p = [0.2, 0.5, 0.9, 0.9, 0.9, 0.9, 0.4]
    pv = [0.5, 0.5, 0.04, 0.05, None, float("nan"), 0.01]
    problems = [None, None, None, None, None, "truncated", "no answer"]
    why = h.defer_reasons(p, pv, problems)
    assert set(why) == {"tau", "novelty", "problem"}
    _bools(why["tau"], [True, False, False, False, False, False, True])       # p = τ stays
    _bools(why["novelty"], [False, False, True, False, False, False, True])   # p-value = α too
    _bools(why["problem"], [False, False, False, False, False, True, True])
    _bools(h.defer_mask(p, pv, problems), [True, False, True, False, False, True, True])


def test_defer_mask_is_an_or_of_the_three_reasons():
    # one reason alone per item, then pairs: an AND anywhere drops an item
    h = _heads_with_detector(alpha=0.05)
    p = [0.1, 0.9, 0.9, 0.9, 0.1]
    pv = [0.9, 0.01, 0.9, 0.01, 0.9]
    problems = [None, None, "bad", "bad", "bad"]
    _bools(h.defer_mask(p, pv, problems), [True, True, True, True, True])
    _bools(h.defer_mask([0.9, 0.9], [0.01, 0.9], [None, None]), [True, False])
    _bools(h.defer_mask([0.9, 0.9], [0.9, 0.9], ["bad", None]), [True, False])


def test_defer_reasons_defaults_and_the_no_policy_rule():
    h = _heads_with_detector()
    why = h.defer_reasons([0.1, 0.9])                  # no p-values, no problems given
    _bools(why["tau"], [True, False])
    _bools(why["novelty"], [False, False])
    _bools(why["problem"], [False, False])
    _bools(h.defer_mask([0.1, 0.9]), [True, False])
    # without a policy every item is deferred on τ; without a detector nothing is novel
    plain = Heads(dim=2)
    why = plain.defer_reasons([0.99, 0.5, 0.0], [0.0, 0.0, 0.0], [None, None, None])
    _bools(why["tau"], [True, True, True])
    _bools(why["novelty"], [False, False, False])
    _bools(why["problem"], [False, False, False])
    _bools(plain.defer_mask([0.99], [0.0], [None]), [True])


def test_defer_reasons_of_an_empty_batch_are_empty_boolean_arrays():
    for h in (_heads_with_detector(), Heads(dim=2)):
        why = h.defer_reasons([], [], [])
        for k in ("tau", "novelty", "problem"):
            _bools(why[k], [])
        _bools(h.defer_mask([], [], []), [])


# ------------------------------------------------------------------ novelty_of
def test_novelty_of_reads_the_readouts_pre_state_and_image_statistics():
    h = _heads_with_detector(alpha=0.5)
    g = torch.Generator().manual_seed(7)
    ro = SimpleNamespace(h_pre=torch.randn(DIM, generator=g, dtype=torch.float64),
                         h_image=torch.randn(5, DIM, generator=g))
    # the detector's feature built by hand: [h_pre ; mean ; unbiased std] over 5 tokens
    x = np.concatenate([ro.h_pre.numpy(), ro.h_image.numpy().mean(0),
                        ro.h_image.numpy().std(0, ddof=1)])
    s = float(h.novelty.score(torch.from_numpy(x)[None])[0])
    # 18 calibration scores below s and 1 above: p = (1 + 1) / (19 + 1) = 0.1,
    # novel under α = 0.5 but not under the default α = 0.01
    h.novelty.t["calibration"] = torch.tensor(sorted([s - 1.0 - i for i in range(18)])
                                              + [s + 1.0], dtype=torch.float64)
    r = h.novelty_of(ro)
    assert r.score == pytest.approx(s, abs=1e-5)
    assert r.p_value == pytest.approx(0.1) and r.novel is True
    h.novelty_alpha = 0.1                                   # p = α is not below α
    assert h.novelty_of(ro).novel is False
    assert Heads(dim=DIM).novelty_of(ro) is None            # no detector: no reading


# ------------------------------------------------------------------ the card
def test_card_records_every_novelty_field_and_the_fit_log(tmp_path):
    h = _heads_with_detector(alpha=0.05)
    d = h.novelty
    assert (d.kind, d.feature, d.n_fit, len(d.t["calibration"])) == \
        ("logistic", "pre_img_mean_std", 40, 19)
    h.save(tmp_path, {"command": "test", "novelty": {"auroc": 0.75, "per_family": 7}})
    text = (tmp_path / "heads_card.json").read_text()
    card = json.loads(text)
    assert card["novelty"] == {
        "auroc": 0.75, "per_family": 7, "kind": "logistic", "feature": "pre_img_mean_std",
        "alpha": 0.05, "n_fit": 40, "n_calibration": 19, "C": 0.1, "p_value": P_VALUE_TEXT,
        "files": ["novelty.safetensors", "novelty.json"]}
    assert card["defer_rule"] == RULE_NOVELTY
    assert (tmp_path / "novelty.safetensors").exists() and (tmp_path / "novelty.json").exists()
    # written for people: two-space indent, the caller's keys first
    assert text.startswith('{\n  "command": "test",\n  "novelty": {\n    "auroc": 0.75,')
    # without a fit log the detector's own fields are all there is
    h.save(tmp_path / "b", {})
    card = json.loads((tmp_path / "b" / "heads_card.json").read_text())
    assert set(card["novelty"]) == {"kind", "feature", "alpha", "n_fit", "n_calibration",
                                    "C", "p_value", "files"}
    h.novelty = None
    h.save(tmp_path / "c", {"novelty": {"auroc": 0.75}})
    card = json.loads((tmp_path / "c" / "heads_card.json").read_text())
    assert card["novelty"] is None and card["defer_rule"] == RULE_OLD


def test_load_restores_the_detector_and_its_alpha(tmp_path):
    h = _heads_with_detector(alpha=0.05)
    h.save(tmp_path, {})
    back = Heads.load(tmp_path, "fp1")
    assert back.novelty is not None and back.novelty_alpha == 0.05
    assert back.defer_rule == RULE_NOVELTY
    x = features("pre_img_mean_std", _feats(6, 9, shift=1.0))
    np.testing.assert_allclose(back.novelty.p_value(x), h.novelty.p_value(x))
    # a card whose novelty entry lacks α falls back to docs/method.md's α = 0.01
    card = json.loads((tmp_path / "heads_card.json").read_text())
    del card["novelty"]["alpha"]
    (tmp_path / "heads_card.json").write_text(json.dumps(card))
    assert Heads.load(tmp_path).novelty_alpha == 0.01


def test_load_renames_legacy_temperature_keys(tmp_path):
    Heads.new(DIM).save(tmp_path, {})
    card = json.loads((tmp_path / "heads_card.json").read_text())
    card["temperatures"] = {"T_pre": 1.5, "T_post": 0.5, "per_new": 2.0}
    (tmp_path / "heads_card.json").write_text(json.dumps(card))
    assert Heads.load(tmp_path).temperatures == {"psr": 1.5, "per": 0.5, "per_new": 2.0}


@pytest.mark.parametrize("version", [6, 9])
def test_a_newer_card_is_refused_with_the_fix(tmp_path, version):
    Heads.new(DIM).save(tmp_path, {})
    card = json.loads((tmp_path / "heads_card.json").read_text())
    card["card_version"] = version
    (tmp_path / "heads_card.json").write_text(json.dumps(card))
    with pytest.raises(CardTooNew) as e:
        Heads.load(tmp_path)
    assert str(e.value) == (
        f"heads in {tmp_path} have card version {version}, newer than this code reads "
        "(up to 5): it could drop parts of their defer rule; upgrade dualread or load heads "
        "fitted by this version")


def test_legacy_warning_points_at_the_caller(tmp_path, monkeypatch):
    import heads.dualread as dualread

    h = Heads.new(DIM)
    h.actor_fingerprint = "old-fp"
    h.save(tmp_path, {})
    drop_fingerprint_scheme(tmp_path)
    monkeypatch.setitem(dualread.LEGACY_FINGERPRINTS, "new-fp", "old-fp")
    with pytest.warns(UserWarning) as rec:
        Heads.load(tmp_path, "new-fp")
    # stacklevel: the warning names the line that called `Heads.load`, i.e. this file
    # (under mutation testing the trampoline adds a frame of its own)
    assert rec[0].filename == __file__ or "mutmut" in rec[0].filename


# ------------------------------------------------------------------ image statistics
def test_image_stats_over_tokens_match_numpy():
    v = torch.arange(12, dtype=torch.float32).reshape(3, 4) ** 1.5     # M = 3 tokens, D = 4
    mean, std = image_stats(v)
    assert mean.shape == (4,) and std.shape == (4,)
    np.testing.assert_allclose(mean.numpy(), v.numpy().mean(0), rtol=1e-6)
    np.testing.assert_allclose(std.numpy(), v.numpy().std(0, ddof=1), rtol=1e-6)
    two = torch.tensor([[1.0, 2.0, 3.0], [3.0, 6.0, 3.0]])            # M = 2: std √2, 2√2, 0
    np.testing.assert_allclose(image_stats(two)[1].numpy(), [2 ** 0.5, 8 ** 0.5, 0.0],
                               rtol=1e-6)
    mean, std = image_stats(torch.tensor([[1.0, -2.0]]))                # one token: std 0
    assert mean.tolist() == [1.0, -2.0] and std.tolist() == [0.0, 0.0]
