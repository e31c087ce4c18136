"""`dualread` command line: answer, train and evaluate the actor, fit heads, serve, probe."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

try:
    import typer
    from rich.console import Console

    from app.settings_cli import markdown_table, settings_from, with_settings
    from clients.probes.cli import probe
except ModuleNotFoundError as e:   # a client-only install has the script but not its stack
    raise SystemExit(f"dualread: the command line needs the server stack ({e.name} is "
                     'missing): pip install "dualread[server]"') from e

app = typer.Typer(help="DualRead: VQA answers from a frozen VLM with grounded confidence.",
                  no_args_is_help=True, add_completion=False)
console = Console()


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, once installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dualread")
    except PackageNotFoundError:     # run from a source tree that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dualread {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False) -> None:
    """DualRead: VQA answers from a frozen VLM with grounded confidence."""

ActorOpt = Annotated[Path | None, typer.Option(
    "--actor", help="Actor folder (local). Default: the embedded tiny Qwen3-VL.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16")]


# The settings `dualread answer` takes as flags: those that shape one answer.
ANSWER_SETTINGS = ("actor", "heads", "heads_mismatch", "device", "dtype", "threads",
                   "max_new_tokens", "max_question_chars", "max_question_tokens",
                   "max_image_bytes", "max_image_pixels", "request_timeout_s")


@app.command()
@with_settings(ANSWER_SETTINGS)
def answer(
    given: dict,
    image: Annotated[Path, typer.Option("--image", exists=True, dir_okay=False)],
    question: Annotated[str, typer.Option("--question")],
    readout_shapes: Annotated[bool, typer.Option(
        "--readout-shapes", help="instead: the actor's answer with the readout's shapes "
        "and positions (no heads)")] = False,
    readout: Annotated[str, typer.Option(
        "--readout", help="with --readout-shapes: capture or replay")] = "capture",
    as_json: Annotated[bool, typer.Option("--json", hidden=True,
                                          help="accepted; the output is JSON anyway")] = False,
) -> None:
    """Answer one visual question: prints the JSON that POST /answer returns (answer,
    confidence, defer, defer_reasons, ...). Each setting flag also reads DUALREAD_<NAME>
    from the environment, and so do the settings without a flag here."""
    import asyncio
    import uuid

    from app.errors import detail_of, status_of
    from app.settings import apply_threads

    settings = settings_from(given)
    apply_threads(settings)
    if readout_shapes:
        _readout_shapes(settings, image, question, readout)
        return
    from app.one_answer import answer_once
    from app.service import Service
    from heads.dualread import FingerprintMismatch

    try:
        svc = Service(settings.actor, settings.heads, settings.device, settings.dtype,
                      settings.heads_mismatch)
    except FingerprintMismatch as e:
        typer.echo(f"dualread: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        out = asyncio.run(answer_once(svc, settings, image.read_bytes(), question))
    except Exception as e:
        status = status_of(e)
        if status == 500:           # a fault, not a refusal: its traceback helps more
            raise
        # the body /answer would send with this status
        sys.stdout.write(json.dumps({"detail": detail_of(e), "request_id": uuid.uuid4().hex})
                         + "\n")
        typer.echo(f"dualread: refused with HTTP status {status} (as /answer would)", err=True)
        raise typer.Exit(1) from None
    sys.stdout.write(out.model_dump_json() + "\n")


def _readout_shapes(settings, image: Path, question: str, readout: str) -> None:
    """The actor alone: its answer and the shapes of what the heads would read."""
    from models.images import open_image
    from models.loading import load_actor

    act = load_actor(settings.actor, device=settings.device, dtype=settings.dtype)
    r = act.answer([open_image(image.read_bytes())], [question], settings.max_new_tokens,
                   readout)[0]
    ro = r.readout
    out = {"answer": r.answer, "canonical": r.canonical, "response": r.text,
           "verbalized": r.parsed.verbalized, "mu_c": ro.verbalized_mu if ro else None,
           "finished": r.finished, "readout_shapes": ro.shapes() if ro else {},
           "positions": {k: v for k, v in (ro.positions if ro else {}).items()}}
    sys.stdout.write(json.dumps(out) + "\n")


@app.command("train-actor")
def train_actor(
    out: Annotated[Path, typer.Option("--out", help="where to write the actor folder")],
    smoke: Annotated[bool, typer.Option("--smoke", help="tiny data, few steps")] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume_sft: Annotated[Path | None, typer.Option(
        "--resume-sft", help="continue from a saved three-phase SFT checkpoint")] = None,
    eval_limit: Annotated[int | None, typer.Option(
        "--eval-limit", help="evaluate on a deterministic sample of the test set")] = None,
    continue_from: Annotated[Path | None, typer.Option(
        "--continue-from", exists=True, file_okay=False,
        help="continue GRPO on this actor folder (calibration stage) instead of training")
    ] = None,
    calibration_steps: Annotated[int, typer.Option(
        "--calibration-steps", help="GRPO steps of the continuation")] = 600,
    brier_weight: Annotated[float, typer.Option(
        "--brier-weight", help="weight W of the Brier term (correctness weighs 1)")] = 1.0,
    group: Annotated[int, typer.Option("--group", help="generations per prompt")] = 8,
    prompts: Annotated[int, typer.Option("--prompts", help="prompts per GRPO step")] = 4,
    grpo_lr: Annotated[float, typer.Option("--grpo-lr")] = 2e-5,
    temperature: Annotated[float, typer.Option("--temperature")] = 1.0,
    scale_rewards: Annotated[str, typer.Option(
        "--scale-rewards", help="group, batch or none (TRL advantage scaling)")] = "group",
    threads: Annotated[int, typer.Option("--threads", help="torch threads (continuation)")] = 1,
    hard_share: Annotated[float, typer.Option(
        "--hard-share", help="share of GRPO prompts the parent answers wrong")] = 0.0,
    scan: Annotated[int, typer.Option(
        "--scan", help="training items answered to find those misses")] = 6000,
    split_credit: Annotated[bool, typer.Option(
        "--split-credit", help="the confidence digit gets the Brier advantage alone")] = False,
    digit_lr_factor: Annotated[float, typer.Option(
        "--digit-lr-factor", help="learning-rate multiplier of the digit rows")] = 1.0,
    beta: Annotated[float, typer.Option("--beta", help="KL coefficient to the parent")] = 0.0,
    self_calibration: Annotated[bool, typer.Option(
        "--self-calibration/--no-self-calibration",
        help="run the recipe's stage 3 (off: the two-stage SFT + GRPO actor)")] = True,
    self_calibrate: Annotated[bool, typer.Option(
        "--self-calibrate", help="with --continue-from: supervised Brier of μ(C) on the "
        "actor's own answers instead of GRPO (models/self_calibrate.py)")] = False,
    self_steps: Annotated[int, typer.Option("--self-steps", help="self-calibration steps")
                          ] = 900,
    self_answers: Annotated[int, typer.Option(
        "--self-answers", help="own answers the self-calibration trains on")] = 8000,
    self_lr: Annotated[float, typer.Option("--self-lr")] = 1e-4,
) -> None:
    """Train the embedded actor (SFT then GRPO on easy-VQA) and write its card.

    With --continue-from, run only more GRPO on that actor with the RLCR-style reward
    (correct + format + W·Brier), checkpointed and resumable, and write the result and a
    card with μ(C) metrics to --out.
    """
    from dataclasses import replace

    from models.train import SMOKE, Recipe
    from models.train import train_actor as run

    if self_calibrate:
        if continue_from is None:
            raise typer.BadParameter("--self-calibrate needs --continue-from")
        from models.calibrate import self_calibrate_actor
        from models.self_calibrate import SMOKE_SELF, SelfCalibration

        cfg = replace(SMOKE_SELF if smoke else SelfCalibration(), seed=seed,
                      **({} if smoke else {"steps": self_steps, "answers": self_answers,
                                           "lr": self_lr}))
        cmd = (f"dualread train-actor --continue-from {continue_from} --out {out} "
               f"--self-calibrate --self-steps {cfg.steps} --self-answers {cfg.answers} "
               f"--self-lr {cfg.lr}" + (f" --seed {seed}" if seed else "")
               + (" --smoke" if smoke else "")
               + (f" --eval-limit {eval_limit}" if eval_limit else ""))
        card = self_calibrate_actor(continue_from, out, cfg, command=cmd,
                                    eval_limit=eval_limit, smoke=smoke,
                                    threads=threads)
        console.print_json(json.dumps(card["metrics"]))
        return
    if continue_from is not None:
        from models.calibrate import calibrate_actor

        recipe = replace(SMOKE if smoke else Recipe(), seed=seed, grpo_steps=calibration_steps,
                         brier_weight=brier_weight, grpo_group=group, grpo_prompts=prompts,
                         grpo_lr=grpo_lr, grpo_temperature=temperature,
                         grpo_scale_rewards=scale_rewards, grpo_save_steps=50)
        cmd = (f"dualread train-actor --continue-from {continue_from} --out {out} "
               f"--calibration-steps {calibration_steps} --brier-weight {brier_weight} "
               f"--group {group} --prompts {prompts} --grpo-lr {grpo_lr} "
               f"--temperature {temperature} --scale-rewards {scale_rewards}"
               + (f" --hard-share {hard_share} --scan {scan}" if hard_share else "")
               + (" --split-credit" if split_credit else "")
               + (f" --digit-lr-factor {digit_lr_factor}" if digit_lr_factor != 1.0 else "")
               + (f" --beta {beta}" if beta else "")
               + (f" --seed {seed}" if seed else "") + (" --smoke" if smoke else "")
               + (f" --eval-limit {eval_limit}" if eval_limit else ""))
        card = calibrate_actor(continue_from, out, recipe, command=cmd,
                               eval_limit=eval_limit or 1000, smoke=smoke, threads=threads,
                               hard_share=hard_share, scan=scan, split_credit=split_credit,
                               digit_lr_factor=digit_lr_factor, beta=beta)
        console.print_json(json.dumps(card["metrics"]))
        return
    recipe = replace(SMOKE if smoke else Recipe(), seed=seed,   # never mutate the preset
                     self_calibration=self_calibration)
    cmd = "dualread train-actor --out " + str(out) + (" --smoke" if smoke else "") + (
        "" if self_calibration else " --no-self-calibration")
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
    confidence: Annotated[bool, typer.Option(
        "--confidence", help="also the stated digit, μ(C) and its AUROC (capture readout)")
    ] = False,
) -> None:
    """Accuracy by answer type, well-formedness, and the blank-image drop."""
    from models.calibrate import confidence_report
    from models.data import load, sample
    from models.evaluate import evaluate_actor as run
    from models.loading import load_actor

    act = load_actor(actor, device=device)
    items = sample(load(data), limit)
    metrics = (confidence_report if confidence else run)(act, items, batch=batch)
    console.print_json(json.dumps(metrics))


HeadsOpt = Annotated[Path | None, typer.Option(
    "--heads", help="Heads folder. Default: the heads shipped for the embedded actor.")]


def _open_unit(value: float) -> float:
    """A risk or a δ strictly inside (0, 1), refused before any work: r ≥ 1 certifies a
    threshold that keeps nothing, δ ≥ 1 certifies without evidence, 0 never certifies."""
    if not 0.0 < value < 1.0:
        raise typer.BadParameter(f"{value:g} is not strictly between 0 and 1")
    return value


@app.command("fit-heads")
def fit_heads(
    out: Annotated[Path, typer.Option("--out", help="where to write the heads folder")],
    actor: ActorOpt = None,
    data: Annotated[str, typer.Option("--data", help="data spec to fit on")] = "easyvqa:heldout",
    limit: Annotated[int | None, typer.Option("--limit", min=1)] = None,
    target_risk: Annotated[float, typer.Option(
        "--risk", callback=_open_unit, help="target selective risk r, in (0, 1)")] = 0.05,
    delta: Annotated[float, typer.Option(
        "--delta", callback=_open_unit, help="1 - confidence of the bound, in (0, 1)")] = 0.1,
    cache: Annotated[Path | None, typer.Option(
        "--cache", "--cache-dir", help="readout cache folder")] = None,
    device: DeviceOpt = "cpu",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    allow_dirty: Annotated[bool, typer.Option(
        "--allow-dirty", help="fit from uncommitted code (the card says so)")] = False,
    novelty: Annotated[bool, typer.Option(
        "--novelty/--no-novelty", help="fit the novelty detector of the defer rule "
        "(image tokens and prompt state; clean data and benign re-encodings)")] = True,
    novelty_per_family: Annotated[int, typer.Option(
        "--novelty-per-family", min=1, help="benign re-encodings of reader-split images "
        "per family for the novelty detector's bank")] = 250,
) -> None:
    """Fit PSR, P-State, P-Visual, temperatures, baselines, the defer threshold and the
    novelty detector."""
    from heads.fit import (
        DirtyTree,
        WorseThanPrior,
        check_tree,
        refuse_worse_than_prior,
        summary_table,
    )
    from heads.fit import fit_heads as run
    from models.data import load, sample
    from models.loading import load_actor

    try:    # before any work: a card must name the code that fitted it
        tree = check_tree(allow_dirty)
    except DirtyTree as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from e
    try:    # before the actor: a wrong spec is the user's, and known in a second
        items = sample(load(data), limit)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--data") from None
    act = load_actor(actor, device=device)
    heads, info = run(act, items, cache_dir=cache, target_risk=target_risk, delta=delta,
                      seed=seed, novelty=novelty, novelty_per_family=novelty_per_family)
    console.print(summary_table(info["defer_split_metrics"]))
    try:
        refuse_worse_than_prior(info)
    except WorseThanPrior as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(3) from e
    cmd = f"dualread fit-heads --data {data} --out {out}" + (f" --limit {limit}" if limit else "")
    cmd += " --allow-dirty" if allow_dirty else ""
    cmd += "" if novelty else " --no-novelty"
    cmd += f" --novelty-per-family {novelty_per_family}" if novelty else ""
    # the options that change the fit, where not their defaults: the card's command reruns it
    cmd += f" --risk {target_risk!r}" if target_risk != 0.05 else ""
    cmd += f" --delta {delta!r}" if delta != 0.1 else ""
    cmd += f" --seed {seed}" if seed else ""
    card = {"actor": str(actor or "embedded"), "data": data, "limit": limit, "command": cmd,
            "git_commit": tree["describe"], "git_dirty": tree["dirty"], **info}
    heads.save(out, card)
    pol = heads.policy
    console.print(f"defer below tau={pol.tau:.4f}: coverage {pol.coverage:.3f}, risk "
                  f"{pol.empirical_risk:.3f} (bound {pol.risk_upper_bound:.3f} <= r="
                  f"{pol.target_risk} w.p. {1 - pol.delta:.2f}); feasible={pol.feasible}")
    console.print(f"defer rule: {heads.defer_rule}")


@app.command("fit-detectors")
def fit_detectors(
    heads: Annotated[Path, typer.Option("--heads", help="heads folder to update in place")],
    actor: ActorOpt = None,
    data: Annotated[str, typer.Option("--data", help="the data the heads were fitted on")
                    ] = "easyvqa:heldout",
    limit: Annotated[int | None, typer.Option("--limit")] = None,
    per_family: Annotated[int, typer.Option(
        "--novelty-per-family", min=1, help="benign re-encodings per family in the bank")
    ] = 250,
    cache: Annotated[Path | None, typer.Option(
        "--cache", "--cache-dir", help="readout cache folder")] = None,
    device: DeviceOpt = "cpu",
    allow_dirty: Annotated[bool, typer.Option(
        "--allow-dirty", help="fit from uncommitted code (the card says so)")] = False,
    clean_sample_only: Annotated[bool, typer.Option(
        "--clean-sample-only", help="fit nothing: only add the composite detector's clean "
        "sample of its combined score (drift's reference), from the same data")] = False,
) -> None:
    """Refit only the defer rule's novelty detector of fitted heads (same data, same
    splits); the readers and tau stay. The card records the command. Heads that carry the
    retired pixel image check load here (and nowhere else): this replaces their detectors."""
    from heads.detectors import refit_detectors
    from heads.dualread import Heads
    from heads.fit import DirtyTree, check_tree
    from models.data import load, sample
    from models.loading import load_actor

    try:
        tree = check_tree(allow_dirty)
    except DirtyTree as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from e
    act = load_actor(actor, device=device)
    hd = Heads.load(heads, act.fingerprint, drop_image_check=True, prepare=False)
    if hd.card.get("data") not in (None, data) or hd.card.get("limit") not in (None, limit):
        console.print(f"[red]these heads were fitted on --data {hd.card.get('data')} "
                      f"--limit {hd.card.get('limit')}; give the same[/red]")
        raise typer.Exit(2)
    if clean_sample_only:
        from heads.detectors import add_clean_sample

        n = add_clean_sample(act, hd, sample(load(data), limit), cache)
        hd.novelty.save_clean_sample(heads)
        (heads / "novelty.json").write_text(json.dumps(hd.novelty.to_dict(), indent=2))
        console.print(f"clean sample of the combined novelty score: {n} items")
        return
    log = refit_detectors(act, hd, sample(load(data), limit), cache, per_family)
    cmd = f"dualread fit-detectors --heads {heads} --data {data}" + \
        (f" --limit {limit}" if limit else "") + f" --novelty-per-family {per_family}"
    card = {k: v for k, v in hd.card.items() if k not in ("novelty", "image_check")}
    card.update({"novelty": log, "detectors_command": cmd,
                 "detectors_git_commit": tree["describe"], "detectors_git_dirty": tree["dirty"]})
    for stale in ("image_check.json", "image_check.safetensors", "novelty.safetensors"):
        (heads / stale).unlink(missing_ok=True)
    hd.save(heads, card)
    console.print(f"defer rule: {hd.defer_rule}")


@app.command()
def evaluate(
    out: Annotated[Path, typer.Option("--out", help="report folder")] = Path("out/eval"),
    actor: ActorOpt = None,
    heads: HeadsOpt = None,
    data: Annotated[list[str] | None, typer.Option("--data", help="data spec (repeatable)")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="items per data spec")] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="comma-separated")] = None,
    bootstrap: Annotated[int, typer.Option("--bootstrap")] = 1000,
    cache: Annotated[Path | None, typer.Option(
        "--cache", "--cache-dir", help="readout cache folder")] = None,
    device: DeviceOpt = "cpu",
    grounding: Annotated[bool, typer.Option(
        "--grounding/--no-grounding",
        help="CCG-AUC on donor runs (one extra answer per pair); off for a quick shift grid")
    ] = True,
    suite: Annotated[str | None, typer.Option(
        "--suite", help="add the defer rule's stress suites: dev or heldout "
        "(docs/defer/suites.md)")] = None,
) -> None:
    """The table of every confidence method next to DualRead, with CIs, costs and plots;
    with --suite, the defer rule per stress suite."""
    from heads.dualread import Heads
    from heads.evaluate import evaluate as run
    from models.loading import load_actor

    act = load_actor(actor, device=device)
    hd = Heads.load(heads, act.fingerprint)
    if suite is not None:
        from heads.suites import suite_specs

        try:
            specs = list(data or []) + suite_specs(suite)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--suite") from None
    else:
        specs = data or ["easyvqa:test"]
    # None: every registered method (heads.registry)
    chosen = tuple(m.strip() for m in methods.split(",")) if methods else None
    cmd = "dualread evaluate " + (f"--suite {suite} " + " ".join(f"--data {s}" for s in data or [])
                                  if suite else " ".join(f"--data {s}" for s in specs)) + \
        (f" --limit {limit}" if limit else "") + (f" --methods {methods}" if methods else "") + \
        (f" --bootstrap {bootstrap}" if bootstrap != 1000 else "") + \
        ("" if grounding else " --no-grounding") + f" --out {out}"
    run(act, hd, specs, out, chosen, limit, bootstrap, cache, command=cmd,
        grounding_on=grounding)
    console.print((out / "report.md").read_text())
    console.print(f"wrote {out}/report.json, report.md and plots")


@app.command()
@with_settings()
def serve(
    given: dict,
    ray: Annotated[bool, typer.Option(
        "--ray", help="run on Ray Serve: a local Ray instance, or the one at --ray-address")
                   ] = False,
    replicas: Annotated[int, typer.Option(
        "--replicas", help="with --ray: replicas (one GPU each with --device cuda)")
                        ] = 1,
    max_replicas: Annotated[int | None, typer.Option(
        "--max-replicas", help="with --ray: autoscale from --replicas up to this many")
                            ] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="with --ray: join this cluster (e.g. auto, or ray://host:10001)"
    )] = None,
) -> None:
    """Run the HTTP service. Every setting is a flag here and reads DUALREAD_<NAME> from
    the environment too, e.g. --max-question-chars and DUALREAD_MAX_QUESTION_CHARS
    (docs/configuration.md; `dualread settings --markdown`)."""
    import uvicorn

    from app.heads_match import mismatch
    from app.http11 import JsonH11Protocol
    from app.logs import UVICORN_LOG_CONFIG
    from app.main import create_app
    from app.settings import apply_threads

    settings = settings_from(given)
    # before anything starts: heads of another actor are a startup error, not a service
    # that stays up answering 503 (unless answer-only is asked for)
    problem = mismatch(settings.actor, settings.heads)
    if problem is not None:
        if settings.heads_mismatch == "refuse":
            typer.echo(f"dualread: {problem}", err=True)
            raise typer.Exit(2)
        typer.echo("dualread: answer-only (--heads-mismatch answer-only): every /answer has "
                   "confidence null and defer true; the heads were fitted for another actor",
                   err=True)
    apply_threads(settings)
    if ray:
        try:
            from app.ray_deploy import serve_forever
        except ImportError as e:
            raise typer.BadParameter(f"needs ray[serve] ({e}): pip install \"dualread[ray]\"",
                                     param_hint="--ray") from None
        if replicas < 1:
            raise typer.BadParameter("must be at least 1", param_hint="--replicas")
        if max_replicas is not None and max_replicas < replicas:
            raise typer.BadParameter("must be at least --replicas", param_hint="--max-replicas")
        Console(stderr=True).print(
            f"dualread: Ray Serve, {replicas} replica(s)"
            + (f" (autoscaling to {max_replicas})" if max_replicas else "")
            + f", on http://{settings.host}:{settings.port} once every replica is up")
        serve_forever(settings, replicas, max_replicas, ray_address)
        return
    if replicas != 1 or max_replicas is not None or ray_address is not None:
        raise typer.BadParameter("--replicas, --max-replicas and --ray-address need --ray")
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
                            log_config=UVICORN_LOG_CONFIG,
                            timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
                            # h11: the one parser that bounds the headers (httptools: no limit);
                            # its own 400s in the service's JSON shape
                            http=JsonH11Protocol,
                            h11_max_incomplete_event_size=settings.max_header_bytes,
                            # no WebSocket route: an upgrade with a body hung, never answered
                            ws="none")
    Server(config).run()


@app.command("settings")
def settings_cmd(
    markdown: Annotated[bool, typer.Option(
        "--markdown", help="the table of every setting (docs/configuration.md) instead")
                        ] = False,
) -> None:
    """The settings `serve` would run with (flags aside: the DUALREAD_* variables and the
    defaults), as JSON; the API key is shown as set or not, never its value."""
    if markdown:
        sys.stdout.write(markdown_table())
        return
    values = settings_from({}).model_dump()
    values["api_key"] = None if values["api_key"] is None else "(set)"
    sys.stdout.write(json.dumps(values, indent=1) + "\n")


# `dualread probe` lives client-side (clients.probes.cli) so that it also runs on the
# `probes` extra alone; registered here so the full command tree lists it.
app.command()(probe)


@app.command("fit-order-head")
def fit_order_head(
    out: Annotated[Path, typer.Option("--out", help="report folder")] = Path("out/order-head"),
    actor: ActorOpt = None,
    data: Annotated[str, typer.Option("--data", help="items with boxes")] = "easyvqa:heldout",
    limit: Annotated[int | None, typer.Option("--limit")] = 500,
    folds: Annotated[int, typer.Option("--folds", help="folds grouped by question")] = 5,
    order_weight: Annotated[float, typer.Option("--order-weight")] = 1.0,
    margin: Annotated[float, typer.Option("--margin")] = 0.0,
    steps: Annotated[int, typer.Option("--steps")] = 1000,
    bootstrap: Annotated[int, typer.Option("--bootstrap")] = 1000,
    device: DeviceOpt = "cpu",
    threads: Annotated[int, typer.Option(
        "--threads", help="torch CPU threads (1 is fastest on a shared machine)")] = 1,
) -> None:
    """EMVR's order head (BCE + adjacent hinge) vs BCE only and the native confidence:
    mask-trained, tested on blur; writes report.md/json and trajectories.jsonl."""
    import torch

    from clients.probes.order import (
        MASK_FILL,
        collect,
        compare,
        fit_head,
        markdown,
        trajectory_records,
    )
    from clients.probes.runner import clean
    from models.data import load, sample
    from models.loading import load_actor

    torch.set_num_threads(threads)
    act = load_actor(actor, device=device)
    items = sample(load(data), limit)
    sev = (0.0, 0.25, 0.5, 0.75, 1.0)
    mask, blur = collect(act, items, sev)
    res = compare(mask, blur, folds, order_weight, margin, steps, bootstrap,
                  with_confidences=True)
    conf = res.pop("confidences")
    cmd = f"dualread fit-order-head --data {data}" + (f" --limit {limit}" if limit else "") + \
        f" --out {out}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(clean({**res, "data": data, "limit": limit,
                                                       "mask_fill": MASK_FILL,
                                                       "command": cmd}), indent=1) + "\n")
    (out / "trajectories.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in trajectory_records(mask, blur, conf, sev)))
    (out / "report.md").write_text(markdown(res, cmd))
    # the deployable head: BCE + order on every mask trajectory
    head = fit_head(mask.x, mask.z, order_weight, margin, steps=steps)
    (out / "order_head.json").write_text(json.dumps(
        {"features": "h_close, mean answer log-prob, mean answer entropy", "w": head.w.tolist(),
         "b": head.b, "mean": head.mean.tolist(), "std": head.std.tolist(), "command": cmd,
         "actor": act.fingerprint}) + "\n")
    console.print((out / "report.md").read_text(), markup=False)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
