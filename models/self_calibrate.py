"""Self-calibration of the verbalized confidence, supervised on the actor's own answers.

GRPO with the RLCR-style Brier reward did not spread μ(C) on the embedded actor (README:
eight continuations): the sampled digit gets one noisy scalar per completion, and with
~93% of groups all correct the digit drifts to a constant. This stage minimises the same
Brier score exactly instead. The actor answers training questions greedily; each answer
is marked right or wrong; with that response teacher-forced, the loss is

    (μ(C) − z)²  −  λ · log P(next token is a digit)  +  w · CE(the response's other tokens)

where μ(C) = Σ_c P(C = c | digits) · c/10 at the confidence cue (docs/method.md §3, the readout the
service reports), z the correctness. The second term keeps a digit the likely next token
(without it greedy decoding stopped writing one); the third is self-distillation on the
actor's own greedy text, so its answers stay where they were — a share of each batch
being its own answers on flat gray images, as in the SFT's modality dropout. Only the
actor's training split is used (`easyvqa:actor`); a share of it is kept out to report a
validation AUROC.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.progress import Progress

from models.batching import FLAT_LEVELS, right_padded
from models.canon import is_correct
from models.data import Item

console = Console(stderr=True)


@dataclass(frozen=True)
class SelfCalibration:
    answers: int = 8000          # own answers trained on
    validation: int = 1000       # own answers kept out (validation AUROC in the log)
    steps: int = 900
    batch: int = 32
    lr: float = 1e-4             # AdamW, cosine to 0
    digit_mass: float = 0.1      # λ
    self_distill: float = 1.0    # w
    blank_answers: int = 2000    # own answers on flat gray images (self-distillation only)
    blank_share: float = 0.15    # of each batch, as in the SFT's modality dropout
    seed: int = 0


SMOKE_SELF = SelfCalibration(answers=16, validation=8, steps=3, batch=4, blank_answers=4,
                             blank_share=0.25)


@dataclass
class Example:
    item: Item
    response: list[int]          # the actor's greedy response ids (EOS included)
    correct: bool
    blank: int | None = None     # gray level of the flat image shown instead, if any


def flat_image(level: int) -> Image.Image:
    return Image.new("RGB", (224, 224), (level, level, level))


def own_answers(actor, items: list[Item], blank: list[int | None] | None = None,
                batch: int = 64) -> list[Example]:
    """Greedy answers of `actor` to `items`, marked right or wrong; where `blank` gives a
    gray level, the question is asked of a flat image of that level instead."""
    blank = blank or [None] * len(items)
    out = []
    with Progress(transient=True, console=console) as bar:
        task = bar.add_task("own answers", total=len(items))
        for s in range(0, len(items), batch):
            chunk, levels = items[s: s + batch], blank[s: s + batch]
            res = actor.answer([it.image() if lv is None else flat_image(lv)
                                for it, lv in zip(chunk, levels)],
                               [it.question for it in chunk], 64, readout="none")
            out += [Example(it, list(r.token_ids),
                            bool(is_correct(r.answer, it.answer, it.options or None)), lv)
                    for it, r, lv in zip(chunk, res, levels)]
            bar.advance(task, len(chunk))
    return out


class Batches:
    """Teacher-forced batches of own answers: model inputs, the labels of the
    self-distillation term, the position whose next token is the digit, correctness."""

    def __init__(self, actor) -> None:
        self.actor = actor
        tok = actor.tokenizer
        self.cue = tok.convert_tokens_to_ids("<confidence>")
        self.digits = torch.tensor([tok.convert_tokens_to_ids(str(c)) for c in range(11)])
        self.pixels: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prompts: dict[tuple[str, int], list[int]] = {}

    def _pixels(self, ex: Example) -> tuple[torch.Tensor, torch.Tensor]:
        key = ex.item.image_id if ex.blank is None else f"flat-{ex.blank}"
        if key not in self.pixels:
            img = ex.item.image() if ex.blank is None else flat_image(ex.blank)
            enc = self.actor.processor.image_processor(images=[img], return_tensors="pt")
            self.pixels[key] = (enc["pixel_values"], enc["image_grid_thw"])
        return self.pixels[key]

    def _prompt(self, question: str, n_image: int) -> list[int]:
        key = (question, n_image)
        if key not in self.prompts:
            text = self.actor.prompt_text(question).replace(
                "<|image_pad|>", "<|image_pad|>" * n_image)
            self.prompts[key] = self.actor.tokenizer.encode(text, add_special_tokens=False)
        return self.prompts[key]

    def __call__(self, rows: list[Example]) -> tuple[dict, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
        seqs, labels, pix, grids, cue_at = [], [], [], [], []
        for ex in rows:
            p, g = self._pixels(ex)
            merge = self.actor.processor.image_processor.merge_size ** 2
            prompt = self._prompt(ex.item.question, int(g.prod()) // merge)
            seq = prompt + ex.response
            lab = [-100] * len(prompt) + list(ex.response)
            k = len(prompt) + ex.response.index(self.cue) if self.cue in ex.response else -1
            if 0 <= k < len(seq) - 1:
                lab[k + 1] = -100            # the digit is the Brier term's, not the CE's
            seqs.append(seq)
            labels.append(lab)
            pix.append(p)
            grids.append(g)
            # blank-image answers are self-distilled only: no Brier term on them
            cue_at.append(k if 0 <= k < len(seq) - 1 and ex.blank is None else -1)
        ids, lab, mask = right_padded(seqs, labels, self.actor.tokenizer.pad_token_id)
        inputs = {"input_ids": ids, "attention_mask": mask,
                  self.actor.family.type_ids_key: (ids == self.actor.image_token_id).long(),
                  "pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grids)}
        z = torch.tensor([float(ex.correct) for ex in rows])
        return inputs, lab, torch.tensor(cue_at), z


def digit_terms(logits: torch.Tensor, cue_at: torch.Tensor, digits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """μ(C) and log P(any digit) at each row's cue (rows without one are dropped), and
    the mask of kept rows."""
    keep = cue_at >= 0
    at = logits[torch.arange(len(cue_at))[keep], cue_at[keep]].float()      # [n, V]
    dl = at[:, digits]
    mu = (torch.softmax(dl, -1) * torch.arange(11.0, device=at.device) / 10).sum(-1)
    log_mass = torch.logsumexp(dl, -1) - torch.logsumexp(at, -1)
    return mu, log_mass, keep


def loss_of(model, batches: Batches, rows: list[Example], cfg: SelfCalibration
            ) -> tuple[torch.Tensor, dict]:
    inputs, lab, cue_at, z = batches(rows)
    logits = model(**inputs).logits
    mu, log_mass, keep = digit_terms(logits, cue_at, batches.digits)
    brier = ((mu - z[keep]) ** 2).mean() if keep.any() else logits.sum() * 0
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), lab[:, 1:].reshape(-1),
        ignore_index=-100)
    mass = log_mass.mean() if keep.any() else logits.sum() * 0
    loss = brier - cfg.digit_mass * mass + cfg.self_distill * ce
    return loss, {"brier": brier.item(), "log_digit_mass": mass.item(), "ce": ce.item()}


@torch.no_grad()
def validation_auroc(model, batches: Batches, rows: list[Example], batch: int = 64
                     ) -> dict:
    """AUROC of μ(C) for correctness on kept-out own answers, and μ's mean and spread."""
    from sklearn.metrics import roc_auc_score

    was = model.training
    model.eval()
    mus, zs = [], []
    for s in range(0, len(rows), batch):
        inputs, _, cue_at, z = batches(rows[s: s + batch])
        mu, _, keep = digit_terms(model(**inputs).logits, cue_at, batches.digits)
        mus += mu.tolist()
        zs += z[keep].tolist()
    model.train(was)
    auroc = float(roc_auc_score(zs, mus)) if len(set(zs)) == 2 else None
    return {"val_mu_auroc": None if auroc is None else round(auroc, 4),
            "val_mu_mean": round(float(np.mean(mus)), 4) if mus else None,
            "val_mu_std": round(float(np.std(mus)), 4) if mus else None}


def self_calibrate(actor, items: list[Item], cfg: SelfCalibration, log: list[dict]) -> None:
    """Train `actor.model` in place (see the module docstring); logs go to `log`."""
    rng = random.Random(cfg.seed)
    pool = rng.sample(items, min(len(items), cfg.answers + cfg.validation))
    t0 = time.time()
    examples = own_answers(actor, pool)
    train, val = examples[: cfg.answers], examples[cfg.answers:]
    # Flat images with the actor's own text-prior answers keep what the SFT's modality
    # dropout taught (without them 13% of blank-image answers lost their format).
    flat = rng.sample(train, min(len(train), cfg.blank_answers))
    blanks = own_answers(actor, [e.item for e in flat],
                         [rng.choice(FLAT_LEVELS) for _ in flat]) if flat else []
    acc = float(np.mean([e.correct for e in train])) if train else float("nan")
    log.append({"stage": "own_answers", "n": len(train), "n_validation": len(val),
                "n_blank": len(blanks), "accuracy": round(acc, 4),
                "elapsed_s": round(time.time() - t0, 1)})
    batches = Batches(actor)
    model = actor.model
    model.requires_grad_(True)
    model.train()
    try:
        _train(model, batches, train, blanks, val, cfg, rng, log, t0)
    finally:        # a failed run must not leave a served actor in training mode
        model.eval()
        model.requires_grad_(False)


def _train(model, batches: Batches, train: list[Example], blanks: list[Example],
           val: list[Example], cfg: SelfCalibration, rng: random.Random, log: list[dict],
           t0: float) -> None:
    if val:
        log.append({"stage": "self_calibration", "step": 0,
                    **validation_auroc(model, batches, val)})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                            weight_decay=0.0)
    with Progress(transient=True, console=console) as bar:
        task = bar.add_task("self-calibration", total=cfg.steps)
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            n_blank = round(cfg.batch * cfg.blank_share) if blanks else 0
            rows = rng.sample(train, min(cfg.batch - n_blank, len(train))) + \
                rng.sample(blanks, min(n_blank, len(blanks)))
            loss, parts = loss_of(model, batches, rows, cfg)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.advance(task)
            last = step == cfg.steps - 1
            check = bool(val) and ((step + 1) % 300 == 0 or last)
            if step % 100 == 0 or check or last:
                rec = {"stage": "self_calibration", "step": step + 1,
                       **{k: round(v, 4) for k, v in parts.items()},
                       "elapsed_s": round(time.time() - t0, 1)}
                if check:
                    rec.update(validation_auroc(model, batches, val))
                log.append(rec)
                console.log(rec)
