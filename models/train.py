"""Train the embedded actor: a tiny Qwen3-VL on easy-VQA, SFT, GRPO (TRL), self-calibration.

Recipe (measured reasons in the README):
- patch 8 on native 64-px images (16 image tokens after the 2x2 merge), no deepstack;
- SFT on full trajectories, loss on response tokens only, in phases that keep the learning
  rate up: shape word only -> shape + colour words -> everything; cosine decay only in the
  last phase;
- GRPO with TRL (group 8): reward = correctness + format + RLCR-style Brier term on the
  verbalized confidence;
- self-calibration (models/self_calibrate.py): the Brier score of μ(C) on the actor's own
  greedy answers, minimised exactly (GRPO's sampled Brier reward left μ(C) flat).
An image-disjoint slice of train (image id % 5 == 0) is held out for the heads.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from PIL import Image
from rich.console import Console

from models.batching import FLAT_LEVELS, right_padded
from models.canon import canon
from models.data import COLOURS, HEADS_SLICE_MOD, SHAPES, Item, image_number, load, sample
from models.parse import parse_response
from models.trajectory import image_facts, parse_question, trajectory

console = Console(stderr=True)


@dataclass
class Recipe:
    seed: int = 0
    hidden: int = 128
    layers: int = 4
    vision_hidden: int = 64
    vision_depth: int = 2
    patch: int = 8
    image_size: int = 64
    batch: int = 64
    lr: float = 1e-3
    shape_steps: int = 500
    attr_steps: int = 500
    full_steps: int = 1200
    blank_steps: int = 300
    blank_lr: float = 3e-4
    blank_share: float = 0.15
    grpo_steps: int = 150
    grpo_prompts: int = 4          # prompts per GRPO step (x 8 generations)
    grpo_lr: float = 2e-5
    grpo_temperature: float = 1.0
    grpo_group: int = 8            # generations per prompt
    brier_weight: float = 1.0      # weight of the Brier term against correctness (1.0)
    grpo_scale_rewards: str = "group"   # TRL: "group" (std per group), "batch" or "none"
    grpo_save_steps: int = 0       # checkpoint interval, 0 = none (the continuation sets it)
    max_images: int | None = None  # smoke mode: a handful of images
    self_calibration: bool = True  # stage 3: models/self_calibrate.py on the GRPO result


SMOKE = Recipe(hidden=32, layers=1, vision_hidden=16, vision_depth=1, batch=8, shape_steps=3,
               attr_steps=3, full_steps=4, blank_steps=3, grpo_steps=2, grpo_prompts=2,
               max_images=12)


def split_train(items: list[Item]) -> tuple[list[Item], list[Item]]:
    """Actor items and the image-disjoint heads slice (image number % 5 == 0)."""
    actor = [it for it in items if image_number(it) % HEADS_SLICE_MOD != 0]
    heads = [it for it in items if image_number(it) % HEADS_SLICE_MOD == 0]
    return actor, heads


def corpus(items: list[Item]) -> list[str]:
    """The tokenizer's training text: every question, then red-circle trajectories built
    over the growing list itself until there are 20,000 texts. Odd, but it is exactly
    what the shipped tokenizer was trained on, and it covers the whole vocabulary."""
    texts = sorted({it.question for it in items})
    k = 0
    while len(texts) < 20000:
        texts.append(trajectory(COLOURS[0], SHAPES[0], texts[k], confidence=7))
        k += 1
    return texts


class SFTData:
    """Pre-encoded SFT examples: pixel values per image, token ids per text."""

    def __init__(self, actor, items: list[Item], facts: dict[str, tuple[str, str]], seed: int):
        self.actor = actor
        rng = random.Random(seed)
        self.items = [it for it in items if it.image_id in facts]
        tok = actor.tokenizer
        self.pixels: dict[str, torch.Tensor] = {}
        self.grid = None
        for it in self.items:
            if it.image_id not in self.pixels:
                enc = actor.processor.image_processor(images=[it.image()], return_tensors="pt")
                self.pixels[it.image_id] = enc["pixel_values"]
                self.grid = enc["image_grid_thw"]
        self.prompt_ids = {}
        n_img = int(self.grid.prod()) // 4
        for q in sorted({it.question for it in self.items}):
            text = actor.prompt_text(q).replace("<|image_pad|>", "<|image_pad|>" * n_img)
            self.prompt_ids[q] = tok.encode(text, add_special_tokens=False)
        self.examples = []
        colour_ids = {tok.encode(" " + c, add_special_tokens=False)[0] for c in COLOURS}
        shape_ids = {tok.encode(" " + s, add_special_tokens=False)[0] for s in SHAPES}
        for it in self.items:
            c, s = facts[it.image_id]
            # SFT has no notion of correctness yet: a spread of levels gives GRPO room to
            # move the verbalized confidence (its Brier reward does the calibrating).
            conf = rng.randint(5, 10)
            resp = tok.encode(trajectory(c, s, it.question, it.answer, conf),
                              add_special_tokens=False) + [tok.eos_token_id]
            kind = parse_question(it.question).kind
            self.examples.append((it, resp, kind))
        self.colour_ids, self.shape_ids = colour_ids, shape_ids
        self.by_question: dict[str, list[int]] = {}
        for k, (it, _, _) in enumerate(self.examples):
            self.by_question.setdefault(it.question, []).append(k)
        self.flat: dict[int, torch.Tensor] = {}

    def blank_pixels(self, level: int) -> torch.Tensor:
        if level not in self.flat:
            img = Image.new("RGB", (224, 224), (level, level, level))
            self.flat[level] = self.actor.processor.image_processor(
                images=[img], return_tensors="pt")["pixel_values"]
        return self.flat[level]

    def batch(self, idx: list[int], phase: str, blank: list[int] | None = None,
              rng: random.Random | None = None):
        """Examples `idx` with their images; `blank` ones get a flat gray image and the
        response of another training item with the same question (the text prior)."""
        tok = self.actor.tokenizer
        seqs, labels, pix = [], [], []
        todo = [(i, None) for i in idx]
        for i in blank or []:
            q = self.examples[i][0].question
            j = rng.choice(self.by_question[q])
            todo.append((j, self.blank_pixels(rng.choice(FLAT_LEVELS))))
        for i, flat in todo:
            it, resp, _ = self.examples[i]
            p = self.prompt_ids[it.question]
            lab = list(resp)
            if phase != "full":
                # Early phases: loss on the observation's shape (and colour) word only.
                keep = self.shape_ids | (self.colour_ids if phase == "attr" else set())
                first = next((k for k, t in enumerate(resp) if t in keep), None)
                lab = [-100] * len(resp)
                for k, t in enumerate(resp[: (first or 0) + 3]):
                    if t in keep:
                        lab[k] = t
            seqs.append(p + resp)
            labels.append([-100] * len(p) + lab)
            pix.append(self.pixels[it.image_id] if flat is None else flat)
        ids, lab, mask = right_padded(seqs, labels, tok.pad_token_id)
        types = (ids == self.actor.image_token_id).long()
        grid = self.grid.repeat(len(seqs), 1)
        return dict(input_ids=ids, attention_mask=mask, labels=lab, mm_token_type_ids=types,
                    pixel_values=torch.cat(pix), image_grid_thw=grid)


def _steps(model, opt, data: SFTData, phase: str, steps: int, lr_of, rng: random.Random,
           batch: int, log: list[dict], t0: float, blank_share: float = 0.0) -> None:
    everything = list(range(len(data.examples)))
    for k in range(steps):
        lr = lr_of(k)
        for g in opt.param_groups:
            g["lr"] = lr
        n_blank = round(batch * blank_share)
        idx = rng.sample(everything, min(batch - n_blank, len(everything)))
        b = data.batch(idx, "full" if phase == "blank" else phase,
                       blank=[rng.randrange(len(everything)) for _ in range(n_blank)], rng=rng)
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if k % 50 == 0 or k == steps - 1:
            rec = {"stage": "sft", "phase": phase, "step": k + 1, "loss": round(loss.item(), 4),
                   "lr": lr, "elapsed_s": round(time.time() - t0, 1)}
            log.append(rec)
            console.log(rec)


def _adamw(model, lr: float):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)


def sft(actor, data: SFTData, recipe: Recipe, log: list[dict], resume: bool = False,
        checkpoint: Path | None = None) -> None:
    """Phases keep the learning rate up until the last one (a decayed rate makes the model
    forget colour when shape comes first): shape word -> shape + colour words -> all
    tokens (cosine) -> modality dropout (a share of blank images, cosine).

    With `resume`, the model already holds the first three phases' result.
    """
    model = actor.model
    model.train()
    model.requires_grad_(True)
    t0 = time.time()
    if not resume:
        opt = _adamw(model, recipe.lr)
        rng = random.Random(recipe.seed)
        flat = lambda k: recipe.lr  # noqa: E731
        _steps(model, opt, data, "shape", recipe.shape_steps, flat, rng, recipe.batch, log, t0)
        _steps(model, opt, data, "attr", recipe.attr_steps, flat, rng, recipe.batch, log, t0)
        _steps(model, opt, data, "full", recipe.full_steps,
               lambda k: recipe.lr * 0.5 * (1 + math.cos(math.pi * k / recipe.full_steps)),
               rng, recipe.batch, log, t0)
        if checkpoint is not None:
            model.save_pretrained(checkpoint)
            actor.processor.save_pretrained(checkpoint)
            actor.tokenizer.save_pretrained(checkpoint)
    # Modality dropout: a blank or flat image with the trajectory of a random training
    # item of the same question teaches the text prior for images that show nothing,
    # instead of degenerate text. Own optimizer and RNG, so a resumed run is the same.
    opt = _adamw(model, recipe.blank_lr)
    rng = random.Random(recipe.seed + 7)
    _steps(model, opt, data, "blank", recipe.blank_steps,
           lambda k: recipe.blank_lr * 0.5 * (1 + math.cos(math.pi * k / recipe.blank_steps)),
           rng, recipe.batch, log, t0, blank_share=recipe.blank_share)
    model.eval()
    model.requires_grad_(False)


# ---------------------------------------------------------------- GRPO rewards
def _text(completion) -> str:
    if isinstance(completion, list):
        return "".join(m["content"] if isinstance(m["content"], str) else
                       "".join(c.get("text", "") for c in m["content"]) for m in completion)
    return completion


def reward_correct(completions, answer, **_) -> list[float]:
    return [float(bool(canon(parse_response(_text(c)).answer))
                  and canon(parse_response(_text(c)).answer) == canon(a))
            for c, a in zip(completions, answer)]


def reward_format(completions, **_) -> list[float]:
    return [0.2 * float(parse_response(_text(c)).well_formed) for c in completions]


def reward_brier(completions, answer, **_) -> list[float]:
    out = []
    for c, a in zip(completions, answer):
        p = parse_response(_text(c))
        z = float(bool(p.answer) and canon(p.answer) == canon(a))
        out.append(0.0 if p.confidence is None else 1 - (p.confidence / 10 - z) ** 2)
    return out


def grpo(folder: Path, items: list[Item], recipe: Recipe, out: Path, log: list[dict],
         pool_seed: int | None = None, trainer_cls=None, optimizer=None, **config) -> None:
    """Stage 2: TRL GRPOTrainer on the actor saved in `folder`; result saved to `out`.

    Checkpoints go to `<out>/_grpo_tmp` every `grpo_save_steps`; a run that finds one
    there resumes from it (weights, optimizer, RNG and data position). `config` overrides
    GRPOConfig fields; `trainer_cls` replaces GRPOTrainer (a subclass); `optimizer`, if
    given, builds the optimizer from the model (the Trainer's own AdamW otherwise).
    """
    from datasets import Dataset
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    from models.loading import load_actor

    actor = load_actor(folder)
    rng = random.Random(recipe.seed + 1 if pool_seed is None else pool_seed)
    pool = rng.sample(items, min(len(items), recipe.grpo_steps * recipe.grpo_prompts * 2))
    rows = {"prompt": [[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": it.question}]}] for it in pool],
        "image": [it.image() for it in pool], "answer": [it.answer for it in pool]}
    ds = Dataset.from_dict(rows)
    tmp = out / "_grpo_tmp"
    save = recipe.grpo_save_steps > 0
    cfg = dict(
        output_dir=str(tmp), num_generations=recipe.grpo_group,
        per_device_train_batch_size=recipe.grpo_prompts * recipe.grpo_group,
        max_steps=recipe.grpo_steps, learning_rate=recipe.grpo_lr,
        lr_scheduler_type="constant", beta=0.0, max_completion_length=56,
        temperature=recipe.grpo_temperature, use_cpu=True, bf16=False, logging_steps=10,
        save_strategy="steps" if save else "no", save_steps=max(1, recipe.grpo_save_steps),
        save_total_limit=1, report_to=[], seed=recipe.seed, dataloader_num_workers=0,
        disable_tqdm=False, remove_unused_columns=False,
        reward_weights=[1.0, 1.0, recipe.brier_weight],
        scale_rewards=recipe.grpo_scale_rewards)
    actor.model.requires_grad_(True)
    actor.model.train()
    trainer = (trainer_cls or GRPOTrainer)(
        model=actor.model, processing_class=actor.processor,
        reward_funcs=[reward_correct, reward_format, reward_brier],
        args=GRPOConfig(**{**cfg, **config}), train_dataset=ds,
        optimizers=(optimizer(actor.model) if optimizer else None, None))
    last = get_last_checkpoint(str(tmp)) if save and tmp.is_dir() else None
    if last:
        console.log(f"resuming GRPO from {Path(last).name}")
        log.append({"stage": "grpo", "resumed_from_step": int(last.rsplit("-", 1)[-1])})
    trainer.train(resume_from_checkpoint=last)
    for rec in trainer.state.log_history:
        log.append({"stage": "grpo", **{k: v for k, v in rec.items()
                                         if isinstance(v, (int, float))}})
    actor.model.eval()
    actor.model.requires_grad_(False)
    actor.model.save_pretrained(out)
    actor.processor.save_pretrained(out)
    actor.tokenizer.save_pretrained(out)


def train_actor(out: str | Path, recipe: Recipe | None = None, smoke: bool = False,
                command: str = "", resume_sft: str | Path | None = None,
                eval_limit: int | None = None) -> dict:
    """Full recipe: tokenizer + config, SFT, GRPO, evaluation, card. Returns the card.

    `resume_sft` names a folder holding the model after the first three SFT phases
    (written as `<out>/_sft_phases` by an earlier run); training continues from there.
    """
    from models.evaluate import evaluate_actor, git_commit
    from models.loading import load_actor
    from models.tiny import build_tiny_actor

    recipe = recipe or (SMOKE if smoke else Recipe())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    train = load("easyvqa:train")
    actor_items, heads_items = split_train(train)
    facts = image_facts(train)
    if recipe.max_images:
        keep = sorted({it.image_id for it in actor_items if it.image_id in facts})
        keep = set(keep[: recipe.max_images])
        actor_items = [it for it in actor_items if it.image_id in keep]
    sft_dir = out / "_sft"
    if resume_sft:
        import shutil
        shutil.copytree(resume_sft, sft_dir, dirs_exist_ok=True)
    else:
        build_tiny_actor("qwen3_vl", sft_dir, hidden=recipe.hidden, layers=recipe.layers,
                         image_size=recipe.image_size, patch=recipe.patch,
                         vision_hidden=recipe.vision_hidden, vision_depth=recipe.vision_depth,
                         corpus=corpus(train), vocab_size=700, seed=recipe.seed)
    actor = load_actor(sft_dir)
    log: list[dict] = []
    t0 = time.time()
    sft(actor, SFTData(actor, actor_items, facts, recipe.seed), recipe, log,
        resume=bool(resume_sft), checkpoint=out / "_sft_phases")
    actor.model.save_pretrained(sft_dir)
    sft_s = time.time() - t0
    grpo(sft_dir, actor_items, recipe, out, log)
    grpo_s = time.time() - t0 - sft_s
    self_cfg = None
    if recipe.self_calibration:
        from models.self_calibrate import SMOKE_SELF, SelfCalibration, self_calibrate

        self_cfg = replace(SMOKE_SELF if smoke else SelfCalibration(), seed=recipe.seed)
        actor = load_actor(out)
        self_calibrate(actor, actor_items, self_cfg, log)
        actor.model.save_pretrained(out)
    self_s = time.time() - t0 - sft_s - grpo_s
    test = load("easyvqa:test")
    if smoke:
        eval_limit = 32
    test = sample(test, eval_limit)
    metrics = evaluate_actor(load_actor(out), test)
    card = {
        "name": "dualread-embedded-qwen3vl-tiny",
        "architecture": "Qwen3VLForConditionalGeneration",
        "data": "easy-VQA (PyPI easy-vqa 1.0)",
        "splits": {
            "sft_and_grpo": "easyvqa:train, images with id % 5 != 0",
            "heads_holdout": "easyvqa:train, images with id % 5 == 0 (never seen by the actor)",
            "evaluation": "easyvqa:test" + (f" (deterministic sample of {eval_limit})"
                                             if eval_limit else ""),
            "n_actor_items": len(actor_items), "n_heads_items": len(heads_items)},
        "recipe": {**asdict(recipe),
                   "self_calibration_config": asdict(self_cfg) if self_cfg else None},
        "seconds": {"sft": round(sft_s, 1), "grpo": round(grpo_s, 1),
                    "self_calibration": round(self_s, 1)},
        "command": command or f"dualread train-actor --out {out}" + (" --smoke" if smoke else ""),
        "resumed_from_sft_phases": bool(resume_sft),
        "git_commit": git_commit(),
        "response_format": "<think>{observation}. {reasoning}</think><answer>{answer}</answer>"
                           "<confidence>{0..10}</confidence>",
        "metrics": metrics,
        "log": log[-40:],
    }
    (out / "actor_card.json").write_text(json.dumps(card, indent=2))
    import shutil
    shutil.rmtree(sft_dir, ignore_errors=True)
    shutil.rmtree(out / "_grpo_tmp", ignore_errors=True)
    shutil.rmtree(out / "_sft_phases", ignore_errors=True)
    return card
