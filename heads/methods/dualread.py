"""DualRead and its branches (docs/method.md §1): PSR, P-State, PER, and their log-odds fusion.

Fitted in this order (registration order): PSR alone; P-State, then frozen; PER's visual
reader on P-State's residual; each branch's temperature on the temperature split; last,
the answer-consistency reader whose hinged log σ(c) joins PER (`consistency_log_prob`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from heads.calibration import fit_temperature, fuse
from heads.modules import PSR_HIDDEN, fit_linear, fit_logistic, fit_mlp, prior_bce
from heads.registry import Features, FitData, Method, ReaderSpec, once

if TYPE_CHECKING:
    from heads.registry import HeadsState as Heads

CAPTURED = "0 (states captured while generating)"
# Answer-flip augmentation (issue 11). Natural errors are few and mostly yes/no, so readers
# fitted on them alone never learn to read the answer. The actor's own responses with a
# flipped answer, replayed teacher-forced (`answer_flip` pass, fitting only), join the
# post-answer readers' training data with label 0. Their total weight is FLIP_WEIGHTS times
# the natural rows' total, so natural data still dominates what the readers learn about the
# base rate; temperatures and the defer split stay natural-only, because they calibrate
# (and certify) against the errors the service will really see, and the flips are not
# drawn from that distribution.
FLIP_PASS = "answer_flip"
# `python -m studies.flip_sweep` (docs/flip-sweep/) measured this on held-out data: readers
# fitted on reader_train, the answer-axis drop on reader_val, natural AUROC/BCE on the
# defer split. Flips in these readers moved DualRead by ≤ 0.19 at a cost in natural AUROC;
# the answer-consistency term (`AnswerConsistency`) moves it far more at none, so the
# natural-error readers are fitted on natural rows only (λ = 0, the sweep's L2 1e-2 row).
FLIP_WEIGHTS = {"state": 0.0, "visual": 0.0}
POST_L2 = 1e-2
FLIP_KEYS = {"h_close": "flip_h_close", "phi": "flip_phi"}
# The answer-consistency reader (`AnswerConsistency`) and its inverse L2 strength.
CONSISTENCY = "consistency"
CONSISTENCY_C = 1.0
# Share of the actor's own (held-out) trajectories the term may lower at all. Chosen among
# 1%, 5% and 10% after looking at 500 easy-VQA test items (a clean protocol would have used
# held-out fitting images only): flipped answers kept a mean term of −5.9 to −8.4 at all
# three, and 1% lowers the fewest of the actor's own answers. Chosen again on easyvqa:dev
# by a rule committed first (`studies.consistency_quantile`, docs/method.md §9): 10%.
CONSISTENCY_QUANTILE = 0.10
# The most the term may take from PER's log-odds (nats). Unbounded, a replay the reader
# finds slightly unlike the actor's own (one 25% think-mask seed) could drop DualRead by
# more than .5; at 4 it moves PER's odds by at most e^4 ≈ 55× and DualRead's log-odds by
# at most 2 (fusion halves it): from .95 to ≥ .72, from .99 to ≥ .93. Flipped answers had
# a mean term of −5.9 to −8.4, so the floor still takes most of what the term took there.
CONSISTENCY_FLOOR = 4.0
PSR_READER = {"psr": ReaderSpec(1, PSR_HIDDEN)}
STATE_READER = {"state": ReaderSpec(1)}
VISUAL_READER = {"visual": ReaderSpec(4)}


# No gradients: a `with` block rather than the decorator, because mutation testing skips
# decorated functions and this is the logic every DualRead score goes through.
def pre_logits(heads: Heads, f: Features) -> torch.Tensor:
    with torch.no_grad():
        return heads.readers["psr"](f["h_pre"]) + heads.offsets.get("psr", 0.0)


def state_logits(heads: Heads, f: Features) -> torch.Tensor:
    with torch.no_grad():
        return heads.readers["state"](f["h_close"])


def post_logits(heads: Heads, f: Features) -> torch.Tensor:
    with torch.no_grad():
        return state_logits(heads, f) + heads.readers["visual"](f["phi"])


def logits(heads: Heads, f: Features) -> dict[str, torch.Tensor]:
    return {"pre": pre_logits(heads, f), "state": state_logits(heads, f),
            "post": post_logits(heads, f)}


def reader_rows(data: FitData, flip_weight: float
                ) -> tuple[Features, torch.Tensor, torch.Tensor]:
    """The post-answer readers' training rows: the reader split's natural items, then (when
    the `answer_flip` pass was collected there) the flipped replay, label 0, of each item the
    actor answered correctly. Only those: flipping a wrong yes/no answer gives the right one.
    Returns features (`h_close`, `phi`), labels and row weights."""
    nat = data.on("reader")
    z = data.y("reader").float()
    feats = {k: nat[k] for k in FLIP_KEYS}
    w = torch.ones(len(z))
    scoped = data.scoped.get("reader", {})
    if "flip_ok" not in scoped or flip_weight <= 0:
        return feats, z, w
    ok = scoped["flip_ok"].bool() & (scoped["z"] == 1)
    n_flip = int(ok.sum())
    if n_flip == 0:
        return feats, z, w
    feats = {k: torch.cat([feats[k], scoped[fk][ok]]) for k, fk in FLIP_KEYS.items()}
    z = torch.cat([z, torch.zeros(n_flip)])
    w = torch.cat([w, torch.full((n_flip,), flip_weight * len(w) / n_flip)])
    return feats, z, w


def natural_intercept(logits: torch.Tensor, z: torch.Tensor) -> float:
    """The b minimising BCE(σ(ℓ + b), z): the root of mean σ(ℓ + b) = mean z, found by
    Brent's method inside [logit(z̄) − max ℓ, logit(z̄) − min ℓ], where it must lie (plain
    Newton from b = 0 diverges when the logits start saturated)."""
    from scipy.optimize import brentq
    from scipy.special import expit

    logits, z = logits.double().flatten().numpy(), z.double().flatten().numpy()
    rate = float(z.mean())
    if not 0 < rate < 1:
        raise ValueError("the natural rows need both right and wrong answers")
    target = math.log(rate / (1 - rate))

    def excess(b: float) -> float:
        return float(np.mean(expit(logits + b))) - rate

    lo, hi = target - float(logits.max()), target - float(logits.min())
    # the root lies in [lo, hi]; when rounding leaves no sign change there (logits equal
    # up to rounding), the bracket end nearer to it is as good as Brent's answer
    if hi - lo < 1e-12 or excess(lo) >= 0:
        return lo
    if excess(hi) <= 0:
        return hi
    return float(brentq(excess, lo, hi, xtol=1e-12))


def fit_post_branch(heads: Heads, data: FitData, name: str, reader: str, key: str,
                    branch_logits: Callable[[Heads, Features], torch.Tensor],
                    residual_of: Callable[[Heads, Features], torch.Tensor] | None = None,
                    flip_weight: float | None = None, l2: float | None = None) -> dict:
    """P-State's and PER's fit: one linear reader (BCE + L2) on `reader_rows` — on the
    residual of `residual_of` when given — then the branch's temperature on the natural
    temperature split. `flip_weight` and `l2` default to FLIP_WEIGHTS[reader] and POST_L2
    (read at call time)."""
    flip_weight = FLIP_WEIGHTS[reader] if flip_weight is None else flip_weight
    l2 = POST_L2 if l2 is None else l2
    feats, z, w = reader_rows(data, flip_weight)
    offset = residual_of(heads, feats) if residual_of is not None else None
    log = fit_linear(heads.readers[reader], feats[key], z, offset=offset, weight=w, l2=l2)
    log.update(flip_weight=flip_weight, l2=l2)
    n = len(data.y("reader"))
    log["flipped_rows"] = len(z) - n
    if len(z) > n:
        # The flips (all label 0) pull the bias down for natural items too, and a
        # temperature cannot remove a shift: refit the intercept on the natural rows alone
        # (the prior correction of case-control sampling); the weights stay as fitted.
        head = heads.readers[reader]
        with torch.no_grad():
            nat = head(feats[key][:n]) + (0.0 if offset is None else offset[:n])
        shift = natural_intercept(nat, z[:n])
        with torch.no_grad():
            head.net[-1].bias += shift
        log["natural_intercept_shift"] = round(shift, 5)
    # `train_bce`/`prior_bce` above are over the weighted natural + flipped rows and before
    # the intercept refit, so they say nothing about natural data. This pair does: natural
    # rows only, after the refit, against predicting their own base rate (in-sample; the
    # held-out comparison is the card's `prior_check`).
    with torch.no_grad():
        nat = heads.readers[reader](feats[key][:n]) + (0.0 if offset is None else offset[:n])
    log["natural_bce"] = round(float(F.binary_cross_entropy_with_logits(
        nat.float(), z[:n].float())), 5)
    log["natural_prior_bce"] = round(prior_bce(float(z[:n].float().mean())), 5)
    heads.temperatures[name] = fit_temperature(
        branch_logits(heads, data.on("temperature")), data.y("temperature"))
    return log


# PSR's and PER's log-odds and the consistency term, each read once per scoring call
# (`once`): the served probabilities and `branch_log_odds` share them
def kept_pre_logits(heads: Heads, f: Features) -> torch.Tensor:
    return once(f, "pre_logits", lambda: pre_logits(heads, f))


def kept_post_logits(heads: Heads, f: Features) -> torch.Tensor:
    return once(f, "post_logits", lambda: post_logits(heads, f))


def kept_consistency(heads: Heads, f: Features) -> torch.Tensor | float:
    return once(f, "consistency", lambda: consistency_log_prob(heads, f))


def p_pre(heads: Heads, f: Features) -> torch.Tensor:
    return once(f, "p_pre", lambda: torch.sigmoid(kept_pre_logits(heads, f).double()
                                                  / heads.temperature("psr")))


def p_post(heads: Heads, f: Features) -> torch.Tensor:
    return once(f, "p_post", lambda: torch.sigmoid(
        kept_post_logits(heads, f).double() / heads.temperature("per")
        + kept_consistency(heads, f)))


def consistency_logits(heads: Heads, f: Features) -> torch.Tensor:
    with torch.no_grad():
        return heads.readers[CONSISTENCY](f["phi"]).double()


def consistency_log_prob(heads: Heads, f: Features) -> torch.Tensor | float:
    """min(0, log σ(c(φ)) − q), added to PER's calibrated log-odds. c tells the actor's own
    trajectories (right or wrong) from answer-flipped ones; q is the CONSISTENCY_QUANTILE
    of log σ(c) over held-out own trajectories (`Heads.offsets["consistency"]`), so the
    term is 0 for all but that share of the actor's own answers and leaves natural
    calibration alone, while an answer the states contradict loses its excess, at most
    CONSISTENCY_FLOOR nats. 0 for heads fitted without the reader."""
    if CONSISTENCY not in heads.readers:
        return 0.0
    q = heads.offsets.get(CONSISTENCY, 0.0)
    return (F.logsigmoid(consistency_logits(heads, f)) - q).clamp(min=-CONSISTENCY_FLOOR,
                                                                   max=0.0)


def consistency_rows(data: FitData, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """φ of the actor's own trajectories (label 1, right or wrong) and of their
    answer-flipped replays (label 0) for the reader items in `split` (a sub-split of the
    reader split, where the `answer_flip` pass was collected)."""
    scoped = data.scoped.get("reader", {})
    if "flip_ok" not in scoped:
        raise ValueError("the answer-consistency reader needs the answer_flip pass on the "
                         "reader split")
    where = {int(i): k for k, i in enumerate(data.splits["reader"].tolist())}
    rows = torch.tensor([where[int(i)] for i in data.splits[split].tolist()], dtype=torch.long)
    ok = scoped["flip_ok"][rows].bool()
    x = torch.cat([data.x("phi", split), scoped["flip_phi"][rows][ok]])
    y = torch.cat([torch.ones(len(rows)), torch.zeros(int(ok.sum()))])
    return x, y


def branch_log_odds(heads: Heads, f: dict[str, torch.Tensor]) -> np.ndarray:
    """[N, 3]: PSR's and PER's log-odds before their temperatures, and the answer-
    consistency term added after PER's (what `heads.recert.dualread_at` needs to rescore)."""
    with torch.inference_mode():
        pre = kept_pre_logits(heads, f).double().reshape(-1)
        post = kept_post_logits(heads, f).double().reshape(-1)
        cons = kept_consistency(heads, f)
        cons = torch.as_tensor(cons, dtype=torch.float64).expand_as(post).reshape(-1)
    return torch.stack([pre, post, cons], 1).numpy()


class PSR(Method):
    name = "psr"
    cost = CAPTURED
    served = True
    ours = True
    readers = PSR_READER

    def fit(self, heads: Heads, data: FitData) -> dict:
        # MLP, class-weighted BCE, early stopping on held-out images; fitted independently
        log = fit_mlp(heads.readers["psr"], data.x("h_pre", "reader_train"),
                      data.y("reader_train"), data.x("h_pre", "reader_val"),
                      data.y("reader_val"), seed=data.seed)
        heads.offsets["psr"] = log["prior_offset"]
        heads.temperatures[self.name] = fit_temperature(
            pre_logits(heads, data.on("temperature")), data.y("temperature"))
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        # a copy: the tensor stays memoised for DualRead's fusion in the same call
        return p_pre(heads, f).numpy().copy()


class PostBranch(Method):
    """P-State and PER: one linear post-answer reader (with answer-flip negatives), then a
    temperature (`fit_post_branch`)."""

    cost = CAPTURED
    ours = True
    fit_passes_on = "reader"
    fit_passes = (FLIP_PASS,)
    reader = ""                 # the reader it fits
    key = ""                    # the feature that reader reads
    branch_logits = staticmethod(state_logits)
    residual_of: Callable[[Heads, Features], torch.Tensor] | None = None

    def __init__(self, flip_weight: float | None = None, l2: float | None = None) -> None:
        # None: the shipped settings (FLIP_WEIGHTS, POST_L2). A study or sweep that needs
        # other settings builds its own instances instead of editing the globals.
        self.flip_weight, self.l2 = flip_weight, l2

    def fit(self, heads: Heads, data: FitData) -> dict:
        return fit_post_branch(heads, data, self.name, self.reader, self.key,
                               self.branch_logits, self.residual_of,
                               flip_weight=self.flip_weight, l2=self.l2)


class PState(PostBranch):
    name = "p_state"
    readers = STATE_READER
    reader, key = "state", "h_close"

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return torch.sigmoid(state_logits(heads, f) / heads.temperature(self.name)
                             ).double().numpy()


class PER(PostBranch):
    """Post-answer branch: P-State (frozen) plus P-Visual fitted on its residual."""

    name = "per"
    served = True
    readers = {**STATE_READER, **VISUAL_READER}
    reader, key = "visual", "phi"
    branch_logits = staticmethod(post_logits)
    residual_of = staticmethod(state_logits)

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return p_post(heads, f).numpy().copy()      # as PSR's


class AnswerConsistency(Method):
    """Whether the answer is one the actor's states support: a linear reader on φ telling
    the actor's own trajectories from the same trajectories with a flipped answer. Its
    log σ(c) joins PER (`p_post`) rather than the natural-error readers: fitted into those,
    flips cost natural AUROC and grounding and still moved DualRead by at most ≈ 0.19
    (docs/flip-sweep), because a temperature fitted on natural data shrinks whatever they
    learn about flips. Its own score, σ(c), is a diagnostic row of `evaluate`."""

    name = "answer_consistency"
    cost = CAPTURED
    ours = True
    predicts_correctness = False     # P(the actor's own answer), not P(right)
    fit_passes_on = "reader"
    fit_passes = (FLIP_PASS,)
    readers = {CONSISTENCY: ReaderSpec(4)}

    def fit(self, heads: Heads, data: FitData) -> dict:
        from sklearn.metrics import roc_auc_score

        x, y = consistency_rows(data, "reader_train")
        if len(y) == 0 or bool((y == 1).all()):
            # no answer here has a flip rule (free-text answers, say): no term, and no
            # unfitted reader left for PER to read
            heads.readers.pop(CONSISTENCY, None)
            return {"skipped": "no answer-flipped trajectories on the reader-train images"}
        # to convergence (the fixed 1000 Adam steps of the natural readers left it weak);
        # classes weighed equally: a flip exists only where the replay parsed
        log = fit_logistic(heads.readers[CONSISTENCY], x, y, CONSISTENCY_C)
        xv, yv = consistency_rows(data, "reader_val")
        own = F.logsigmoid(consistency_logits(heads, {"phi": xv[yv == 1]}))
        # the hinge: held-out own trajectories (the fit never saw these images)
        q = float(torch.quantile(own, CONSISTENCY_QUANTILE)) if len(own) else 0.0
        heads.offsets[CONSISTENCY] = q
        log.update(rows=len(y), flipped_rows=int((y == 0).sum()),
                   quantile=CONSISTENCY_QUANTILE, hinge_log_prob=round(q, 5))
        if len(yv) and 0 < float(yv.mean()) < 1:
            c = consistency_logits(heads, {"phi": xv})
            lp = F.logsigmoid(c)
            log["val_auroc_own_vs_flipped"] = round(float(roc_auc_score(yv.numpy(),
                                                                        c.numpy())), 4)
            log["val_own_mean_log_prob"] = round(float(lp[yv == 1].mean()), 4)
            log["val_flipped_mean_log_prob"] = round(float(lp[yv == 0].mean()), 4)
            log["val_flipped_mean_term"] = round(float(
                (lp[yv == 0] - q).clamp(min=-CONSISTENCY_FLOOR, max=0).mean()), 4)
        return log

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return torch.sigmoid(consistency_logits(heads, f)).numpy()


class DualRead(Method):
    """p_DR = σ(½·logit(p_pre) + ½·logit(p_post)): no weights of its own to fit."""

    name = "dualread"
    cost = CAPTURED
    served = True
    ours = True
    readers = {**PSR_READER, **STATE_READER, **VISUAL_READER}

    def score(self, heads: Heads, f: Features) -> np.ndarray:
        return fuse(p_pre(heads, f), p_post(heads, f)).double().numpy()
