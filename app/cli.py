"""`dualread` command line: answer, train and evaluate the actor, fit heads, serve, probe."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(help="DualRead: VQA answers from a frozen VLM with grounded confidence.",
                  no_args_is_help=True, add_completion=False)
console = Console()

ActorOpt = Annotated[Path | None, typer.Option(
    "--actor", help="Actor folder (local). Default: the embedded tiny Qwen3-VL.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16")]


@app.command()
def answer(
    image: Annotated[Path, typer.Option("--image", exists=True, dir_okay=False)],
    question: Annotated[str, typer.Option("--question")],
    actor: ActorOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    readout: Annotated[str, typer.Option("--readout", help="capture or replay")] = "capture",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Answer one visual question and show the readout's shapes."""
    from models.images import open_image
    from models.loading import load_actor

    act = load_actor(actor, device=device, dtype=dtype)
    r = act.answer([open_image(image.read_bytes())], [question], max_new_tokens, readout)[0]
    ro = r.readout
    out = {"answer": r.answer, "canonical": r.canonical, "response": r.text,
           "verbalized": r.parsed.verbalized, "mu_c": ro.verbalized_mu if ro else None,
           "finished": r.finished, "readout_shapes": ro.shapes() if ro else {},
           "positions": {k: v for k, v in (ro.positions if ro else {}).items()}}
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
        return
    console.print(f"[bold]answer[/bold]: {r.answer!r}   [dim](canonical {r.canonical!r})[/dim]")
    console.print(f"[bold]response[/bold]: {r.text}")
    for name, shape in out["readout_shapes"].items():
        console.print(f"  {name:15s} {shape}")


@app.command("train-actor")
def train_actor(
    out: Annotated[Path, typer.Option("--out", help="where to write the actor folder")],
    smoke: Annotated[bool, typer.Option("--smoke", help="tiny data, few steps")] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume_sft: Annotated[Path | None, typer.Option(
        "--resume-sft", help="continue from a saved three-phase SFT checkpoint")] = None,
    eval_limit: Annotated[int | None, typer.Option(
        "--eval-limit", help="evaluate on a deterministic sample of the test set")] = None,
) -> None:
    """Train the embedded actor (SFT then GRPO on easy-VQA) and write its card."""
    from dataclasses import replace

    from models.train import SMOKE, Recipe
    from models.train import train_actor as run

    recipe = replace(SMOKE if smoke else Recipe(), seed=seed)   # never mutate the preset
    cmd = "dualread train-actor --out " + str(out) + (" --smoke" if smoke else "")
    card = run(out, recipe, smoke=smoke, command=cmd, resume_sft=resume_sft,
               eval_limit=eval_limit)
    console.print_json(json.dumps(card["metrics"]))


@app.command("evaluate-actor")
def evaluate_actor(
    actor: ActorOpt = None,
    data: Annotated[str, typer.Option("--data")] = "easyvqa:test",
    limit: Annotated[int | None, typer.Option("--limit")] = None,
    device: DeviceOpt = "cpu",
    batch: Annotated[int, typer.Option("--batch")] = 32,
) -> None:
    """Accuracy by answer type, well-formedness, and the blank-image drop."""
    from models.data import load, sample
    from models.evaluate import evaluate_actor as run
    from models.loading import load_actor

    act = load_actor(actor, device=device)
    metrics = run(act, sample(load(data), limit), batch=batch)
    console.print_json(json.dumps(metrics))


HeadsOpt = Annotated[Path | None, typer.Option(
    "--heads", help="Heads folder. Default: the heads shipped for the embedded actor.")]


@app.command("fit-heads")
def fit_heads(
    out: Annotated[Path, typer.Option("--out", help="where to write the heads folder")],
    actor: ActorOpt = None,
    data: Annotated[str, typer.Option("--data", help="data spec to fit on")] = "easyvqa:heldout",
    limit: Annotated[int | None, typer.Option("--limit")] = None,
    target_risk: Annotated[float, typer.Option("--risk", help="target selective risk r")] = 0.05,
    delta: Annotated[float, typer.Option("--delta", help="1 - confidence of the bound")] = 0.1,
    cache: Annotated[Path | None, typer.Option("--cache", help="readout cache folder")] = None,
    device: DeviceOpt = "cpu",
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Fit PSR, P-State, P-Visual, temperatures, baselines and the defer threshold."""
    from heads.fit import fit_heads as run
    from heads.fit import summary_table
    from models.data import load, sample
    from models.evaluate import git_commit
    from models.loading import load_actor

    act = load_actor(actor, device=device)
    items = sample(load(data), limit)
    heads, info = run(act, items, cache_dir=cache, target_risk=target_risk, delta=delta,
                      seed=seed)
    cmd = f"dualread fit-heads --data {data} --out {out}" + (f" --limit {limit}" if limit else "")
    card = {"actor": str(actor or "embedded"), "data": data, "limit": limit, "command": cmd,
            "git_commit": git_commit(), **info}
    heads.save(out, card)
    console.print(summary_table(info["defer_split_metrics"]))
    pol = heads.policy
    console.print(f"defer below tau={pol.tau:.4f}: coverage {pol.coverage:.3f}, risk "
                  f"{pol.empirical_risk:.3f} (bound {pol.risk_upper_bound:.3f} <= r="
                  f"{pol.target_risk} w.p. {1 - pol.delta:.2f}); feasible={pol.feasible}")


@app.command()
def evaluate(
    out: Annotated[Path, typer.Option("--out", help="report folder")] = Path("out/eval"),
    actor: ActorOpt = None,
    heads: HeadsOpt = None,
    data: Annotated[list[str] | None, typer.Option("--data", help="data spec (repeatable)")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="items per data spec")] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="comma-separated")] = None,
    bootstrap: Annotated[int, typer.Option("--bootstrap")] = 1000,
    cache: Annotated[Path | None, typer.Option("--cache")] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """The table of every confidence method next to DualRead, with CIs, costs and plots."""
    from heads.dualread import Heads
    from heads.evaluate import METHODS
    from heads.evaluate import evaluate as run
    from models.loading import load_actor

    act = load_actor(actor, device=device)
    hd = Heads.load(heads, act.fingerprint)
    specs = data or ["easyvqa:test"]
    chosen = tuple(m.strip() for m in methods.split(",")) if methods else METHODS
    cmd = "dualread evaluate " + " ".join(f"--data {s}" for s in specs) + \
        (f" --limit {limit}" if limit else "") + f" --out {out}"
    run(act, hd, specs, out, chosen, limit, bootstrap, cache, command=cmd)
    console.print((out / "report.md").read_text())
    console.print(f"wrote {out}/report.json, report.md and plots")


@app.command()
def serve(
    actor: ActorOpt = None,
    heads: HeadsOpt = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    host: Annotated[str | None, typer.Option("--host")] = None,
    port: Annotated[int | None, typer.Option("--port")] = None,
    max_batch_size: Annotated[int | None, typer.Option("--max-batch-size")] = None,
    batch_wait_ms: Annotated[float | None, typer.Option("--batch-wait-ms")] = None,
    queue_limit: Annotated[int | None, typer.Option("--queue-limit")] = None,
    request_timeout_s: Annotated[float | None, typer.Option("--request-timeout-s")] = None,
    max_image_bytes: Annotated[int | None, typer.Option("--max-image-bytes")] = None,
    max_image_pixels: Annotated[int | None, typer.Option("--max-image-pixels")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="require 'Authorization: Bearer KEY' (or DUALREAD_API_KEY)")] = None,
) -> None:
    """Run the HTTP service. Every flag also reads DUALREAD_<FLAG> from the environment."""
    import uvicorn

    from app.main import create_app
    from app.settings import Settings

    given = {k: v for k, v in dict(
        actor=str(actor) if actor else None, heads=str(heads) if heads else None,
        device=device, dtype=dtype, host=host, port=port, max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms, queue_limit=queue_limit,
        request_timeout_s=request_timeout_s, max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels, max_new_tokens=max_new_tokens,
        api_key=api_key).items() if v is not None}
    settings = Settings(**given)
    api = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # readiness goes 503 and new work is refused; in-flight requests finish
            api.state.core.drain()
            super().handle_exit(sig, frame)

    Console(stderr=True).print(
        f"dualread: serving on http://{settings.host}:{settings.port} (OpenAPI at /docs); "
        "/health/ready turns 200 once the model is loaded")
    config = uvicorn.Config(api, host=settings.host, port=settings.port, log_level="warning",
                            timeout_graceful_shutdown=int(settings.request_timeout_s) + 5)
    Server(config).run()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
