"""`dualread bench`: the command. The bench measures the service, so it sits above `app`;
the `dualread` script (dualread.cli) adds this command to app.cli's tree."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from app.cli import ActorOpt, HeadsOpt, console


def bench(
    out: Annotated[Path, typer.Option("--out", help="where bench.json and bench.md go")
                   ] = Path("out/bench"),
    quick: Annotated[bool, typer.Option("--quick", help="fewer items and requests")] = False,
    gpu: Annotated[bool, typer.Option(
        "--gpu", help="CUDA, bf16, a random Qwen3-VL-2B-sized actor, 448x448 images")] = False,
    actor: ActorOpt = None,
    heads: HeadsOpt = None,
    items: Annotated[int | None, typer.Option(
        "--items", help="items (default 128; 16 with --quick, 64 with --gpu)")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="torch threads, in process and in the server (default 1 on CPU)")
                       ] = None,
    http: Annotated[bool, typer.Option("--http/--no-http", help="the HTTP part")] = True,
    batch_wait_ms: Annotated[float | None, typer.Option(
        "--batch-wait-ms", help="passed to the server (default: its own)")] = None,
) -> None:
    """Cost of plain generate vs DualRead (capture, replay) vs SC@8, heads alone, HTTP."""
    from bench import plan_for, run_bench

    if gpu and (actor or heads):
        raise typer.BadParameter("--gpu builds its own random actor and heads")
    plan = plan_for(quick, gpu, items=items, max_new_tokens=max_new_tokens, threads=threads,
                    http=http)
    cmd = "dualread bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else \
        "dualread bench"
    res = run_bench(out, plan, str(actor) if actor else None, str(heads) if heads else None,
                    gpu=gpu, command=cmd.strip(), batch_wait_ms=batch_wait_ms)
    console.print((out / "bench.md").read_text())
    missed = [t["target"] for t in res["targets"] if t["met"] is False]
    if missed:
        console.print(f"[yellow]targets missed[/yellow]: {'; '.join(missed)}")
