"""`dualread probe`: the one command that needs only the `probes` extra (HTTP client, numpy,
Pillow, typer), no model stack. `app.cli` registers it in the full command tree; the
`dualread` script (dualread.cli) runs it from here without importing the server side."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console()


def probe(
    name: Annotated[str, typer.Argument(help="ccg, tgs, emvr, reliance or all")],
    url: Annotated[list[str] | None, typer.Option(
        "--url", help="the deployment; repeat to split the items across several endpoints "
                      "of it (default http://127.0.0.1:8000)")] = None,
    data: Annotated[str, typer.Option("--data", help="data spec")] = "easyvqa:test",
    out: Annotated[Path, typer.Option("--out", help="report folder (and resumable results)")
                   ] = Path("out/probe"),
    limit: Annotated[int | None, typer.Option("--limit", help="a seeded sample of N items")
                     ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", help="requests in flight")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="donors, shuffles, variants, sample")] = 0,
    bootstrap: Annotated[int, typer.Option("--bootstrap")] = 1000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="DUALREAD_API_KEY")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    deadline_s: Annotated[float, typer.Option(
        "--deadline-s", min=0, help="seconds from the start during which a 429 (queue full) "
                                    "or 504 (server deadline passed) is retried, honouring "
                                    "Retry-After")] = 24 * 3600.0,
) -> None:
    """Grounding probes over HTTP against any deployment; resumable (re-run to continue)."""
    from clients.probes import PROBES
    from clients.probes.runner import TooManyFailures, run

    names = list(PROBES) if name == "all" else [name]
    if any(n not in PROBES for n in names):
        raise typer.BadParameter(f"choose one of {', '.join(PROBES)} or all", param_hint="NAME")
    urls = url or ["http://127.0.0.1:8000"]
    # what reran it (never the API key); options at their defaults are left out
    cmd = shlex.join(["dualread", "probe", name, *(x for u in urls for x in ("--url", u)),
                      "--data", data, *(["--limit", str(limit)] if limit is not None else []),
                      "--out", str(out),
                      *(["--concurrency", str(concurrency)] if concurrency != 16 else []),
                      *(["--seed", str(seed)] if seed else []),
                      *(["--bootstrap", str(bootstrap)] if bootstrap != 1000 else []),
                      *(["--deadline-s", repr(deadline_s)] if deadline_s != 24 * 3600.0
                        else [])])
    try:
        report = run(names, urls[0] if len(urls) == 1 else urls, data, out, limit, concurrency,
                     api_key, seed, bootstrap, progress=progress, deadline_s=deadline_s,
                     command=cmd)
    except TooManyFailures as e:
        console.print(f"[red]{e}[/red] (what finished is stored; re-run to continue):\n"
                      + "\n".join(e.failures[:5]), highlight=False)
        raise typer.Exit(1) from None
    console.print((out / "report.md").read_text().split("![")[0], markup=False)
    run_info = json.loads((out / "run.json").read_text())
    console.print(f"wrote {out}/report.json, report.md and figures; {run_info['items_run']} "
                  f"items run, {run_info['items_resumed']} resumed, {run_info['wall_s']} s")
    if report.get("failures"):
        console.print(f"[red]{len(report['failures'])} items failed[/red] (re-run to retry): "
                      + "; ".join(report["failures"][:3]))
        raise typer.Exit(1)


def probe_app() -> typer.Typer:
    """A command tree holding `probe` alone: what the `dualread` script runs for
    `dualread probe ...`, so that a probes-only install never imports the server stack."""
    app = typer.Typer(help="DualRead probes over HTTP.", add_completion=False)
    app.command()(probe)

    @app.callback()
    def _root() -> None:   # keeps `probe` a subcommand (a lone command would be the root)
        """DualRead probes over HTTP."""

    return app
