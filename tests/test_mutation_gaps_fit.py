"""The fit paths of DualRead's branches (PSR, P-State, PER) on a label the features carry.

No model: features are drawn here, the label is a known function of them, and every fitted
quantity is checked against a reference computed here (numpy from the reader's parameters,
scipy's optimiser for the temperatures), never against the fitting code itself. The last
section tests the helpers of heads/fit.py (flag rates, prior check, tree description)
against values worked out by hand.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from sklearn.metrics import roc_auc_score

from heads.dualread import Heads
from heads.methods.dualread import PER, PSR, DualRead, PState
from heads.registry import FitData
from tests.helpers import one_commit_repo
from tests.test_wiring import np_reader, sigmoid

D = 4
N = 600
# image-disjoint splits in fit-heads; here plain index ranges
SPLITS = {"reader": range(0, 300), "reader_train": range(0, 220), "reader_val": range(220, 300),
          "temperature": range(300, 450), "defer": range(450, 600)}


def _data(seed: int = 0) -> FitData:
    """z = [s + noise > 0.5], s = 3·h_pre[0] + 2·h_close[1] + 2·phi[2]: each branch's own
    input carries part of the signal, so each fitted reader must rank better than chance,
    and P-Visual has a residual to learn on top of P-State."""
    g = torch.Generator().manual_seed(seed)
    feats = {"h_pre": torch.randn(N, D, generator=g), "h_close": torch.randn(N, D, generator=g),
             "phi": torch.randn(N, 4 * D, generator=g)}
    s = 3 * feats["h_pre"][:, 0] + 2 * feats["h_close"][:, 1] + 2 * feats["phi"][:, 2]
    z = (s + torch.randn(N, generator=g) > 0.5).float()
    splits = {k: torch.tensor(list(v)) for k, v in SPLITS.items()}
    return FitData(feats, z, splits, seed=3)


def _np(data: FitData, key: str, split: str) -> np.ndarray:
    return data.feats[key].double().numpy()[list(SPLITS[split])]


def _z(data: FitData, split: str) -> np.ndarray:
    return data.z.double().numpy()[list(SPLITS[split])]


def bce(logits: np.ndarray, z: np.ndarray) -> float:
    return float(np.mean(np.logaddexp(0, logits) - z * logits))


def best_temperature(logits: np.ndarray, z: np.ndarray) -> float:
    """argmin_T BCE(σ(ℓ/T), z), by scipy's bounded scalar search over log T."""
    res = minimize_scalar(lambda lt: bce(logits / math.exp(lt), z), bounds=(-3, 4),
                          method="bounded", options={"xatol": 1e-8})
    return math.exp(res.x)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These fits are tiny: one thread is fastest, and far faster than two under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fitted(one_thread):
    torch.manual_seed(0)
    heads, data = Heads.new(D), _data()
    logs = {m.name: m.fit(heads, data) for m in (PSR(), PState(), PER())}
    return heads, data, logs


def test_psr_fit_reads_h_pre_on_reader_train_and_undoes_the_class_weight(fitted):
    heads, data, logs = fitted
    # standardised with the statistics of its own training split and input
    np.testing.assert_allclose(heads.psr.norm.mean.numpy(), _np(data, "h_pre", "reader_train")
                               .mean(0), rtol=1e-5, atol=1e-6)
    # class-weighted BCE shifts the logit by log(pos_weight), pos_weight = (1 − q)/q
    q = _z(data, "reader_train").mean()
    assert 0.2 < q < 0.8
    assert heads.offsets["psr"] == pytest.approx(-math.log((1 - q) / q), rel=1e-5)
    assert logs["psr"]["prior_offset"] == pytest.approx(heads.offsets["psr"])
    # the temperature is fitted on the temperature split, on logits that include the offset
    lg = np_reader(heads.psr, _np(data, "h_pre", "temperature")) + heads.offsets["psr"]
    t = best_temperature(lg, _z(data, "temperature"))
    assert heads.temperatures["psr"] == pytest.approx(t, rel=2e-3)
    # the offset matters to that temperature (else the check above could not see it)
    t_wo = best_temperature(lg - heads.offsets["psr"], _z(data, "temperature"))
    assert abs(t_wo - t) > 0.01 * t
    # learnt: ranks the held-out defer split well above chance
    p = PSR().score(heads, data.on("defer"))
    assert roc_auc_score(_z(data, "defer"), p) > 0.65


def test_p_state_fit_reads_h_close_on_the_reader_split(fitted):
    heads, data, logs = fitted
    x = _np(data, "h_close", "reader")
    np.testing.assert_allclose(heads.state.norm.mean.numpy(), x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(heads.state.norm.std.numpy(), x.std(0, ddof=1), rtol=1e-4)
    # the log's BCE is the BCE of the fitted reader on its split
    assert logs["p_state"]["train_bce"] == pytest.approx(
        bce(np_reader(heads.state, x), _z(data, "reader")), abs=2e-5)
    q = _z(data, "reader").mean()
    assert logs["p_state"]["prior_bce"] == pytest.approx(
        -(q * math.log(q) + (1 - q) * math.log(1 - q)), abs=2e-5)
    assert logs["p_state"]["train_bce"] < logs["p_state"]["prior_bce"] - 0.05
    lg = np_reader(heads.state, _np(data, "h_close", "temperature"))
    assert heads.temperatures["p_state"] == pytest.approx(
        best_temperature(lg, _z(data, "temperature")), rel=2e-3)
    p = PState().score(heads, data.on("defer"))
    np.testing.assert_allclose(p, sigmoid(np_reader(heads.state, _np(data, "h_close", "defer"))
                                          / heads.temperatures["p_state"]), rtol=1e-5)
    assert roc_auc_score(_z(data, "defer"), p) > 0.6


def test_per_fits_p_visual_on_p_states_residual(fitted):
    heads, data, logs = fitted
    x = _np(data, "phi", "reader")
    np.testing.assert_allclose(heads.visual.norm.mean.numpy(), x.mean(0), rtol=1e-5, atol=1e-6)
    l_state = np_reader(heads.state, _np(data, "h_close", "reader"))
    l_post = l_state + np_reader(heads.visual, x)
    # the residual fit: its BCE is that of state + visual, not of the visual reader alone
    assert logs["per"]["train_bce"] == pytest.approx(bce(l_post, _z(data, "reader")), abs=2e-5)
    assert abs(bce(np_reader(heads.visual, x), _z(data, "reader")) - logs["per"]["train_bce"]) \
        > 0.01
    # P-Visual adds what P-State lacks: a lower training BCE than P-State's alone
    assert logs["per"]["train_bce"] < logs["p_state"]["train_bce"] - 0.05
    lt = (np_reader(heads.state, _np(data, "h_close", "temperature"))
          + np_reader(heads.visual, _np(data, "phi", "temperature")))
    assert heads.temperatures["per"] == pytest.approx(
        best_temperature(lt, _z(data, "temperature")), rel=2e-3)
    # on held-out items the post branch ranks better than P-State alone
    zd = _z(data, "defer")
    assert roc_auc_score(zd, PER().score(heads, data.on("defer"))) > \
        roc_auc_score(zd, PState().score(heads, data.on("defer")))


def test_fitting_leaves_the_other_branches_alone(fitted):
    """PER freezes P-State: refitting PER changes neither the state reader nor its
    temperature; DualRead has nothing of its own to fit."""
    heads, data, _ = fitted
    before = {k: v.clone() for k, v in heads.state.state_dict().items()}
    t_state = heads.temperatures["p_state"]
    PER().fit(heads, data)
    for k, v in heads.state.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert heads.temperatures["p_state"] == t_state
    assert DualRead().fit(heads, data) is None
    assert set(heads.temperatures) == {"psr", "p_state", "per"}


def test_psr_fit_uses_the_data_seed(one_thread):
    """Same seed, same reader; another seed, another reader (the MLP shuffles minibatches)."""

    def fit(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)                      # identical initial weights every time
        heads, data = Heads.new(D), _data()
        data.seed = seed
        PSR().fit(heads, data)
        return heads.psr.state_dict()

    a, b, c = fit(3), fit(3), fit(0)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert any(not torch.equal(a[k], c[k]) for k in a)


# ------------------------------------------------------------------ heads/fit.py's helpers
def test_fit_methods_logs_each_methods_entry_in_order_and_skips_none():
    from heads.fit import fit_methods

    seen = []

    class Toy:
        def __init__(self, name, entry):
            self.name, self.entry = name, entry

        def fit(self, heads, data):
            seen.append((self.name, heads, data))
            return self.entry

    heads, data = object(), object()
    log = fit_methods(heads, data, [Toy("b", {"x": 1}), Toy("a", None), Toy("c", {"y": 2})])
    assert log == {"b": {"x": 1}, "c": {"y": 2}} and list(log) == ["b", "c"]
    assert seen == [("b", heads, data), ("a", heads, data), ("c", heads, data)]
    assert fit_methods(heads, data, []) == {}                 # none given: none fitted


def test_novelty_items_are_the_shift_studys_pool():
    from heads.fit import NOVELTY_PER_FAMILY, novelty_items
    from models.data import Item
    from models.shift import FAMILIES, per_family

    items = [Item(id=f"i{k}", question="what colour is the shape?", answer="red",
                  image_path="x.png", image_id=f"img{k}") for k in range(300)]
    ids = [it.id for it in novelty_items(items, per_family=3, seed=2)]
    assert ids == [it.id for it in per_family(items, FAMILIES, 3, 102)]
    assert ids != [it.id for it in per_family(items, FAMILIES, 3, 2)]
    assert NOVELTY_PER_FAMILY == 250
    every = novelty_items(items)
    assert len(every) == len(FAMILIES) * 250
    assert [it.id for it in every] == [it.id for it in per_family(items, FAMILIES, 250, 100)]


def test_summary_table_rows():
    from heads.fit import summary_table

    held = {"dualread": {"auroc": 0.81234, "ece": 0.0456, "brier": 0.1999},
            "psr": {"auroc": 0.7, "ece": 0.1, "brier": 0.25}}
    assert summary_table(held).split("\n") == [
        "| method | AUROC | ECE-15 | Brier |", "|---|---|---|---|",
        "| dualread | 0.812 | 0.046 | 0.200 |", "| psr | 0.700 | 0.100 | 0.250 |"]


def test_rows_takes_index_lists_arrays_and_none():
    from heads.fit import _rows

    feats = {"a": torch.arange(10.0).reshape(5, 2), "b": torch.arange(5)}
    got = _rows(feats, [3, 0])
    assert got["a"].tolist() == [[6.0, 7.0], [0.0, 1.0]] and got["b"].tolist() == [3, 0]
    assert _rows(feats, np.array([4]))["b"].tolist() == [4]
    empty = _rows(feats, [])
    assert empty["a"].shape == (0, 2) and empty["b"].shape == (0,)


def test_clean_flag_rates_round_to_four_places_and_need_both_splits():
    from heads.fit import clean_flag_rates
    from heads.novelty import Novelty

    nov = Novelty("mahalanobis", "h_pre").fit(torch.tensor([[-1.0], [1.0], [-2.0], [2.0]]))
    x = torch.tensor([[0.1], [0.2], [3.0], [0.5], [5.0], [0.3], [0.4]])
    first, second = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6])
    nov.calibrate(x)
    got = clean_flag_rates(nov, x, first, second, 0.45)
    # all seven: 5.0 and 3.0 have p = 2/8, 3/8 < 0.45 -> 2/7
    assert got["calibration_flag_rate"] == 0.2857
    # read (0.5, 5.0, 0.3, 0.4) on the first three: 5.0 at 1/4 -> 1/4; read (0.1, 0.2,
    # 3.0) on the other four: 3.0 at 2/5 -> 1/3; their mean 7/24
    assert got["cross_flag_rate"] == 0.2917
    none = torch.tensor([], dtype=torch.long)
    assert "cross_flag_rate" not in clean_flag_rates(nov, x, none, second, 0.45)
    assert "cross_flag_rate" not in clean_flag_rates(nov, x, first, none, 0.45)
    assert clean_flag_rates(nov, x, none, none, 0.45) == {}


def test_bce_clips_saturated_confidences_and_reads_boolean_labels():
    from heads.fit import bce

    assert bce(np.array([0.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(-math.log(1e-6))
    assert bce(np.array([1.0, 0.0]), np.array([True, False])) == pytest.approx(
        -math.log(1 - 1e-6))
    assert bce([0.5, 0.5], [True, False]) == pytest.approx(math.log(2))


def test_prior_check_reads_the_reader_rate_against_the_defer_labels():
    from heads.fit import prior_check

    reader = np.array([1, 0, 0])                            # rate 1/3
    defer = np.array([1, 1, 1, 0])                          # share 3/4
    conf = np.array([0.9, 0.8, 0.7, 0.4])
    pc = prior_check({"psr": conf}, np.r_[reader, defer],
                     {"reader": np.arange(3), "defer": np.arange(3, 7)})
    by_hand = -(0.75 * math.log(1 / 3) + 0.25 * math.log(2 / 3))
    assert pc["prior_rate"] == 0.33333 and pc["prior_bce"] == round(by_hand, 5)
    assert pc["psr"] == round(-np.mean(np.log([0.9, 0.8, 0.7, 0.6])), 5)
    assert pc["worse"] == []


def test_a_reader_exactly_as_good_as_the_prior_is_worse():
    from heads.fit import prior_check

    # reader rate 1/2, defer labels [1, 0], P-State at 1/2: its BCE is the prior's, log 2
    pc = prior_check({"p_state": np.array([0.5, 0.5])}, np.array([1, 0, 1, 0]),
                     {"reader": np.arange(2), "defer": np.arange(2, 4)})
    assert pc["p_state"] == pc["prior_bce"] and pc["worse"] == ["p_state"]


def test_the_refusal_lists_every_worse_reader():
    from heads.fit import WorseThanPrior, refuse_worse_than_prior

    pc = {"prior_rate": 0.5, "prior_bce": 0.6931, "worse": ["psr", "p_state"],
          "psr": 0.7, "p_state": 0.75}
    with pytest.raises(WorseThanPrior, match=r": psr 0\.7000, p_state 0\.7500\. Give more"):
        refuse_worse_than_prior({"prior_check": pc})


def test_git_describe_outside_a_repository_and_of_the_code_itself(tmp_path, monkeypatch):
    import heads.fit
    from heads.fit import git_describe

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_describe(tmp_path) == {"describe": "unknown", "dirty": None}
    assert git_describe() == git_describe(Path(heads.fit.__file__).parent)


def test_check_tree_describes_the_tree_asked_for_and_says_what_to_do(tmp_path):
    from heads.fit import DirtyTree, check_tree

    head = one_commit_repo(tmp_path)
    assert check_tree(cwd=tmp_path) == {"describe": head, "dirty": False}
    (tmp_path / "a.txt").write_text("2")
    said = (r"the working tree is dirty \(" + head + r"-dirty\): the card could not name the "
            r"code that fitted it")
    with pytest.raises(DirtyTree, match=said + "; commit first, or pass --allow-dirty$"):
        check_tree(cwd=tmp_path)
    with pytest.warns(UserWarning, match=said + "$"):
        check_tree(allow_dirty=True, cwd=tmp_path)


def test_fit_methods_fits_the_registered_methods_by_default(monkeypatch):
    from heads import registry
    from heads.fit import fit_methods

    class Toy:
        name = "toy"

        def fit(self, heads, data):
            return {"fitted": True}

    monkeypatch.setattr(registry, "registered", lambda: [Toy()])
    assert fit_methods(object(), object()) == {"toy": {"fitted": True}}
