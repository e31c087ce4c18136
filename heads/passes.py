"""Forward passes beyond the natural generation, each declared once.

A pass turns a chunk of items (and the natural run's metadata) into named feature tensors.
Confidence methods name the passes they read (`Method.passes`); the `Collector` runs the
union of what the chosen methods need, caching each pass in its own shards. The cache key
holds the pass's `version` and a hash of its code, so a changed pass never reuses stale
shards.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

import clients.probes.text as trajectory_text
import heads.features as features_module
import models.canon as canon_module
from heads.features import extract
from models.canon import canon
from models.counterfactuals import black_image


class PassContext(Protocol):
    """What a pass reads from the collector running it (`heads.collect.Collector`, which
    imports this module: a pass never imports the collector)."""

    actor: Any
    kappa: float
    max_new_tokens: int


if TYPE_CHECKING:
    from models.data import Item

    Collector = PassContext   # what the passes' signatures call it


K_SAMPLES = 8
SC_KS = (2, 4, 8)
# Kadavath et al. (2022)'s template, appended after the actor's own full response (the
# proposed answer is the one it just gave), read at the token after "(": "A" = True.
PTRUE_PROMPT = ("\n\nQuestion: {question}\nProposed Answer: {answer}\n"
                "Is the proposed answer:\n (A) True\n (B) False\nThe proposed answer is: (")
PTRUE_YES = ("A", " A", "True", " True")
PTRUE_NO = ("B", " B", "False", " False")
# P(True) is a question the actor must read. Above this many tokens per template word on
# average, its tokenizer never saw these words as words (a vocabulary fitted to its own
# response format spells "Proposed" letter by letter), and the score is a straw man.
PTRUE_MAX_TOKENS_PER_WORD = 2.0


def ptrue_unreadable(tokenizer) -> str | None:
    """Why the actor cannot read the P(True) template, or None when it can: the mean
    number of tokens per template word (each encoded as it stands, after a space)."""
    import re

    words = re.findall(r"[A-Za-z]+", re.sub(r"\{\w+\}", " ", PTRUE_PROMPT))
    counts = [len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in words]
    per_word = sum(counts) / len(counts)
    if per_word <= PTRUE_MAX_TOKENS_PER_WORD:
        return None
    worst = max(zip(counts, words))
    return (f"the actor's tokenizer splits the P(True) template into {per_word:.1f} tokens "
            f"per word (\"{worst[1]}\": {worst[0]}): it cannot read the question as words, "
            "so P(True) would be a straw man")


PassFn = Callable[["Collector", "list[Item]", dict], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Pass:
    """One extra pass: its name, what it computes, and what its cache key depends on."""

    name: str
    run: PassFn
    version: int = 1                 # bump when its outputs change meaning
    helpers: tuple[object, ...] = ()  # code and constants it relies on, hashed into the key

    def code_hash(self) -> str:
        return source_hash(self.run, *self.helpers)


def source_hash(*objs: object) -> str:
    """Short hash of the source of functions/modules; other objects count by their repr."""
    h = hashlib.sha256()
    for obj in objs:
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            h.update(repr(obj).encode())
    return h.hexdigest()[:12]


# ---------------------------------------------------------------- the statistics
def ptrue_text(response: str, question: str, answer: str) -> str:
    """What the P(True) pass feeds after the prompt: the full response, then the template."""
    return response + PTRUE_PROMPT.format(question=question, answer=answer)


def answer_token_sets(tokenizer) -> tuple[list[int], list[int]]:
    """First-token ids of the True and False spellings, made disjoint: a token both sets
    reach (a bare space that starts " A" and " B") says nothing and is dropped."""
    def first(words):
        out = set()
        for w in words:
            enc = tokenizer.encode(w, add_special_tokens=False)
            if enc:
                out.add(enc[0])
        return out
    yes, no = first(PTRUE_YES), first(PTRUE_NO)
    return sorted(yes - no), sorted(no - yes)


def ptrue_from_probs(probs: torch.Tensor, yes: list[int], no: list[int]) -> np.ndarray:
    """P(True) / (P(True) + P(False)) from next-token distributions [B, V]."""
    py, pn = probs[:, yes].sum(-1), probs[:, no].sum(-1)
    return (py / (py + pn).clamp_min(1e-12)).double().numpy()


@torch.no_grad()
def continuation_probs(actor, images, questions, continuations: list[str]) -> torch.Tensor:
    """Next-token distribution after prompt + each continuation (teacher-forced), [B, V]."""
    ids = [actor.tokenizer.encode(t, add_special_tokens=False) for t in continuations]
    batch = actor.encode(images, questions, ids)
    last, _ = actor.forward_states(batch)
    at = torch.tensor([batch.prompt_len + len(r) - 1 for r in ids], device=last.device)
    h = last[torch.arange(len(ids), device=last.device), at]
    return torch.softmax(actor._logits(h), -1).cpu()


def ptrue_probs(actor, images, questions, responses, answers) -> np.ndarray:
    """P(True) read after the actor's own full response and the follow-up template."""
    texts = [ptrue_text(r, q, a) for r, q, a in zip(responses, questions, answers)]
    return ptrue_from_probs(continuation_probs(actor, images, questions, texts),
                            *answer_token_sets(actor.tokenizer))


def agreement(greedy: str, samples: list[str]) -> float:
    """Share of samples whose canonical answer equals the greedy one (invalid disagree)."""
    return float(np.mean([bool(s) and s == greedy for s in samples])) if samples else 0.0


def semantic_entropy(samples: list[str]) -> float:
    """Entropy of canonical-answer clusters, normalised by log K; invalid ones stay apart."""
    labels = [s if s else f"<invalid{k}>" for k, s in enumerate(samples)]
    counts = np.array(list(Counter(labels).values()), float)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(samples))) if len(samples) > 1 else 0.0


# ---------------------------------------------------------------- the passes
def run_black_image(col: Collector, items: list[Item], meta: dict) -> dict[str, torch.Tensor]:
    """Teacher-forced replay of the natural response on a black image (BICR, docs/method.md §7)."""
    imgs = [black_image(it.image().size) for it in items]
    res = col.actor.score(imgs, [it.question for it in items], meta["responses"], cue=False)
    return {"h_close_black": torch.stack([r.readout.h_close for r in res])}


def run_follow_up(col: Collector, items: list[Item], meta: dict) -> dict[str, torch.Tensor]:
    """The P(True) follow-up: one teacher-forced pass on image, question, the actor's full
    response and the template; `ptrue` is the normalised P(True) at the next token."""
    p = ptrue_probs(col.actor, [it.image() for it in items], [it.question for it in items],
                    meta["responses"], meta["answers"])
    return {"ptrue": torch.tensor(p)}


def run_samples(col: Collector, items: list[Item], meta: dict) -> dict[str, torch.Tensor]:
    """K sampled answers at temperature 1. Statistics, not confidences: `sc{k}` is the
    agreement of the first k samples with the greedy answer (k in SC_KS), `semantic` the
    normalised semantic entropy of all K."""
    rows = col.actor.sample([it.image() for it in items], [it.question for it in items],
                            K_SAMPLES, temperature=1.0, max_new_tokens=col.max_new_tokens,
                            seed=0)
    out: dict[str, list[float]] = {f"sc{k}": [] for k in SC_KS}
    out["semantic"] = []
    for greedy, samples in zip(meta["canonical"], rows):
        canon_s = [canon(s.answer) for s in samples]
        for k in SC_KS:
            out[f"sc{k}"].append(agreement(greedy, canon_s[:k]))
        out["semantic"].append(semantic_entropy(canon_s))
    return {k: torch.tensor(v) for k, v in out.items()}


def flipped_responses(responses: list[str], keys: list[str]) -> list[str | None]:
    """Each response with its answer replaced by a wrong one of the same type (yes↔no,
    another colour or shape: the TGS probe's answer-axis rule); None where no rule applies."""
    return [trajectory_text.answer_variant(r, k) for r, k in zip(responses, keys)]


def run_answer_flip(col: Collector, items: list[Item], meta: dict) -> dict[str, torch.Tensor]:
    """Negatives for the post-answer readers, read at fit time only: the actor's own response
    with a flipped answer, replayed teacher-forced. `flip_ok` marks the items that had a
    flip; the others replay their own response unchanged (keeps the shard rectangular) and
    must not be used."""
    flips = flipped_responses(meta["responses"], [it.id for it in items])
    texts = [f if f is not None else r for f, r in zip(flips, meta["responses"])]
    res = col.actor.score([it.image() for it in items], [it.question for it in items], texts)
    feats = [extract(r.readout, col.kappa) for r in res]
    return {"flip_ok": torch.tensor([float(f is not None) for f in flips]),
            "flip_h_close": torch.stack([f["h_close"] for f in feats]),
            "flip_phi": torch.stack([f["phi"] for f in feats])}


PASSES: dict[str, Pass] = {}
# names older callers used for `Collector.run(extras=...)`
LEGACY_NAMES = {"bicr": "black_image", "ptrue": "follow_up"}


def register_pass(p: Pass) -> Pass:
    if p.name in PASSES and PASSES[p.name] is not p:
        raise ValueError(f"a pass named {p.name!r} is already registered")
    PASSES[p.name] = p
    return p


def unregister_pass(name: str) -> None:
    PASSES.pop(name, None)


def resolve(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Canonical pass names, in first-seen order; unknown names are a clear error."""
    out: list[str] = []
    for n in names:
        n = LEGACY_NAMES.get(n, n)
        if n not in PASSES:
            raise ValueError(f"unknown pass {n!r}; known: {', '.join(PASSES)}")
        if n not in out:
            out.append(n)
    return tuple(out)


register_pass(Pass("black_image", run_black_image, helpers=(black_image,)))
register_pass(Pass("follow_up", run_follow_up, version=2,
                   helpers=(ptrue_probs, ptrue_text, answer_token_sets, ptrue_from_probs,
                            continuation_probs, PTRUE_PROMPT, PTRUE_YES, PTRUE_NO)))
register_pass(Pass("answer_flip", run_answer_flip,
                   helpers=(flipped_responses, trajectory_text, features_module)))
register_pass(Pass("samples", run_samples,
                   helpers=(agreement, semantic_entropy, canon_module, K_SAMPLES, SC_KS)))
