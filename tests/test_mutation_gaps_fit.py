"""The fit paths of DualRead's branches (PSR, P-State, PER) on a label the features carry.

No model: features are drawn here, the label is a known function of them, and every fitted
quantity is checked against a reference computed here (numpy from the reader's parameters,
scipy's optimiser for the temperatures), never against the fitting code itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from sklearn.metrics import roc_auc_score

from heads.dualread import Heads
from heads.methods.dualread import PER, PSR, DualRead, PState
from heads.registry import FitData
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
