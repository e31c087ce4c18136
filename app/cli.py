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
) -> None:
    """Train the embedded actor (SFT then GRPO on easy-VQA) and write its card."""
    from models.train import SMOKE, Recipe
    from models.train import train_actor as run

    recipe = SMOKE if smoke else Recipe()
    recipe.seed = seed
    cmd = "dualread train-actor --out " + str(out) + (" --smoke" if smoke else "")
    card = run(out, recipe, smoke=smoke, command=cmd)
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


def main() -> None:  # pragma: no cover
    app()
