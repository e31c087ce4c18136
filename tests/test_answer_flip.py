"""The answer-flip augmentation of the post-answer readers (issue 11).

A constructed reader split where the actor's own answers always agree with what it saw
(one state coordinate is +1 on every natural item, right or wrong) and a flipped answer
sets it to -1: natural data alone carry no signal there, so only the augmentation can
teach the post branch to read the answer.
"""

import pytest
import torch

from heads import registry
from heads.collect import Collector
from heads.dualread import Heads
from heads.methods.dualread import (
    FLIP_PASS,
    FLIP_WEIGHTS,
    PER,
    POST_L2,
    PState,
    p_post,
    post_logits,
    reader_rows,
    state_logits,
)
from heads.passes import flipped_responses
from heads.registry import FitData
from models.data import COLOURS, SHAPES
from tests.test_collect import StandIn

DIM = 4
SWEPT_WEIGHT = 0.1
AGREE = 1          # the coordinate that says "the answer agrees with the evidence"


def _states(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_close, phi, z) for n natural items: yes/no questions (coordinate 0) carry most
    errors, as on easy-VQA; the agreement coordinate is exactly +1 whatever z is."""
    yes_no = (torch.rand(n, generator=g) < 0.5).float()
    z = (torch.rand(n, generator=g) < 0.98 - 0.2 * yes_no).float()
    h = torch.randn(n, DIM, generator=g)
    h[:, 0] += 2 * yes_no
    h[:, AGREE] = 1.0
    phi = torch.randn(n, 4 * DIM, generator=g)
    phi[:, 0] += 2 * yes_no
    phi[:, AGREE] = 1.0
    return h, phi, z


def _flip(h: torch.Tensor, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, phi = h.clone(), phi.clone()
    h[:, AGREE] = -1.0
    phi[:, AGREE] = -1.0
    return h, phi


def _fit(with_flips: bool) -> Heads:
    data = _data(with_flips)
    torch.manual_seed(0)
    heads = Heads.new(DIM, [PState(), PER()])     # no answer-consistency reader here
    # the augmentation at the weight the sweep once chose (the shipped readers use none:
    # the answer-consistency term carries the answer axis now)
    PState(SWEPT_WEIGHT).fit(heads, data)
    PER(SWEPT_WEIGHT).fit(heads, data)
    return heads


def _data(with_flips: bool) -> FitData:
    g = torch.Generator().manual_seed(0)
    n_reader, n_temp = 400, 300
    h, phi, z = _states(n_reader + n_temp, g)
    splits = {"reader": torch.arange(n_reader),
              "temperature": torch.arange(n_reader, n_reader + n_temp)}
    scoped = {}
    if with_flips:
        fh, fphi = _flip(h[:n_reader], phi[:n_reader])
        ok = torch.ones(n_reader)
        ok[:10] = 0                                  # items with no flip rule are left out
        scoped["reader"] = {"flip_ok": ok, "z": z[:n_reader], "flip_h_close": fh,
                            "flip_phi": fphi}
    return FitData({"h_close": h, "phi": phi}, z, splits, scoped)


def _drop_on_flip(heads: Heads) -> torch.Tensor:
    h, phi, _ = _states(200, torch.Generator().manual_seed(1))
    fh, fphi = _flip(h, phi)
    good = p_post(heads, {"h_close": h, "phi": phi})
    bad = p_post(heads, {"h_close": fh, "phi": fphi})
    return good - bad


def test_augmented_post_branch_scores_a_flipped_answer_lower():
    drop = _drop_on_flip(_fit(with_flips=True))
    assert bool((drop > 0).all())
    assert float(drop.mean()) > 0.2


def test_without_flips_the_post_branch_cannot_see_the_answer():
    # the agreement coordinate is constant in natural data: no gradient ever reaches it
    drop = _drop_on_flip(_fit(with_flips=False))
    assert float(drop.abs().max()) < 1e-9


def test_flips_do_not_shift_natural_predictions():
    # The intercept is refitted on natural rows: at a logistic intercept's optimum the mean
    # prediction equals the mean label (its score equation), whatever the flips pulled.
    g = torch.Generator().manual_seed(0)
    h, phi, z = _states(700, g)
    heads = _fit(with_flips=True)
    nat = {"h_close": h[:400], "phi": phi[:400]}
    for logits in (state_logits(heads, nat), post_logits(heads, nat)):
        assert float(torch.sigmoid(logits).mean()) == pytest.approx(float(z[:400].mean()),
                                                                    abs=1e-4)


def test_reader_rows_weights_flips_to_a_share_of_the_natural_rows():
    g = torch.Generator().manual_seed(0)
    h, phi, z = _states(50, g)
    fh, fphi = _flip(h, phi)
    z = torch.ones(50)
    z[[3, 7]] = 0                  # two wrong answers: their flips may well be right
    ok = torch.zeros(50)
    ok[:22] = 1                    # 22 have a flip rule, 20 of them answered correctly
    data = FitData({"h_close": h, "phi": phi}, z, {"reader": torch.arange(50)},
                   {"reader": {"flip_ok": ok, "z": z, "flip_h_close": fh, "flip_phi": fphi}})
    feats, y, w = reader_rows(data, flip_weight=0.5)
    assert feats["h_close"].shape == (70, DIM) and feats["phi"].shape == (70, 4 * DIM)
    assert y[:50].tolist() == z.tolist() and y[50:].tolist() == [0.0] * 20
    assert w[:50].tolist() == [1.0] * 50
    # 20 flipped rows carry half the natural rows' total weight: 25 / 20 each
    assert w[50:].tolist() == pytest.approx([1.25] * 20)
    kept = [k for k in range(22) if k not in (3, 7)]
    torch.testing.assert_close(feats["h_close"][50:], fh[kept])


@pytest.mark.parametrize("answer", ["yes", "no", *COLOURS, *SHAPES])
def test_flip_never_returns_the_original_answer(answer):
    label_set = ({"yes", "no"} if answer in ("yes", "no")
                 else set(COLOURS) if answer in COLOURS else set(SHAPES))
    head = "<think>I see a red circle. So the answer is it.</think>"
    for key in range(40):
        text = f"{head}<answer>{answer}</answer><confidence>8</confidence>"
        (new,) = flipped_responses([text], [f"item{key}"])
        flipped = new.split("<answer>")[1].split("</answer>")[0]
        assert flipped != answer and flipped in label_set
        # everything but the answer is copied byte for byte
        assert new.replace(f"<answer>{flipped}<", f"<answer>{answer}<") == text


def test_flip_is_none_without_an_answer_tag():
    assert flipped_responses(["I think it is red", "<answer>maybe</answer>"],
                             ["a", "b"]) == [None, None]


def test_flip_pass_is_read_only_while_fitting():
    methods = registry.registered()
    assert FLIP_PASS in registry.fit_passes_for(methods, "reader")
    assert FLIP_PASS not in registry.passes_for(methods)          # evaluate never runs it
    # methods with scoring-time passes drop out of `Heads.score`; these must not
    assert PER.passes == () and PState.passes == ()


@pytest.fixture
def items(tmp_path):
    from PIL import Image

    from models.data import Item
    out = []
    for k in range(10):
        path = tmp_path / f"{k}.png"
        Image.new("RGB", (8, 8), (200, 40, 40) if k % 2 else (20, 20, 200)).save(path)
        out.append(Item(id=f"i{k}", image_path=str(path), question="what color is it?",
                        answer="red", image_id=f"img{k}"))
    return out


def test_flip_pass_is_cached_by_the_collector(items, tmp_path):
    actor = StandIn()
    first, _ = Collector(actor, tmp_path / "cache", batch=4).run(items, passes=(FLIP_PASS,))
    assert actor.calls == 3 * 2                      # 3 chunks x (generate, flipped replay)
    assert first["flip_ok"].tolist() == [1.0] * 10   # "red"/"blue" always have a flip
    actor.fail = True                                # any further actor call fails the test
    second, _ = Collector(actor, tmp_path / "cache", batch=4).run(items, passes=(FLIP_PASS,))
    for k in ("flip_ok", "flip_h_close", "flip_phi"):
        torch.testing.assert_close(second[k], first[k], rtol=0, atol=0)
    # the replayed states are of the flipped text, not the natural one
    assert not torch.equal(first["flip_h_close"], first["h_close"])


# ------------------------------------------------------------------ settings and logs
def test_fit_log_has_natural_bce_after_the_intercept_refit():
    from sklearn.metrics import log_loss

    data = _data(with_flips=True)
    torch.manual_seed(0)
    heads = Heads.new(DIM)
    logs = {"state": PState(SWEPT_WEIGHT).fit(heads, data),
            "post": PER(SWEPT_WEIGHT).fit(heads, data)}
    nat = {k: v[data.splits["reader"]] for k, v in data.feats.items()}
    z = data.y("reader").numpy()
    for name, fn in (("state", state_logits), ("post", post_logits)):
        log = logs[name]
        # correctly answered items past the 10 without a flip rule
        assert log["flipped_rows"] == int(z[10:].sum()) > 300
        p = torch.sigmoid(fn(heads, nat)).double().numpy()    # after the refit, natural rows
        assert log["natural_bce"] == pytest.approx(log_loss(z, p), abs=2e-5)
        assert log["natural_prior_bce"] == pytest.approx(
            log_loss(z, [z.mean()] * len(z)), abs=2e-5)
        assert log["natural_bce"] < log["natural_prior_bce"]


def test_explicit_settings_override_the_shipped_ones():
    from heads.modules import Reader, fit_linear

    data = _data(with_flips=True)
    torch.manual_seed(0)
    heads = Heads.new(DIM)
    log = PState(flip_weight=0.0, l2=0.5).fit(heads, data)
    assert log["flipped_rows"] == 0 and log["l2"] == 0.5 and log["flip_weight"] == 0.0
    # the plain fit on the natural reader rows at that L2
    expected = Reader(DIM)
    fit_linear(expected, data.x("h_close", "reader"), data.y("reader"), l2=0.5)
    torch.testing.assert_close(heads.readers["state"].net[-1].weight, expected.net[-1].weight)
    # without arguments the shipped constants apply, read when fitting
    log = PState().fit(Heads.new(DIM), data)
    assert log["flip_weight"] == FLIP_WEIGHTS["state"] and log["l2"] == POST_L2


def test_consistent_flip_replaces_the_word_everywhere_on_word_boundaries():
    from studies.flip_sweep import consistent_flip

    text = ("<think>A red circle; reddish border. Red is the colour.</think>"
            "<answer>red</answer>")
    assert consistent_flip(text, "red", "blue") == (
        "<think>A blue circle; reddish border. blue is the colour.</think>"
        "<answer>blue</answer>")
    assert consistent_flip("<answer>circle</answer>", "square", "circle") is None


def _row(lam, l2, auroc, drop, bce_state=0.2, bce_per=0.2):
    return {"flip_weight": lam, "l2": l2, "defer_prior_bce": 0.25,
            "defer": {"p_state": {"bce": bce_state}, "per": {"bce": bce_per},
                      "dualread": {"auroc": auroc}},
            "answer_drop": {"dualread": drop}}


def test_sweep_criterion_picks_the_largest_drop_among_admissible_points():
    from studies.flip_sweep import choose

    rows = [_row(0.0, 1e-3, 0.780, 0.00), _row(0.0, 1e-2, 0.790, 0.01),
            _row(0.1, 1e-3, 0.786, 0.05),                  # AUROC within .005 of .790
            _row(0.5, 1e-3, 0.784, 0.20),                  # AUROC too low
            _row(1.0, 1e-2, 0.795, 0.30, bce_per=0.26),    # PER worse than the prior
            _row(0.25, 1e-2, 0.7851, 0.05)]                # same drop, larger λ: loses
    assert (choose(rows)["flip_weight"], choose(rows)["l2"]) == (0.1, 1e-3)
    # nothing admissible but the no-flip fits: the best of them
    assert choose(rows[:2] + rows[3:5])["l2"] == 1e-2
