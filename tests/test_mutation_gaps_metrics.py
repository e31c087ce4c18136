"""Calibration, features and readout assembly where mutation testing found no fast test:
the Platt fit against scikit-learn, `extract`'s image statistics and empty-span defaults,
PSR's offset, `locate`'s choice of the closing token and `StateTap`'s hook bookkeeping.

No actor is built. Expectations come from scikit-learn, numpy or are typed out by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from heads.calibration import fit_platt
from heads.dualread import Heads
from heads.features import extract
from heads.methods.dualread import pre_logits
from models.parse import Parsed
from models.readout import Readout, StateTap, locate


# ------------------------------------------------------------------ Platt
def _sklearn_platt(s: np.ndarray, z: np.ndarray) -> tuple[float, float]:
    """(a, b) of σ(a·s + b): scikit-learn's logistic regression with C = 1e4 (the ridge
    `fit_platt` documents) on standardised scores, mapped back to raw scores."""
    mu, sd = s.mean(), s.std()
    lr = LogisticRegression(C=1e4, tol=1e-12, max_iter=100_000).fit(((s - mu) / sd)[:, None], z)
    a = lr.coef_[0][0] / sd
    return a, lr.intercept_[0] - a * mu


def test_platt_on_small_scale_scores_matches_sklearn():
    # scores with std 0.01: the fit must standardise them, or the ridge on the raw slope
    # (a ≈ 260 here) pulls it far below the maximum-likelihood value
    rng = np.random.default_rng(0)
    s = rng.normal(size=60) * 0.01
    z = (rng.random(60) < 1 / (1 + np.exp(-300 * s))).astype(int)
    a, b = fit_platt(s, z)
    ra, rb = _sklearn_platt(s, z)
    assert a == pytest.approx(ra, rel=1e-3) and b == pytest.approx(rb, rel=1e-3, abs=1e-3)


def test_platt_on_separable_scores_is_held_by_the_ridge():
    # separable labels: without the ridge the slope would grow without bound; with it the
    # slope is sklearn's C = 1e4 one (to the optimiser's tolerance, ~0.5% here)
    s = np.r_[np.linspace(0, 1, 10), np.linspace(2, 3, 10)]
    z = np.r_[np.zeros(10), np.ones(10)].astype(int)
    a, b = fit_platt(s, z)
    ra, rb = _sklearn_platt(s, z)
    assert a == pytest.approx(ra, rel=2e-2) and b == pytest.approx(rb, rel=2e-2)


# ------------------------------------------------------------------ features
def _readout(h_image: torch.Tensor, n_tokens: int = 0) -> Readout:
    d = h_image.shape[1]
    g = torch.Generator().manual_seed(3)
    return Readout(h_pre=torch.randn(d, generator=g), h_close=torch.randn(d, generator=g),
                   h_answer=torch.randn(1, d, generator=g), h_image=h_image,
                   h_mid=torch.randn(d, generator=g),
                   token_logprobs=-torch.rand(n_tokens, generator=g),
                   token_entropy=torch.rand(n_tokens, generator=g),
                   answer_index=torch.zeros(0, dtype=torch.long), digit_probs=None)


def test_extract_gives_image_statistics_and_zero_entropy_without_tokens():
    h_image = torch.tensor([[1.0, 2.0, 0.0], [3.0, 6.0, 0.0], [5.0, 1.0, 0.0],
                            [7.0, 3.0, 0.0]])                        # M = 4 tokens, D = 3
    f = extract(_readout(h_image))
    np.testing.assert_allclose(f["img_mean"].numpy(), [4.0, 3.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(f["img_std"].numpy(), h_image.numpy().std(0, ddof=1),
                               rtol=1e-6)
    # an empty response: no answer tokens and no response tokens at all
    assert f["entropy"].shape == (1,) and f["entropy"].tolist() == [0.0]
    assert f["msp"].tolist() == [0.0] and f["mean_logprob"].tolist() == [0.0]
    assert f["mu"].tolist() == [0.5]
    # without answer tokens the entropy is the mean over the whole response
    ro = _readout(h_image, n_tokens=3)
    assert extract(ro)["entropy"].item() == pytest.approx(ro.token_entropy.mean().item())


def test_pre_logits_add_the_psr_offset_and_nothing_without_one():
    h = Heads.new(2)
    h.readers["psr"] = lambda x: x.sum(-1)          # a reader whose logits are row sums
    f = {"h_pre": torch.tensor([[1.0, 2.0], [-0.5, 0.25]])}
    assert pre_logits(h, f).tolist() == [3.0, -0.25]
    h.offsets = {"psr": -0.5}
    assert pre_logits(h, f).tolist() == [2.5, -0.75]


# ------------------------------------------------------------------ readout assembly
SPANS = [(0, 5), (5, 10), (10, 15)]


def _parsed(answer_span: tuple[int, int], close_span: tuple[int, int], tagged: bool) -> Parsed:
    return Parsed(answer="x", think=None, confidence=None, answer_span=answer_span,
                  close_span=close_span, tagged=tagged, well_formed=False)


def test_locate_closing_token_by_hand():
    # tagged, closing tag past the last token: the close falls back to the answer's last token
    assert locate(_parsed((5, 10), (20, 28), True), SPANS, set()) == ([1], 1)
    # untagged: the close span is not used even when it covers a token
    assert locate(_parsed((0, 5), (10, 15), False), SPANS, set()) == ([0], 0)
    # tagged with an empty close span: not used either
    assert locate(_parsed((0, 5), (12, 12), True), SPANS, set()) == ([0], 0)
    # tagged with a real close span: its last token
    assert locate(_parsed((0, 5), (10, 15), True), SPANS, set()) == ([0], 2)


class _Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Identity()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_state_tap_holds_hooks_only_while_entered():
    dec = _Decoder()
    tap = StateTap(SimpleNamespace(get_decoder=lambda: dec), mid_layer=1)
    assert tap.handles == []
    tap.__exit__(None, None, None)                  # exiting an unused tap is harmless
    with tap:
        assert len(tap.handles) == 2
        x = torch.ones(1, 2)
        out = dec(x)
    assert tap.handles == [] and not dec.norm._forward_hooks and \
        not dec.layers[0]._forward_hooks
    torch.testing.assert_close(tap.states["last"][0], out)
    torch.testing.assert_close(tap.states["mid"][0], dec.layers[0](x))
    dec(x)                                          # after exit nothing more is kept
    assert len(tap.states["last"]) == 1
    with tap:                                       # entered again: it keeps appending
        dec(x)
    assert len(tap.states["last"]) == 2 and tap.handles == []


# ------------------------------------------------------------------ metrics
def test_risk_coverage_reads_hard_decisions_as_confidences():
    # a method that only says yes or no (boolean confidence) has a two-point curve, the
    # same as its 0/1 confidences give
    from heads.metrics import risk_coverage

    c = np.array([True, False, True, True, False])
    z = np.array([1, 0, 0, 1, 1])
    cov, risk = risk_coverage(c, z)
    assert cov.tolist() == [0.6, 1.0] and risk == pytest.approx([1 / 3, 2 / 5])
    want = risk_coverage(c.astype(float), z)
    assert np.array_equal(cov, want[0]) and np.array_equal(risk, want[1])


def test_aurc_reads_hard_decisions_as_their_zero_one_confidences():
    from heads.metrics import aurc

    c = np.array([True, False, True, True, False])
    z = np.array([1, 0, 0, 1, 1])
    assert aurc(c, z) == aurc(c.astype(float), z)


def test_float32_confidences_are_read_at_their_exact_values():
    # heads emit float32: a metric of them is the metric of the same numbers in float64
    # (float32(0.9) is just below 0.9, so it is not a confidence of at least 0.9)
    from heads.metrics import METRICS

    rng = np.random.default_rng(0)
    c = np.r_[np.float32(0.9), rng.uniform(size=999)].astype(np.float32)
    z = (rng.uniform(size=1000) < c).astype(int)
    z[0] = 0
    for name, f in METRICS.items():
        assert f(c, z) == f(c.astype(np.float64), z), name


def test_auroc_of_no_items_is_an_error_not_one_class():
    # one class only is NaN (an AUROC is undefined); no items at all is a caller's slip,
    # reported as scikit-learn reports it rather than read as one class
    from heads.metrics import auroc

    assert np.isnan(auroc(np.array([0.2, 0.7]), np.array([1, 1])))
    assert np.isnan(auroc(np.array([0.2, 0.7]), np.array([0, 0])))
    with pytest.raises(ValueError, match="0 sample"):
        auroc(np.array([]), np.array([], int))
