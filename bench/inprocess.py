"""In-process cost of each way to answer, measured side by side on the same items.

Modes, all on the same images, questions and `max_new_tokens`:
- `plain`: what a user writes with transformers — processor inputs, then
  `model.generate(**inputs, max_new_tokens=N, do_sample=False)` without hidden states,
  then `batch_decode`.
- `answer`: the service's answer alone: `Actor.answer(readout="none")`, the same
  processor inputs and greedy decoding loop as `capture` (`models.decoding`), the response
  parsed, no hidden states kept, no readers. Capture over it is what
  DualRead itself costs; it over `plain` is what the decoding loop saves.
- `capture`: `Service.answer_batch`, what `/answer` runs behind HTTP: `Actor.answer`
  (readout="capture"), one batched call of the readers, novelty and the defer decision,
  shaped into results.
- `replay`: the same with `readout="replay"` (one extra teacher-forced pass).
- `sc8`: eight sampled completions per item at temperature 1 through `Actor.sample`,
  exactly as the evaluation's SC@K runs them (`heads.passes.run_samples`): the K copies
  of every item of a unit are one batched `generate` (K·batch rows), not K calls, with the
  same decoding loop as the service's answers. The greedy answer SC@K also needs is not
  counted.

Modes are interleaved unit by unit (a unit is one item at batch 1, one batch of 8 at
batch 8), their order rotated from unit to unit, so drift in machine load falls on all
modes alike instead of landing in the ratios.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

MODES = ("plain", "answer", "capture", "replay", "sc8")
SC_K = 8


@dataclass
class Timed:
    """Seconds per item of every mode at every unit, and what each unit generated."""

    batch: int
    seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    # process CPU seconds: on a shared CPU they leave out time spent waiting to be scheduled
    cpu_seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    tokens: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    same_tokens: list[bool] = field(default_factory=list)
    readouts: list = field(default_factory=list)
    # seconds per item of `Actor.answer`'s decoding stage (processor inputs + `generate`
    # with the state capture), capture mode, and the same stage of the answer alone (same
    # loop, no capture): their ratio is what keeping the states costs in decoding
    decode_seconds: list[float] = field(default_factory=list)
    answer_decode_seconds: list[float] = field(default_factory=list)
    # seconds per item `Actor.answer` spent after decoding (readout assembly), capture mode
    readout_seconds: list[float] = field(default_factory=list)
    # seconds per item of the rest of `/answer`'s batch besides decoding and the readout:
    # heads, novelty, defer and results; capture mode
    post_seconds: list[float] = field(default_factory=list)
    # which unit (item, or batch of 8) each measurement is of: rounds repeat the units
    unit_ids: list[int] = field(default_factory=list)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_generate(actor, images: Sequence[Image.Image], questions: Sequence[str],
                   max_new_tokens: int) -> list[list[int]]:
    """Greedy `generate` as a transformers user calls it; returns the generated ids."""
    batch = actor.encode(images, questions)      # the processor call, same inputs as answer
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
              actor.family.type_ids_key: batch.type_ids, **batch.vision}
    out = actor.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    gen = out[:, batch.prompt_len:]
    actor.processor.batch_decode(gen, skip_special_tokens=True)
    return [actor._trim(row) for row in gen.tolist()]


def decide_all(heads, readouts: Sequence, images: Sequence | None = None) -> list[bool]:
    """Confidence (one batched call of the readers), novelty and the defer rule for every
    readout, as `Service.answer_batch` runs them. `images`: each readout's image (a pixel
    novelty part reads it)."""
    return [heads.decide(a.confidence["dualread"], a.novelty.p_value if a.novelty else None)[0]
            for a in heads.assess(list(readouts), images)]


def answer_with_dualread(service, images, questions, max_new_tokens: int,
                         readout: str = "capture") -> list:
    """What `/answer` runs for a batch (`Service.answer_batch`, confidence and defer
    included); returns the actor's responses."""
    from app.serving import AnswerItem

    items = [AnswerItem(im, q, max_new_tokens) for im, q in zip(images, questions)]
    res, out = service.answer_responses(items, [math.inf] * len(items), readout)
    failed = [r for r in out if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} item(s) failed: {failed[0]!r}")
    return res


def sample_k(actor, images, questions, max_new_tokens: int, seed: int) -> list:
    return actor.sample(images, questions, SC_K, temperature=1.0,
                        max_new_tokens=max_new_tokens, seed=seed)


def run_modes(service, items: Sequence[tuple[Image.Image, str]], batch: int,
              max_new_tokens: int, repeats: int = 1, keep_readouts: bool = False,
              advance: Callable[[], None] | None = None) -> Timed:
    """Time every mode on every unit of `batch` items, interleaved, `repeats` rounds
    (`service`: an `app.service.Service` over the actor and heads)."""
    actor = service.actor
    dev = actor.device
    units = [items[s: s + batch] for s in range(0, len(items) - batch + 1, batch)]
    if not units:
        raise ValueError(f"need at least {batch} items for batch {batch}")
    out = Timed(batch)
    modes = MODES

    def call(mode: str, imgs, qs, seed: int):
        if mode == "plain":
            return plain_generate(actor, imgs, qs, max_new_tokens)
        if mode == "sc8":
            return sample_k(actor, imgs, qs, max_new_tokens, seed)
        if mode == "answer":      # with the deadline criterion the service passes too
            return actor.answer(imgs, qs, max_new_tokens, readout="none",
                                deadlines=[math.inf] * len(imgs))
        return answer_with_dualread(service, imgs, qs, max_new_tokens, mode)

    # Warm-up: first calls pay for lazy initialisation (kernels, caches, allocator).
    imgs, qs = zip(*units[0])
    for mode in modes:
        call(mode, list(imgs), list(qs), 0)
    n = 0
    for rep in range(repeats):
        for unit_id, unit in enumerate(units):
            imgs, qs = [it[0] for it in unit], [it[1] for it in unit]
            order = modes[n % len(modes):] + modes[: n % len(modes)]
            got = {}
            for mode in order:
                sync(dev)
                t, c = time.perf_counter(), time.process_time()
                got[mode] = call(mode, imgs, qs, seed=n)
                sync(dev)
                out.seconds[mode].append((time.perf_counter() - t) / batch)
                out.cpu_seconds[mode].append((time.process_time() - c) / batch)
            plain = got["plain"]
            out.tokens["plain"].append(float(np.mean([len(r) for r in plain])))
            stages = got["capture"].timings
            out.decode_seconds.append(stages.generate / batch)
            if "answer" in got:
                out.answer_decode_seconds.append(got["answer"].timings.generate / batch)
            out.readout_seconds.append(stages.readout / batch)
            out.post_seconds.append(out.seconds["capture"][-1] - (stages.generate
                                                                  + stages.readout) / batch)
            out.unit_ids.append(unit_id)
            for mode in (m for m in ("answer", "capture", "replay") if m in got):
                ids = [r.token_ids for r in got[mode]]
                out.tokens[mode].append(float(np.mean([len(r) for r in ids])))
                out.same_tokens.append(ids == plain)
            out.tokens["sc8"].append(float(np.mean([len(s.token_ids) for row in got["sc8"]
                                                    for s in row])))
            if keep_readouts and rep == 0:
                out.readouts += [r.readout for r in got["capture"]]
            n += 1
            if advance:
                advance()
    return out


# ------------------------------------------------------------------ statistics
def ratio_ci(num: Sequence[float], den: Sequence[float], n_boot: int = 2000,
             seed: int = 0) -> tuple[float, float, float]:
    """median(num) / median(den) and a percentile bootstrap 95% CI.

    `num[i]` and `den[i]` were measured on the same unit, so units are resampled in
    pairs.
    """
    a, b = np.asarray(num, float), np.asarray(den, float)
    point = float(np.median(a) / np.median(b))
    if len(a) < 2:
        return point, point, point
    idx = np.random.default_rng(seed).integers(0, len(a), (n_boot, len(a)))
    boots = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return point, float(lo), float(hi)


def per_unit(values: Sequence[float], unit_ids: Sequence[int]) -> list[float]:
    """One value per unit, the mean over its rounds: rounds of the same items are not
    independent samples, so the bootstrap must resample units, not measurements."""
    if not unit_ids:
        return list(values)
    groups: dict[int, list[float]] = {}
    for v, u in zip(values, unit_ids):
        groups.setdefault(u, []).append(v)
    return [float(np.mean(g)) for g in groups.values()]


def summarise(t: Timed, n_boot: int = 2000) -> dict:
    """The `in_process.bN` block of bench.json (modes that were not run are left out)."""
    measured = [m for m in MODES if t.seconds[m]]
    sec = {m: per_unit(t.seconds[m], t.unit_ids) for m in measured}
    cpu = {m: per_unit(t.cpu_seconds[m], t.unit_ids) for m in measured}
    plain = sec["plain"]
    out: dict = {"batch": t.batch, "units": len(plain), "measurements": len(t.seconds["plain"]),
                 "seconds_per_item": {m: float(np.median(sec[m])) for m in measured},
                 "cpu_seconds_per_item": {m: float(np.median(cpu[m])) for m in measured},
                 "tokens_per_item": {m: float(np.mean(t.tokens[m])) for m in measured},
                 "greedy_tokens_identical": bool(all(t.same_tokens)),
                 "readout_seconds_per_item": float(np.median(t.readout_seconds))
                 if t.readout_seconds else None,
                 "post_seconds_per_item": float(np.median(t.post_seconds))
                 if t.post_seconds else None}
    for m in (m for m in measured if m != "plain"):
        r, lo, hi = ratio_ci(sec[m], plain, n_boot)
        out[f"{m}_ratio"] = r
        out[f"{m}_ratio_ci"] = [lo, hi]
        r, lo, hi = ratio_ci(cpu[m], cpu["plain"], n_boot)
        out[f"{m}_ratio_cpu"] = r
        out[f"{m}_ratio_cpu_ci"] = [lo, hi]
    # cross-check: the median of per-unit ratios (each unit's modes ran back to back)
    for m in ("answer", "capture", "replay"):
        if m in sec:
            out[f"{m}_ratio_paired_median"] = float(np.median(
                np.asarray(sec[m]) / np.asarray(plain)))
    # what DualRead costs on top of the same answer: capture against the answer alone,
    # unit by unit
    for base in (m for m in ("answer",) if m in sec):
        r, lo, hi = ratio_ci(sec["capture"], sec[base], n_boot)
        out[f"capture_over_{base}"] = r
        out[f"capture_over_{base}_ci"] = [lo, hi]
        out[f"capture_over_{base}_paired_median"] = float(np.median(
            np.asarray(sec["capture"]) / np.asarray(sec[base])))
    # capture's decoding stage against the answer alone's, same loop, same units: what
    # decoding with the state capture costs, apart from the work after decoding
    if t.decode_seconds and t.answer_decode_seconds:
        r, lo, hi = ratio_ci(per_unit(t.decode_seconds, t.unit_ids),
                             per_unit(t.answer_decode_seconds, t.unit_ids), n_boot)
        out["decode_ratio"] = r
        out["decode_ratio_ci"] = [lo, hi]
    r, lo, hi = ratio_ci(sec["capture"], sec["sc8"], n_boot)
    out["capture_over_sc8"] = r
    out["capture_over_sc8_ci"] = [lo, hi]
    return out


# ------------------------------------------------------------------ heads alone
def time_heads(heads, readouts: Sequence, rounds: int = 20,
               images: Sequence | None = None) -> dict:
    """Microseconds per item for features + every reader + fusion + novelty + defer.

    Headline: one readout per call (batch 1, the dearest case); `batch8_median_us` is
    the per-item cost when the service scores a batch of 8 in one call. The `cpu_` keys
    are process CPU time: a call that is descheduled mid-way does not count its wait.

    Each call is timed alone and the median is the headline: on a shared CPU a call of
    half a millisecond is often descheduled mid-way, and that wait (in the mean and p90)
    is the machine's, not the heads'.
    """
    if not readouts:
        raise ValueError("no readouts to time the heads on")
    # readout k's image (the readouts are of the items in turn)
    ims = None if not images else [images[k % len(images)] for k in range(len(readouts))]

    def of(s: int, e: int):
        return None if ims is None else ims[s:e]

    for k in range(min(4, len(readouts))):
        decide_all(heads, readouts[k: k + 1], of(k, k + 1))
    calls, cpu, per_item8, cpu8 = [], [], [], []
    groups = [readouts[s: s + 8] for s in range(0, len(readouts) - 7, 8)]
    for _ in range(rounds):
        for k, ro in enumerate(readouts):
            t, c = time.perf_counter(), time.process_time()
            decide_all(heads, [ro], of(k, k + 1))
            calls.append((time.perf_counter() - t) * 1e6)
            cpu.append((time.process_time() - c) * 1e6)
        for j, g in enumerate(groups):
            t, c = time.perf_counter(), time.process_time()
            decide_all(heads, g, of(8 * j, 8 * j + 8))
            per_item8.append((time.perf_counter() - t) * 1e6 / len(g))
            cpu8.append((time.process_time() - c) * 1e6 / len(g))
    return {"median_us": float(np.median(calls)), "mean_us": float(np.mean(calls)),
            "p90_us": float(np.percentile(calls, 90)), "items": len(readouts),
            "calls": len(calls), "cpu_median_us": float(np.median(cpu)),
            "batch8_median_us": float(np.median(per_item8)) if per_item8 else None,
            "batch8_cpu_median_us": float(np.median(cpu8)) if cpu8 else None}
