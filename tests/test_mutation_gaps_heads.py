"""The heads artefact and the small views around it, where mutation testing found no test:
the card's fields, loading cards that lack optional fields, the attribute views
(temperatures, readers, Platt keys, τ) and their error messages.

Expectations are written out by hand here (the card as JSON, the defaults docs/method.md states).
"""

from __future__ import annotations

import copy
import json
import math
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from heads.defer import DEFER_ALL_TAU, DeferPolicy
from heads.dualread import (
    CARD_VERSION,
    EMBEDDED_HEADS,
    FingerprintMismatch,
    Heads,
    canonical_platt_keys,
    threshold_of,
    with_legacy_platt_keys,
)
from tests.helpers import drop_fingerprint_scheme

POLICY = DeferPolicy(tau=0.625, target_risk=0.1, delta=0.05, coverage=0.5, empirical_risk=0.04,
                     risk_upper_bound=0.09, n_calibration=40, feasible=True)


def _heads(dim: int = 3) -> Heads:
    torch.manual_seed(0)
    h = Heads.new(dim)
    h.temperatures = {"psr": 1.5, "per": 0.75}
    h.platt_maps = {"sc_2": (2.0, -0.5)}
    h.offsets = {"psr": -0.25}
    h.policy = POLICY
    h.kappa = 0.3
    h.actor_fingerprint = "fp1"
    return h


# ------------------------------------------------------------------ the card
def test_saved_card_fields_by_hand(tmp_path):
    from heads.features import FEATURE_SCHEMA
    from models.loading import FINGERPRINT_SCHEME

    h = _heads()
    folder = tmp_path / "a" / "b"                 # parents are created
    # the caller's fields are kept; the artefact's own fields win over stale ones
    h.save(folder, {"command": "test", "kappa": 99, "feature_dim": 0})
    card = json.loads((folder / "heads_card.json").read_text())
    assert card["command"] == "test"
    assert card["card_version"] == CARD_VERSION
    assert card["actor_fingerprint"] == "fp1"
    assert card["fingerprint_scheme"] == FINGERPRINT_SCHEME
    assert card["feature_dim"] == 3 and card["feature_schema"] == FEATURE_SCHEMA
    assert card["kappa"] == 0.3
    assert card["temperatures"] == {"psr": 1.5, "per": 0.75}
    assert card["platt"] == {"sc_2": [2.0, -0.5]}
    assert card["prior_offsets"] == {"psr": -0.25}
    assert card["defer"] == {"tau": 0.625, "target_risk": 0.1, "delta": 0.05, "coverage": 0.5,
                             "empirical_risk": 0.04, "risk_upper_bound": 0.09,
                             "n_calibration": 40, "feasible": True}
    # every method whose readers the artefact holds, the DualRead family among them
    assert {"psr", "p_state", "per", "dualread", "saplma"} <= set(card["methods"])
    assert h.card == card
    # saved again into the same folder: overwritten, not refused
    h.policy = None
    h.save(folder, {})
    assert json.loads((folder / "heads_card.json").read_text())["defer"] is None


def test_load_round_trip_of_every_field(tmp_path):
    h = _heads()
    h.save(tmp_path, {"command": "test"})
    back = Heads.load(tmp_path)                  # no fingerprint given: no check
    assert back.temperatures == {"psr": 1.5, "per": 0.75}
    assert back.platt_maps == {"sc_2": (2.0, -0.5)}
    assert back.offsets == {"psr": -0.25}
    assert back.policy == POLICY and back.kappa == 0.3 and back.dim == 3
    assert back.actor_fingerprint == "fp1"
    assert back.card == json.loads((tmp_path / "heads_card.json").read_text())
    assert set(back.readers) == set(h.readers)
    for name, reader in back.readers.items():
        assert not reader.training, name          # loaded for inference (dropout off)
        for k, v in reader.state_dict().items():
            torch.testing.assert_close(v, h.readers[name].state_dict()[k], rtol=0, atol=0)


def test_a_card_without_optional_fields_loads_with_the_defaults(tmp_path):
    """The oldest cards carry only the fingerprint and the feature width."""
    h = Heads.new(2)
    tensors = {f"state.{k}": v for k, v in h.state.state_dict().items()}
    save_file(tensors, str(tmp_path / "heads.safetensors"))
    (tmp_path / "heads_card.json").write_text(json.dumps(
        {"actor_fingerprint": "old", "feature_dim": 2}))
    back = Heads.load(tmp_path)
    assert set(back.readers) == {"state"}         # what the file holds, nothing more
    assert back.temperatures == {} and back.platt_maps == {} and back.offsets == {}
    assert back.policy is None and back.kappa == 0.1      # docs/method.md §1's κ
    assert back.temperature("p_state") == 1.0 and back.t_state == 1.0
    assert back.defer_threshold == DEFER_ALL_TAU and back.defer(0.99)


def test_missing_folder_and_wrong_actor_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected heads_card.json"):
        Heads.load(tmp_path)
    _heads().save(tmp_path, {})
    with pytest.raises(FingerprintMismatch, match="not for the loaded actor other"):
        Heads.load(tmp_path, "other")
    assert Heads.load(tmp_path, "fp1").actor_fingerprint == "fp1"


def test_load_without_a_folder_reads_the_embedded_heads():
    card = json.loads((EMBEDDED_HEADS / "heads_card.json").read_text())
    h = Heads.load()
    assert h.card == card and h.actor_fingerprint == card["actor_fingerprint"]


def test_legacy_warning_names_the_fix(tmp_path, monkeypatch):
    import heads.dualread as dualread

    _heads().save(tmp_path, {})
    drop_fingerprint_scheme(tmp_path)
    monkeypatch.setitem(dualread.LEGACY_FINGERPRINTS, "new-fp", "fp1")
    with pytest.warns(UserWarning) as rec:
        Heads.load(tmp_path, "new-fp")
    from models.loading import FINGERPRINT_SCHEME

    assert str(rec[0].message) == (
        f"heads in {tmp_path} predate fingerprint scheme {FINGERPRINT_SCHEME} and today's "
        "feature definitions; refit them with `dualread fit-heads`")


# ------------------------------------------------------------------ attribute views
def test_temperature_views_default_to_one_and_store_plain_floats(tmp_path):
    h = Heads.new(2)
    for view in ("t_pre", "t_post", "t_state", "t_saplma", "t_bicr", "t_msp"):
        assert getattr(h, view) == 1.0, view
    assert h.temperature("anything") == 1.0
    h.t_pre = np.float32(1.25)                    # numpy scalars become JSON-able floats
    assert type(h.temperatures["psr"]) is float and h.temperatures["psr"] == 1.25
    h.save(tmp_path, {})
    assert Heads.t_pre.method == "psr"            # the class attribute is the descriptor


def test_readers_by_attribute_and_copies():
    h = Heads.new(2)
    assert h.visual is h.readers["visual"]
    with pytest.raises(AttributeError, match="no_such_reader"):
        h.no_such_reader  # noqa: B018
    # copying looks attributes up before `readers` exists
    for twin in (copy.deepcopy(h), pickle.loads(pickle.dumps(h))):
        assert set(twin.readers) == set(h.readers)


def test_platt_keys_and_errors():
    maps = {"sc2": (1.0, 0.0), "semantic": [2.0, 1.0], "mean_token_logprob": (3.0, -1.0)}
    canonical = canonical_platt_keys(maps)
    assert canonical == {"sc_2": (1.0, 0.0), "semantic_uncertainty": (2.0, 1.0),
                         "mean_token_logprob": (3.0, -1.0)}
    assert with_legacy_platt_keys(canonical) == {**canonical, "sc2": (1.0, 0.0),
                                                 "semantic": (2.0, 1.0)}
    h = Heads.new(2)
    h.platt = maps
    assert h.platt_maps == canonical
    assert h.platt["semantic"] == (2.0, 1.0) and "sc4" not in h.platt
    assert h.platt_map("nothing", (0.5, 0.5)) == (0.5, 0.5)
    with pytest.raises(KeyError, match="no Platt map for 'nothing'"):
        h.platt_map("nothing")


def test_threshold_of_a_policy():
    assert threshold_of(POLICY) == 0.625
    assert threshold_of(None) == DEFER_ALL_TAU > 1
    h = Heads.new(2)
    assert h.defer_threshold == DEFER_ALL_TAU
    h.policy = POLICY
    assert h.defer_threshold == 0.625
    assert math.isclose(h.defer_threshold, h.policy.tau)


# ------------------------------------------------------------------ saturated probabilities
def test_logit_clamps_so_saturated_branches_fuse_to_finite_values():
    from heads.calibration import fuse, logit

    edge = math.log((1 - 1e-6) / 1e-6)           # logit of the clamp bounds, by hand
    torch.testing.assert_close(logit(torch.tensor([0.0, 1.0])),
                               torch.tensor([-edge, edge], dtype=torch.float64))
    # float64 whatever comes in: float32 log-odds would move confidences near τ
    assert logit(torch.tensor([0.3], dtype=torch.float32)).dtype == torch.float64
    assert logit(0.3).dtype == torch.float64
    one, zero = torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    # a branch saturated each way: the mean log-odds is 0, not inf − inf
    assert fuse(one, zero).item() == pytest.approx(0.5, abs=1e-9)
    assert fuse(one, one).item() == pytest.approx(1 - 1e-6, abs=1e-12)


# ------------------------------------------------------------------ metric edges
def test_metric_edges_by_hand():
    from heads.metrics import aurc, ece

    assert math.isnan(aurc(np.array([]), np.array([])))
    # one item: coverage 1/1, and its risk is whether it is wrong
    assert aurc(np.array([0.7]), np.array([0])) == 1.0
    assert aurc(np.array([0.7]), np.array([1])) == 0.0
    # ECE-15 by default: 0.49 and 0.52 share bin 7 of 15 (accuracy .5, mean .505), but
    # not of 16 (bins 7 and 8: gaps .51 and .52)
    c, z = np.array([0.49, 0.52]), np.array([1, 0])
    assert ece(c, z) == pytest.approx(0.005) and ece(c, z, 16) == pytest.approx(0.515)
    with pytest.raises(ValueError) as err:
        ece(np.array([1.5]), np.array([1]))
    assert str(err.value) == "ece needs confidences in [0, 1] (got values outside, or NaN)"


# ------------------------------------------------------------------ calibration edges
def test_fit_temperature_is_clamped_to_its_stated_range():
    """Separable logits want T → 0, logits of the wrong sign want T → ∞: the fit stops at
    the bounds 0.05 and 100 (a T of 0 or ∞ would make every confidence 0, ½ or 1)."""
    from heads.calibration import fit_temperature

    # small logits: the optimum lies far below 0.05 before the loss flattens out
    small = torch.tensor([0.02, -0.02, 0.01, -0.01])
    assert fit_temperature(small, torch.tensor([1.0, 0.0, 1.0, 0.0])) == 0.05
    # large logits of the wrong sign: far above 100
    large = torch.tensor([50.0, -50.0, 40.0, -40.0])
    assert fit_temperature(large, torch.tensor([0.0, 1.0, 0.0, 1.0])) == 100.0


def test_platt_edges_by_hand():
    from sklearn.linear_model import LogisticRegression

    from heads.calibration import fit_platt, fuse, platt_inverted, platt_log

    assert fit_platt(np.array([]), np.array([])) == (0.0, 0.0)       # no data: p = ½
    # a constant statistic, or one class only: slope 0, which is not "inverted"
    assert not platt_inverted(np.full(6, 0.4), np.array([0, 1, 1, 0, 1, 1]))
    assert not platt_inverted(np.arange(6.0), np.ones(6))
    # the card's record of a map, against sklearn's sign of the slope
    rng = np.random.default_rng(3)
    s = rng.normal(size=300)
    z = (rng.uniform(size=300) < 1 / (1 + np.exp(2 * s))).astype(int)   # ranks backwards
    assert LogisticRegression(C=1e4).fit(s[:, None], z).coef_[0, 0] < 0
    assert platt_log(s, z, (0.1234567, -2.7654321)) == {
        "slope": 0.123457, "intercept": -2.765432, "inverted": True}
    assert platt_log(-s, z, (1.0, 0.0))["inverted"] is False
    # fusion keeps the caller's precision
    p = torch.tensor([0.2, 0.9], dtype=torch.float32)
    assert fuse(p, p).dtype == torch.float32


# ------------------------------------------------------------------ defer search edges
def test_min_kept_at_the_ends_of_the_risk_range():
    from heads.defer import min_kept

    # r = 0: no number of items can show it (the bound 1 − level^(1/k) is never 0)
    assert min_kept(0.0, 0.1) > 10 ** 9 and min_kept(-0.2, 0.1) > 10 ** 9
    # r ≥ 1: any single item passes
    assert min_kept(1.0, 0.1) == 1 and min_kept(1.5, 0.1) == 1


def test_choose_threshold_defaults_and_a_single_candidate():
    from heads.defer import choose_threshold

    c, z = np.linspace(0.01, 1, 100), np.linspace(0.01, 1, 100) > 0.2
    assert choose_threshold(c, z) == choose_threshold(c, z, 0.05, 0.1)
    pol = choose_threshold(c, z)
    assert (pol.target_risk, pol.delta) == (0.05, 0.1)
    # one item, r = δ = ½: one test at level ½; 0 errors of 1 has bound 1 − ½ = ½ ≤ r
    one = choose_threshold(np.array([0.7]), np.array([1]), 0.5, 0.5)
    assert one.feasible and one.tau == 0.7 and one.coverage == 1.0
    assert one.risk_upper_bound == pytest.approx(0.5)


# ------------------------------------------------------------------ the defer rule, intercept
def test_decide_by_hand():
    h = Heads.new(2)
    h.policy = POLICY                                  # τ = 0.625
    assert h.decide(0.6) == (True, None) and h.decide(0.7) == (False, None)
    assert h.decide(0.7, problem="truncated") == (True, "truncated")
    assert h.decide(0.7, novelty_p=0.001) == (False, None)      # no detector: p ignored
    h.novelty, h.novelty_alpha = object(), 0.05        # only its presence matters here
    novel = "image unlike the fitting data (novelty p < 0.05)"
    assert h.decide(0.7, novelty_p=0.01) == (True, novel)
    assert h.decide(0.7, novelty_p=0.05) == (False, None)       # p < α, strictly
    assert h.decide(0.7, novelty_p=None) == (False, None)
    assert h.decide(0.9, 0.01, "truncated") == (True, "truncated; " + novel)


def test_natural_intercept_matches_the_mean_label():
    from scipy.optimize import brentq

    from heads.methods.dualread import natural_intercept

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, generator=g) * 2
    z = (torch.rand(200, generator=g) < 0.3).double()
    ref = brentq(lambda b: float(torch.sigmoid(logits.double() + b).mean() - z.mean()), -20, 20,
                 xtol=1e-12)
    assert natural_intercept(logits, z) == pytest.approx(ref, abs=1e-8)
    assert natural_intercept(torch.zeros(4), torch.tensor([1.0, 1, 1, 0])) == \
        pytest.approx(math.log(3), abs=1e-9)
    # saturated start (plain Newton from 0 diverged to ~1e12 here): equal logits, so
    # σ(8 + b) = 1/4 exactly
    assert natural_intercept(torch.full((4,), 8.0), torch.tensor([1.0, 0, 0, 0])) == \
        pytest.approx(math.log(1 / 3) - 8, abs=1e-9)
    far = torch.tensor([30.0, 25, -20, 28, 35])
    b = natural_intercept(far, torch.tensor([1.0, 0, 0, 1, 0]))
    assert float(torch.sigmoid(far.double() + b).mean()) == pytest.approx(0.4, abs=1e-9)
    with pytest.raises(ValueError, match="both right and wrong"):
        natural_intercept(torch.zeros(3), torch.ones(3))


def _readout(seed: int, image_tokens: int, answer: list[int]):
    from models.readout import Readout

    g = torch.Generator().manual_seed(seed)

    def h(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, 4, generator=g)

    return Readout(h_pre=h(), h_close=h(), h_answer=h(2), h_image=h(image_tokens), h_mid=h(),
                   token_logprobs=-torch.rand(4, generator=g),
                   token_entropy=torch.rand(4, generator=g),
                   answer_index=torch.tensor(answer, dtype=torch.long), digit_probs=None)


def test_extract_many_of_mixed_image_sizes_is_each_readout_alone():
    """Readouts with different image-token counts (two image sizes in one batch) take the
    one-at-a-time path: every key as each readout alone gives it, at the κ asked for; a
    batch of one size gives [N, 1] sequence scores; a one-token answer has a log-prob."""
    from heads.features import KAPPA, extract_many

    ros = [_readout(0, 3, [1, 2]), _readout(1, 5, [2]), _readout(2, 3, []), _readout(3, 7, [0])]
    kappa = 3 * KAPPA
    many = extract_many(ros, kappa)
    alone = [extract_many([r], kappa) for r in ros]
    assert set(many) == set(alone[0]) and "img_tokens" in many
    for k in many:
        assert many[k].shape[0] == len(ros)
        torch.testing.assert_close(many[k], torch.cat([a[k] for a in alone]), equal_nan=True)
    assert not torch.equal(many["phi"], extract_many(ros)["phi"])       # κ is passed on
    pair = extract_many(ros[:2], kappa)                                 # two sizes
    for k in pair:
        torch.testing.assert_close(pair[k], many[k][:2], equal_nan=True)
    # a one-token answer: msp is that token's probability (0 is kept for no answer span)
    assert alone[1]["msp"].item() == pytest.approx(math.exp(ros[1].token_logprobs[2].item()))
    assert alone[2]["msp"].item() == 0
    two = extract_many([ros[0], ros[2]])
    for k in ("msp", "mean_logprob", "entropy", "mu"):
        assert two[k].shape == (2, 1), k
    with pytest.raises(ValueError, match="^no readouts to extract features from$"):
        extract_many([])


class _Reads:
    """A stand-in detector: its reading of each item is built from the features it reads
    (`key`, the sum of its columns), so a test can tell what it was given; it keeps its α."""

    def __init__(self, key: str, image_features: tuple = (), reads_pixels: bool = False,
                 also: str | None = None):
        self.key, self.image_features, self.reads_pixels = key, image_features, reads_pixels
        self.also = also                   # a second feature, added
        self.alphas: list[float] = []

    def read(self, f: dict, alpha: float) -> list:
        from heads.novelty import NoveltyReading

        self.alphas.append(alpha)
        col = f[self.key].reshape(len(f[self.key]), -1).nansum(1)
        if self.also is not None:
            col = col + f[self.also].reshape(len(col), -1).nansum(1)
        return [NoveltyReading(float(v), 0.5, bool(v > 0)) for v in col]


def test_assess_reads_the_detector_on_the_images_and_keeps_the_branch_log_odds(monkeypatch):
    """`assess` gives the detector the image features it asks for (computed from the images
    passed), at the heads' α, and DualRead's branch log-odds; `novelty=False` and
    `confidence_batch` read no image and call no detector; `novelty_of` reads one item as
    `assess` does, with the image, with the light features, or with all of them."""
    from PIL import Image

    from heads.features import extract_many
    from heads.methods.dualread import branch_log_odds
    from heads.novelty import IMAGE_FEATURES

    monkeypatch.setitem(IMAGE_FEATURES, "red_share",
                        lambda ims: torch.tensor([[np.asarray(i)[..., 0].mean() / 255 - 0.5]
                                                  for i in ims]))
    h = _heads(4)
    for reader in h.readers.values():
        reader.eval()                            # as loaded heads are: no dropout
    h.novelty_alpha = 0.123
    h.novelty = _Reads("red_share", ("red_share",))
    ros = [_readout(k, 3, [1, 2]) for k in range(3)]
    ims = [Image.new("RGB", (8, 8), (r, 0, 0)) for r in (255, 0, 200)]
    out = h.assess(ros, ims)
    assert [a.novelty.score for a in out] == pytest.approx([0.5, -0.5, 200 / 255 - 0.5])
    assert [a.novelty.novel for a in out] == [True, False, True] and h.novelty.alphas == [0.123]
    lg = branch_log_odds(h, extract_many(ros, h.kappa))
    assert [a.logits for a in out] == [tuple(map(float, row)) for row in lg]
    assert all(set(a.confidence) >= {"dualread", "psr"} for a in out)
    with pytest.raises(ValueError, match="^these heads' novelty detector reads the image "
                                         r"\(a pixel or layout part\): pass each readout's "
                                         "decoded image$"):
        h.assess(ros)
    quiet = h.assess(ros, novelty=False)
    assert [a.novelty for a in quiet] == [None] * 3 and h.novelty.alphas == [0.123]
    assert [a.confidence for a in quiet] == [a.confidence for a in out]
    assert h.confidence_batch(ros) == [a.confidence for a in out]
    assert h.novelty.alphas == [0.123]
    # one item: through the image, the light features (h_pre), or all of them (φ reads κ)
    h.novelty = _Reads("red_share", ("red_share",), reads_pixels=True, also="phi")
    [want] = h.novelty.read(h.with_images(extract_many([ros[2]], h.kappa), ims[2:]), 0.1)
    assert h.novelty_of(ros[2], ims[2]) == want and h.novelty.alphas[-1] == 0.123
    with pytest.raises(ValueError, match="pass each readout's decoded image"):
        h.novelty_of(ros[2])
    for key in ("h_pre", "phi"):
        h.novelty = _Reads(key)
        [want] = h.novelty.read(extract_many([ros[1]], h.kappa), 0.1)
        assert h.novelty_of(ros[1]) == want and h.novelty.alphas[-1] == 0.123
    # without every DualRead reader there are no branch log-odds
    del h.readers["visual"]
    assert h.assess(ros, ims)[0].logits is None
    h.novelty = None
    assert h.novelty_of(ros[0]) is None and h.assess(ros)[0].novelty is None


def test_heads_certified_with_the_retired_image_check_are_refused_and_told_what_to_do(
        tmp_path):
    from heads.dualread import RetiredImageCheck
    from tests.helpers import edit_card

    folder = tmp_path / "heads"
    _heads().save(folder, {})
    want = (f"heads in {folder} were certified with the pixel image check, which this "
            "version no longer runs; serving them without it would apply a defer rule other "
            "than the certified one. Refit the detectors with `dualread fit-detectors` (or "
            "the heads with `dualread fit-heads`), or serve them with an earlier dualread")
    for field, value in (("image_check", {"alpha": 0.01}),
                         ("defer_rule", "dualread < tau or image-check or novelty")):
        edit_card(folder / "heads_card.json", field, value)
        with pytest.raises(RetiredImageCheck) as e:
            Heads.load(folder)
        assert str(e.value) == want
        assert Heads.load(folder, drop_image_check=True).policy == POLICY
        edit_card(folder / "heads_card.json", field, None)
    assert Heads.load(folder).policy == POLICY


def test_a_pixel_part_gets_the_pixel_descriptors_of_the_images(monkeypatch):
    """`with_images` adds the pixel descriptors (`with_pixels` of the features and images)
    only for a detector that asks for them."""
    import heads.pixel_novelty as pixel
    from heads.features import extract_many

    calls = []

    def with_pixels(feats, images):
        calls.append(len(images))
        return {**feats, pixel.PIXEL_FEATURE: torch.full((len(images), 1), 0.25)}

    monkeypatch.setattr(pixel, "with_pixels", with_pixels)
    h = _heads(4)
    h.novelty = _Reads(pixel.PIXEL_FEATURE, (pixel.PIXEL_FEATURE,), also="h_pre")
    ros = [_readout(k, 3, [1]) for k in range(2)]
    out = h.with_images(extract_many(ros, h.kappa), ["a", "b"])
    assert calls == [2] and out[pixel.PIXEL_FEATURE].tolist() == [[0.25], [0.25]]
    assert torch.equal(out["h_pre"], extract_many(ros, h.kappa)["h_pre"])
    from heads.novelty import IMAGE_FEATURES

    # an image feature that is not the pixels: no descriptors computed
    monkeypatch.setitem(IMAGE_FEATURES, "blank", lambda ims: torch.zeros(len(ims), 1))
    h.novelty = _Reads("blank", ("blank",))
    out = h.with_images(extract_many(ros, h.kappa), ["a", "b"])
    assert calls == [2] and pixel.PIXEL_FEATURE not in out and "blank" in out


def test_load_prepares_the_detector_unless_told_not_to(tmp_path, monkeypatch):
    """The detector's scoring caches are built at load by default, so the first request
    costs what later ones do; `prepare=False` leaves them to the first score."""
    import heads.dualread as dualread
    from tests.helpers import edit_card

    class Detector:
        prepared = 0

        def prepare(self) -> Detector:
            Detector.prepared += 1
            return self

    monkeypatch.setattr(dualread, "load_detector", lambda folder: Detector())
    _heads().save(tmp_path, {})
    edit_card(tmp_path / "heads_card.json", "novelty", {"alpha": 0.02})
    assert isinstance(Heads.load(tmp_path).novelty, Detector) and Detector.prepared == 1
    assert Heads.load(tmp_path, prepare=False).novelty_alpha == 0.02
    assert Detector.prepared == 1
