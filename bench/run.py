"""`dualread bench`: in-process modes, heads alone and HTTP, written to bench.json/.md."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from bench.inprocess import run_modes, summarise, time_heads
from bench.report import markdown, targets


@dataclass(frozen=True)
class Plan:
    items: int = 128
    b1_repeats: int = 2
    b8_repeats: int = 3
    max_new_tokens: int = 64
    http_requests: dict[int, int] = field(default_factory=lambda: {1: 32, 4: 64, 16: 128})
    http: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    image_side: int | None = None    # resize every image to this square (GPU run: 448)
    data: str = "easyvqa:test"


FULL = Plan()
QUICK = Plan(items=16, b1_repeats=1, b8_repeats=2, http_requests={1: 12, 4: 24, 16: 48})
# Sized for one GPU inside 8 minutes: decode steps of a 2B model under eager
# transformers cost tens of ms each, so answers are 16 tokens and HTTP runs are short.
GPU = Plan(items=64, b1_repeats=1, b8_repeats=1, max_new_tokens=16,
           http_requests={1: 16, 4: 32, 16: 64}, device="cuda", dtype="bfloat16",
           threads=None, image_side=448)


def load_items(plan: Plan) -> list[tuple[Image.Image, str]]:
    from models.data import load, sample

    items = sample(load(plan.data), plan.items, seed=1)
    out = []
    for it in items:
        img = it.image()
        if plan.image_side:
            img = img.resize((plan.image_side, plan.image_side), Image.BILINEAR)
        out.append((img, it.question))
    return out


def request_bodies(items: list[tuple[Image.Image, str]], max_new_tokens: int) -> list[bytes]:
    import base64

    bodies = []
    for img, q in items:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        bodies.append(json.dumps({"image": base64.b64encode(buf.getvalue()).decode(),
                                  "question": q, "max_new_tokens": max_new_tokens}).encode())
    return bodies


def in_process(service, items, plan: Plan,
               progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict:
    """The `in_process` block plus the heads timing (on readouts captured at batch 1)."""
    adv = progress("in-process, batch 1", len(items) * plan.b1_repeats) if progress else None
    t1 = run_modes(service, items, 1, plan.max_new_tokens, repeats=plan.b1_repeats,
                   keep_readouts=True, advance=adv)
    units8 = len(items) // 8 * plan.b8_repeats
    adv = progress("in-process, batch 8", units8) if progress else None
    t8 = run_modes(service, items, 8, plan.max_new_tokens, repeats=plan.b8_repeats,
                   advance=adv)
    return {"in_process": {"b1": summarise(t1), "b8": summarise(t8)},
            "heads": time_heads(service.heads, t1.readouts, images=[im for im, _ in items])}


def _rich_progress():
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)


def run_bench(out: str | Path, plan: Plan, actor_dir: str | None = None,
              heads_dir: str | None = None, gpu: bool = False, command: str = "",
              batch_wait_ms: float | None = None) -> dict:
    """Run everything `plan` asks for and write bench.json and bench.md to `out`."""
    from app.service import Service
    from heads.dualread import Heads
    from models.evaluate import git_commit
    from models.loading import load_actor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.time()
    threads_before = torch.get_num_threads()
    if plan.threads:
        torch.set_num_threads(plan.threads)
    scratch = service = None
    if gpu:
        from bench.gpu import build_random_actor, build_random_heads

        scratch = Path(tempfile.mkdtemp(prefix="dualread-bench-"))
        actor_dir = str(build_random_actor(scratch / "actor", plan.device, plan.dtype,
                                           new_tokens=plan.max_new_tokens))
    try:
        actor = load_actor(actor_dir, device=plan.device, dtype=plan.dtype)
        if gpu:
            heads_dir = str(build_random_heads(scratch / "heads", actor_dir, actor.hidden_size))
        heads = Heads.load(heads_dir, actor.fingerprint)
        items = load_items(plan)
        result: dict = {
            "command": command, "git_commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "actor": "random Qwen3-VL-2B-sized actor" if gpu else (
                "embedded actor" if actor_dir is None else f"actor {Path(actor.folder).name}"),
            "actor_fingerprint": actor.fingerprint,
            "device": plan.device, "dtype": plan.dtype,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "items": len(items), "max_new_tokens": plan.max_new_tokens,
            "b1_repeats": plan.b1_repeats, "b8_repeats": plan.b8_repeats,
            "image_size": list(items[0][0].size),
            "gpu_name": torch.cuda.get_device_name(0) if plan.device.startswith("cuda")
            else None}
        with _rich_progress() as bar:
            def progress(label: str, total: int) -> Callable[[], None]:
                task = bar.add_task(label, total=total)
                return lambda: bar.advance(task)

            service = Service.of(actor, heads)
            ip = in_process(service, items, plan, progress)
            result["in_process"] = ip["in_process"]
            result["heads_us"] = ip["heads"]["median_us"]
            result["heads"] = ip["heads"]
            if plan.http:
                result["http"] = run_http(service, items, plan, actor_dir, heads_dir,
                                          batch_wait_ms, progress)
        result["load_before"] = [round(x, 2) for x in load_before]
        result["load_after"] = [round(x, 2) for x in os.getloadavg()]
        result["wall_s"] = round(time.time() - started, 1)
        result["targets"] = targets(result)
        (out / "bench.json").write_text(json.dumps(result, indent=2))
        (out / "bench.md").write_text(markdown(result))
        return result
    finally:
        torch.set_num_threads(threads_before)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def run_http(service, items, plan: Plan, actor_dir: str | None, heads_dir: str | None,
             batch_wait_ms: float | None, progress) -> dict:
    """The HTTP block; the in-process references are measured in the same time window."""
    actor = service.actor
    from app.settings import Settings
    from bench.inprocess import answer_with_dualread, sync
    from clients.bench import http_bench

    def b1(i: int) -> float:
        img, q = items[i % len(items)]
        sync(actor.device)
        t = time.perf_counter()
        answer_with_dualread(service, [img], [q], plan.max_new_tokens)
        sync(actor.device)
        return time.perf_counter() - t

    def b8() -> tuple[int, float]:
        n = min(16, len(items) // 8 * 8)
        sync(actor.device)
        t = time.perf_counter()
        for s in range(0, n, 8):
            imgs, qs = zip(*items[s: s + 8])
            answer_with_dualread(service, list(imgs), list(qs), plan.max_new_tokens)
        sync(actor.device)
        return n, time.perf_counter() - t

    flags = {"actor": actor_dir, "heads": heads_dir, "device": plan.device,
             "dtype": plan.dtype, "batch_wait_ms": batch_wait_ms,
             "max_new_tokens": plan.max_new_tokens}
    batch_size = Settings().max_batch_size         # the server's default micro-batch
    raw = http_bench(request_bodies(items, plan.max_new_tokens), flags, plan.http_requests,
                     plan.threads, batch_size=batch_size, in_process_b1=b1,
                     in_process_b8=b8, progress=progress)
    return http_block(raw, flags, batch_size)


def http_block(raw: dict, flags: dict, batch_size: int) -> dict:
    """The `http` block of bench.json from `clients.bench.http_bench`'s result."""
    http: dict = {}
    for c in ("c1", "c4", "c16"):
        on, off = raw[c]["batching"], raw[c]["no_batching"]
        http[c] = {"rps": on["rps"], "rps_no_batching": off["rps"], "p50_ms": on["p50_ms"],
                   "p95_ms": on["p95_ms"], "p99_ms": on["p99_ms"],
                   "batching": on, "no_batching": off}
    http["in_process_b8_rps"] = raw["c16"]["in_process_b8_rps"]
    http["in_process_b1_ms"] = raw["c1"]["in_process_b1_ms"]
    http["overhead_ms"] = http["c1"]["p50_ms"] - http["in_process_b1_ms"]
    # the same overhead from pairs (request i less item i in process, median), and the
    # part of each request outside the model stages its server reports
    one = raw["c1"]["batching"]
    http["overhead_ms_paired"] = one["paired_overhead_ms"]
    http["paired_requests"] = one["paired_requests"]
    http["outside_model_ms"] = one["outside_model_ms"]
    # The batching server waits up to --batch-wait-ms for company; the other does not.
    http["overhead_ms_no_batching"] = http["c1"]["no_batching"]["p50_ms"] - \
        http["in_process_b1_ms"]
    http["server_flags"] = {k: v for k, v in flags.items() if k not in ("actor", "heads")}
    http["max_batch_size"] = batch_size
    return http


def plan_for(quick: bool, gpu: bool, **overrides) -> Plan:
    base = GPU if gpu else (QUICK if quick else FULL)
    if gpu and quick:
        base = replace(GPU, items=16, http_requests={1: 8, 4: 16, 16: 32})
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
