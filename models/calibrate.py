"""Verbalized-confidence measurements and the calibration continuation of the actor.

`confidence_report` measures what the actor says about itself: the stated digit, the
readout μ(C) (docs/method.md §3) and how well μ(C) ranks correct over wrong answers (AUROC), next to
the accuracy and blank-image numbers of its card. `calibrate_actor`
continues GRPO on an existing actor with the RLCR-style reward and reports with it;
`self_calibrate_actor` runs the self-calibration stage (models.self_calibrate) as the
same kind of continuation, with the same card.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from models.canon import is_correct
from models.data import Item
from models.evaluate import run_items, summarise
from models.self_calibrate import SelfCalibration, self_calibrate
from models.train import grpo, reward_correct, split_train

MU_BINS = tuple(round(0.1 * k, 1) for k in range(11))


def answer_rows(actor, items: list[Item], batch: int = 64) -> list[dict]:
    """Greedy answers with the capture readout: correctness, stated digit and μ(C)."""
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task("real images + μ(C)", total=len(items))
        for s in range(0, len(items), batch):
            chunk = items[s: s + batch]
            res = actor.answer([it.image() for it in chunk], [it.question for it in chunk],
                               64, readout="capture")
            for it, r in zip(chunk, res):
                mu = r.readout.verbalized_mu if r.readout is not None else None
                rows.append({"id": it.id, "type": it.answer_type, "answer": r.answer,
                             "correct": is_correct(r.answer, it.answer, it.options or None),
                             "well_formed": r.parsed.well_formed,
                             "digit": r.parsed.confidence, "mu": mu})
            bar.advance(task, len(chunk))
    return rows


def _auroc(correct: list[bool], score: list[float]) -> float | None:
    from sklearn.metrics import roc_auc_score

    if len(set(correct)) < 2:
        return None
    return round(float(roc_auc_score(np.asarray(correct, int), np.asarray(score))), 4)


def mu_histogram(mus: list[float]) -> dict[str, int]:
    """Counts of μ(C) rounded to the nearest level 0.0, 0.1, ..., 1.0."""
    c = Counter(round(round(m * 10) / 10, 1) for m in mus)
    return {f"{b:.1f}": c.get(b, 0) for b in MU_BINS}


def confidence_summary(rows: list[dict]) -> dict:
    """Digit and μ(C) distributions and their AUROC for correctness (μ missing -> 0.5)."""
    correct = [r["correct"] for r in rows]
    mus = [0.5 if r["mu"] is None else r["mu"] for r in rows]
    digits = [r["digit"] for r in rows]
    stated = [0.5 if d is None else d / 10 for d in digits]
    by_type = defaultdict(lambda: ([], []))
    for r, m in zip(rows, mus):
        by_type[r["type"]][0].append(r["correct"])
        by_type[r["type"]][1].append(m)
    arr = np.asarray(mus)
    ok = np.asarray(correct, bool)
    return {
        "mu_auroc": _auroc(correct, mus),
        "digit_auroc": _auroc(correct, stated),
        "mu_auroc_by_type": {k: _auroc(*v) for k, v in sorted(by_type.items())},
        "mu_mean": round(float(arr.mean()), 4), "mu_std": round(float(arr.std()), 4),
        "mu_quantiles": {q: round(float(np.quantile(arr, float(q))), 4)
                         for q in ("0.05", "0.25", "0.5", "0.75", "0.95")},
        "mu_mean_correct": round(float(arr[ok].mean()), 4) if ok.any() else None,
        "mu_mean_wrong": round(float(arr[~ok].mean()), 4) if (~ok).any() else None,
        "mu_histogram": mu_histogram(mus),
        "digit_histogram": {str(k): v for k, v in sorted(
            Counter("none" if d is None else d for d in digits).items(), key=lambda kv:
            (isinstance(kv[0], str), kv[0]))},
        "brier_mu": round(float(((arr - ok) ** 2).mean()), 4),
    }


def confidence_report(actor, items: list[Item], batch: int = 64) -> dict:
    """Card metrics (accuracy, blank drop, well-formed) plus the verbalized confidence."""
    rows = answer_rows(actor, items, batch)
    real = summarise(rows)
    blank = summarise(run_items(actor, items, blank=True, batch=batch, label="blank images"))
    return {"real": real, "blank": blank,
            "blank_drop": round(real["accuracy"] - blank["accuracy"], 4),
            "chance": {"color": 1 / 8, "shape": 1 / 3},
            "confidence": confidence_summary(rows)}


def split_credit_trainer(brier_weight: float):
    """A GRPOTrainer that credits the confidence digit with the Brier term alone, in
    expectation over the 11 levels.

    Plain GRPO sums correctness and Brier into one advantage for every token. Measured
    consequences (see the README): the Brier differences of all-correct groups (most
    groups) reach the answer tokens as noise, the digit of a wrong answer is pushed down
    whatever its value (the group baseline blames it for the answer), and the digit
    collapses to one level for every input. Here the answer tokens keep the correctness
    + format advantage, the digit's policy-gradient term is dropped, and the loss adds
    W · E_{c~p}[(c/10 − z)²] at the digit position of every sampled trajectory, z its
    correctness: the exact gradient of RLCR's expected Brier reward for the one-step
    digit action, where a sampled digit gives one noisy draw of it.
    """
    from trl import GRPOTrainer

    class SplitCreditGRPO(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            ids, mask = out["completion_ids"], out["completion_mask"]
            tok = self.processing_class.tokenizer
            texts = [tok.decode(r[m.bool()], skip_special_tokens=True)
                     for r, m in zip(ids, mask)]
            z = torch.tensor(reward_correct(texts, [x["answer"] for x in inputs]))
            digit = digit_positions(tok, ids, mask)
            adv = out["advantages"][:, None].repeat(1, ids.shape[1])
            rows = (digit >= 0).nonzero().flatten()
            adv[rows, digit[rows]] = 0.0
            out.update(advantages=adv, digit_pos=digit, digit_z=z)
            return out

        def _compute_loss(self, model, inputs):
            states = []
            norm = model.model.language_model.norm
            hook = norm.register_forward_hook(lambda m, a, o: states.append(o))
            try:
                loss = super()._compute_loss(model, inputs)
            finally:
                hook.remove()
            pos, z = inputs["digit_pos"], inputs["digit_z"]
            rows = (pos >= 0).nonzero().flatten()
            if not len(rows) or not states:
                return loss
            h = torch.cat(states)          # final-layer states over [prompt ; completion]
            at = inputs["prompt_ids"].shape[1] + pos[rows] - 1   # predicts the digit
            tok = self.processing_class.tokenizer
            digit_ids = [tok.convert_tokens_to_ids(str(c)) for c in range(11)]
            w = model.get_output_embeddings().weight[digit_ids]
            p = torch.softmax(h[rows, at] @ w.T, -1)              # P(C=c), renormalised
            levels = torch.arange(11, dtype=p.dtype, device=p.device) / 10
            brier = (p * (levels[None] - z[rows, None].to(p)) ** 2).sum(-1)
            self._metrics["train"]["calib/expected_brier"].append(float(brier.detach().mean()))
            mu = (p * levels).sum(-1).detach()
            for v, name in ((1.0, "right"), (0.0, "wrong")):
                sel = z[rows] == v
                if sel.any():
                    self._metrics["train"][f"calib/mu_{name}"].append(float(mu[sel].mean()))
            return loss + brier_weight * brier.mean()

    return SplitCreditGRPO


class RowScaledAdamW(torch.optim.AdamW):
    """AdamW whose update of some rows of one matrix is scaled by `factor`.

    The verbalized digit is read through 11 rows of the (tied) output embedding. Their
    discriminative direction needs weights of a size the shared rate (kept low so the
    answers do not drift) takes thousands of steps to reach; rows of a tensor cannot sit
    in their own parameter group, so the step is scaled after the fact.
    """

    def __init__(self, params, matrix: torch.Tensor, rows: list[int], factor: float, **kw):
        super().__init__(params, **kw)
        self.matrix, self.rows, self.factor = matrix, torch.tensor(rows), factor

    @torch.no_grad()
    def step(self, closure=None):
        before = self.matrix[self.rows].clone()
        loss = super().step(closure)
        after = self.matrix[self.rows]
        self.matrix[self.rows] = before + self.factor * (after - before)
        return loss


def digit_row_optimizer(lr: float, factor: float, tokenizer):
    """Build a `RowScaledAdamW` for a model: digit rows of the output embedding × factor."""
    rows = [tokenizer.convert_tokens_to_ids(str(c)) for c in range(11)]

    def make(model):
        return RowScaledAdamW(model.parameters(), model.get_output_embeddings().weight, rows,
                              factor, lr=lr, weight_decay=0.0)

    return make


def digit_positions(tok, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Index of the confidence digit in each completion (the token after the first
    `<confidence>`), -1 where there is none."""
    cue = tok.convert_tokens_to_ids("<confidence>")
    digits = {tok.convert_tokens_to_ids(str(c)) for c in range(11)}
    out = torch.full((ids.shape[0],), -1, dtype=torch.long)
    for b in range(ids.shape[0]):
        row = ids[b][mask[b].bool()].tolist()
        k = row.index(cue) + 1 if cue in row else -1
        if 0 < k < len(row) and row[k] in digits:
            out[b] = k
    return out


def hard_pool(actor, items: list[Item], n: int, share: float, seed: int, scan: int
              ) -> tuple[list[Item], dict]:
    """`n` GRPO prompts, a `share` of them items the actor answers wrong (greedy).

    On its own training images the actor errs on ~5% of sampled answers, so most GRPO
    groups are all correct and only teach "say 10"; its misses (repeated if too few)
    give groups where the Brier term rewards a low digit.
    """
    rng = random.Random(seed)
    cand = rng.sample(items, min(len(items), scan))
    rows = run_items(actor, cand, batch=64, label="finding misses")
    wrong = [it for it, r in zip(cand, rows) if not r["correct"]]
    missed = {it.id for it in wrong}
    k = round(share * n) if wrong else 0
    hard = [wrong[i % len(wrong)] for i in range(k)]
    rest = [it for it in items if it.id not in missed]
    easy = rng.sample(rest, min(len(rest), n - k))
    pool = hard + easy
    rng.shuffle(pool)
    return pool, {"scanned": len(cand), "misses": len(wrong), "hard_in_pool": k,
                  "pool": n}


def grpo_options(recipe, split_credit: bool, digit_lr_factor: float, beta: float,
                 tokenizer) -> dict:
    """Keyword arguments for `models.train.grpo` beyond the recipe."""
    extra: dict = {"beta": beta}   # > 0: KL to the parent keeps the answers where they were
    if split_credit:
        # Brier weight 0 in the shared advantage: the digit alone carries it.
        extra.update(trainer_cls=split_credit_trainer(recipe.brier_weight),
                     reward_weights=[1.0, 1.0, 0.0])
    if digit_lr_factor != 1.0:
        extra["optimizer"] = digit_row_optimizer(recipe.grpo_lr, digit_lr_factor, tokenizer)
    return extra


def calibrate_actor(src: str | Path, out: str | Path, recipe, command: str = "",
                    eval_limit: int | None = 1000, smoke: bool = False,
                    threads: int = 1, hard_share: float = 0.0, scan: int = 6000,
                    split_credit: bool = False, digit_lr_factor: float = 1.0,
                    beta: float = 0.0) -> dict:
    """Continue GRPO on the actor in `src` with correctness + format + W·Brier (RLCR) and
    write the new actor, with a card that names its parent, to `out`. Resumable: an
    interrupted run restarts from the last checkpoint under `<out>/_grpo_tmp`.

    `hard_share` > 0 makes that share of the GRPO prompts items the parent answers wrong
    (greedy, found among `scan` training items; see `hard_pool`). `split_credit` credits
    the digit with the Brier term alone (see `split_credit_trainer`); `digit_lr_factor`
    scales the learning rate of the digit rows of the output embedding; `beta` is the KL
    coefficient to the parent (0: none, as in the first GRPO stage)."""
    import shutil

    from models.data import load, sample
    from models.loading import load_actor

    src, out, items = continuation_start(src, out, threads, recipe.seed)
    if recipe.max_images:
        keep = set(sorted({it.image_id for it in items})[: recipe.max_images])
        items = [it for it in items if it.image_id in keep]
    log: list[dict] = []
    t0 = time.time()
    mined = None
    if hard_share > 0:
        n = recipe.grpo_steps * recipe.grpo_prompts * 2
        items, mined = hard_pool(load_actor(src), items, n, hard_share, recipe.seed + 3, scan)
        log.append({"stage": "mine", **mined, "elapsed_s": round(time.time() - t0, 1)})
    extra = grpo_options(recipe, split_credit, digit_lr_factor, beta,
                         load_actor(src).tokenizer)
    # A pool seed apart from the first GRPO stage's, so the continuation sees new prompts.
    grpo(src, items, recipe, out, log, pool_seed=recipe.seed + 2, gradient_checkpointing=False,
         **extra)
    grpo_s = time.time() - t0
    test = sample(load("easyvqa:test"), 32 if smoke else eval_limit)
    metrics = confidence_report(load_actor(out), test)
    card = continuation_card(
        src, out, test, eval_limit, command, metrics, log,
        stage="GRPO continuation: " + (
            "answer tokens get the group-relative correct + 0.2·format advantage, the digit "
            "W·E_p[(c/10 − z)²] (expected Brier)" if split_credit else
            "reward = correct + 0.2·format + W·(1 − (N/10 − z)²) on every token"),
        splits={"grpo": "easyvqa:train, images with id % 5 != 0"},
        recipe={**{k: v for k, v in asdict(recipe).items() if k.startswith("grpo")
                   or k in ("seed", "brier_weight", "max_images")},
                "hard_share": hard_share, "scan": scan if hard_share > 0 else None,
                "split_credit": split_credit, "digit_lr_factor": digit_lr_factor,
                "beta": beta},
        seconds={"grpo": round(grpo_s, 1)}, mined=mined)
    (out / "actor_card.json").write_text(json.dumps(card, indent=2))
    shutil.rmtree(out / "_grpo_tmp", ignore_errors=True)
    return card


def continuation_card(src: Path, out: Path, test: list[Item], eval_limit: int | None,
                      command: str, metrics: dict, log: list[dict], stage: str,
                      splits: dict, recipe: dict, seconds: dict, **extra) -> dict:
    """The card of an actor continued from the one in `src` (its parent is named)."""
    from models.evaluate import git_commit
    from models.loading import fingerprint

    parent_card = src / "actor_card.json"
    parent = json.loads(parent_card.read_text()) if parent_card.exists() else {}
    return {
        "name": parent.get("name", "dualread-actor") + "-calibrated",
        "architecture": parent.get("architecture"),
        "data": parent.get("data"),
        "continued_from": {"folder": str(src), "fingerprint": fingerprint(src),
                           "command": parent.get("command")},
        "stage": stage,
        "splits": {**splits,
                   "evaluation": "easyvqa:test" + (f" (deterministic sample of "
                                                   f"{len(test)})" if eval_limit else "")},
        "recipe": recipe,
        **extra,
        "seconds": {**seconds, "total": round(sum(seconds.values()), 1)},
        "command": command,
        "git_commit": git_commit(),
        "response_format": parent.get("response_format"),
        "metrics": metrics,
        "log": log[-40:],
    }


def continuation_start(src: str | Path, out: str | Path, threads: int, seed: int
                       ) -> tuple[Path, Path, list[Item]]:
    """Checks and set-up shared by the continuations of an actor: a new output folder,
    torch threads and seed; returns the folders and the actor's training items."""
    from models.data import load

    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise ValueError("write the continued actor to a new folder, not over its parent")
    out.mkdir(parents=True, exist_ok=True)
    # One thread by default: on a shared 2-core CPU two threads spun against other jobs
    # (38 s a step vs 1.9 s measured); gradient checkpointing only costs time at this size.
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    items, _ = split_train(load("easyvqa:train"))
    return src, out, items


def self_calibrate_actor(src: str | Path, out: str | Path, cfg: SelfCalibration,
                         command: str = "", eval_limit: int | None = 1000,
                         smoke: bool = False, threads: int = 1) -> dict:
    """Self-calibrate the actor in `src` and write it, with a card naming its parent and
    the μ(C) metrics on easy-VQA test, to `out`."""
    from models.data import load, sample
    from models.loading import load_actor

    src, out, items = continuation_start(src, out, threads, cfg.seed)
    if smoke:
        items = items[:200]
    actor = load_actor(src)
    log: list[dict] = []
    t0 = time.time()
    self_calibrate(actor, items, cfg, log)
    seconds = round(time.time() - t0, 1)
    actor.model.save_pretrained(out)
    # Only the weights changed: the parent's tokenizer, processor and config files are
    # copied as they are (re-saving them rewrites defaults and would change the
    # fingerprint's inputs for nothing).
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "actor_card.json":
            shutil.copy2(f, out / f.name)
    test = sample(load("easyvqa:test"), 32 if smoke else eval_limit)
    metrics = confidence_report(load_actor(out), test)
    card = continuation_card(
        src, out, test, eval_limit, command, metrics, log,
        stage="self-calibration: Brier of μ(C) on the actor's own greedy answers "
              "− λ·log P(digit) + w·CE on the rest of its own response",
        splits={"self_calibration": "easyvqa:train, images with id % 5 != 0 (the actor's "
                                    "own split): greedy answers, a share kept out"},
        recipe=asdict(cfg), seconds={"self_calibration": seconds})
    (out / "actor_card.json").write_text(json.dumps(card, indent=2))
    return card
