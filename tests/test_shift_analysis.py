"""The shift study's DualRead refit (`studies.shift_analysis.RefitDualRead`) on synthetic
features: it fits on the reader and temperature rows only, ranks as the data say, and its
τ keeps the risk it certifies on the clean defer split."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from heads.fit import image_split
from studies.shift_analysis import RefitDualRead

DIM = 8


def _features(seed: int, n: int = 600) -> dict:
    """z follows h_pre[0] + h_close[1] + phi[2] (two items per image, as the study has)."""
    g = torch.Generator().manual_seed(seed)
    f = {"h_pre": torch.randn(n, DIM, generator=g), "h_close": torch.randn(n, DIM, generator=g),
         "phi": torch.randn(n, 4 * DIM, generator=g)}
    logit = 3 * (f["h_pre"][:, 0] + f["h_close"][:, 1] + f["phi"][:, 2]) + 1.0
    f["z"] = (torch.rand(n, generator=g) < torch.sigmoid(logit)).long()
    f["_image_ids"] = np.array([f"s{seed}-{i // 2}" for i in range(n)])
    return f


def _fit(f: dict, clean_defer: dict) -> RefitDualRead:
    split = np.array([image_split(i) for i in f["_image_ids"]])
    torch.manual_seed(0)       # the readers' starting weights
    return RefitDualRead(DIM).fit(f, split, clean_defer, target_risk=0.2, delta=0.1)


def _tensors(f: dict, rows: np.ndarray | None = None) -> dict:
    out = {k: v for k, v in f.items() if torch.is_tensor(v)}
    return out if rows is None else {k: v[rows] for k, v in out.items()}


def test_refit_reads_only_reader_and_temperature_rows():
    f = _features(0)
    split = np.array([image_split(i) for i in f["_image_ids"]])
    defer_rows = np.nonzero(split == "defer")[0]
    assert len(defer_rows) > 50                       # precondition: the split is there
    clean_defer = _tensors(f, defer_rows)
    flipped = {**f, "z": f["z"].clone()}
    flipped["z"][defer_rows] = 1 - flipped["z"][defer_rows]
    test = _tensors(_features(1))
    a, b = _fit(f, clean_defer), _fit(flipped, clean_defer)
    np.testing.assert_array_equal(a.p(test), b.p(test))
    assert a.tau == b.tau


def test_refit_ranks_held_out_items_and_keeps_its_risk():
    f = _features(2)
    split = np.array([image_split(i) for i in f["_image_ids"]])
    clean_defer = _tensors(f, np.nonzero(split == "defer")[0])
    refit = _fit(f, clean_defer)
    test = _features(3)
    p = refit.p(_tensors(test))
    assert p.shape == (600,) and np.all((p > 0) & (p < 1))
    assert roc_auc_score(test["z"].numpy(), p) > 0.85
    # a guaranteed-risk τ is at least as strict as the empirical risk on its own split
    p_df = refit.p(clean_defer)
    kept = p_df >= refit.tau
    z_df = clean_defer["z"].numpy()
    assert not kept.any() or 1 - z_df[kept].mean() <= 0.2


def test_refit_uses_the_study_settings_not_the_shipped_ones(monkeypatch):
    # docs/shift-study's approach (b): post-answer L2 1e-3, no answer flips. Changing what
    # the service ships must not change the study's refit.
    import heads.methods.dualread as dm
    from heads.modules import Reader, fit_linear
    from studies.shift_analysis import STUDY_POST

    assert STUDY_POST == {"flip_weight": 0.0, "l2": 1e-3}
    f = _features(4)
    split = np.array([image_split(i) for i in f["_image_ids"]])
    clean_defer = _tensors(f, np.nonzero(split == "defer")[0])
    test = _tensors(_features(5))
    before = _fit(f, clean_defer).p(test)
    monkeypatch.setattr(dm, "POST_L2", 10.0)
    monkeypatch.setitem(dm.FLIP_WEIGHTS, "state", 1.0)
    monkeypatch.setitem(dm.FLIP_WEIGHTS, "visual", 1.0)
    refit = _fit(f, clean_defer)
    np.testing.assert_array_equal(refit.p(test), before)
    # P-State is the plain docs/method.md fit with l2 1e-3 on the reader rows (no flips, no refit)
    reader = split == "reader"
    expected = Reader(DIM)
    fit_linear(expected, f["h_close"][reader], f["z"][reader], l2=1e-3)
    torch.testing.assert_close(refit.heads.readers["state"].net[-1].weight,
                               expected.net[-1].weight)


def test_lofo_table_shows_the_rule_column_only_when_every_fold_has_it():
    from studies.shift_analysis import _METHODS, _lofo_table, _methods

    def c(defer: float, risk: float, kept: int) -> dict:
        return {"defer_rate": defer, "risk_kept": risk, "n_kept": kept}

    def row(with_rule: bool) -> dict:
        r = {m: {"test~blur:5": c(0.5, 0.2, 100)} for m in _METHODS if m != "rule@0.01"}
        r["b"] = {"test~blur:5": c(0.5, 0.2, 100)}
        if with_rule:
            r["rule@0.01"] = {"test~blur:5": c(0.95, 0.3, 10)}   # defer ≥ 0.9: met
        return r

    rep = {"target_risk": 0.05, "shipped": {"test~blur:5": c(0.2, 0.2, 160)},
           "lofo": {"blur": row(True)}}
    assert _methods(rep)[-1] == "rule@0.01"
    line = _lofo_table(rep, 5)[-1]
    assert line.endswith("0.95 / 0.30 (10) ✓ |") and line.startswith("| blur:5 (0.20 / 0.20)")
    rep["lofo"]["noise"] = row(False)
    assert "rule@0.01" not in _methods(rep)
    assert "rule@0.01" not in _lofo_table(rep, 5)[0]
