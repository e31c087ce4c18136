"""The `dualread` script. `dualread probe ...` runs from clients.probes.cli alone, so a
`pip install "dualread[probes]"` (no torch, no server) can probe a remote deployment; every
other command comes from app.cli, plus `dualread bench` (bench sits above app, so app.cli
cannot import it: the tree is assembled here, the one module above both)."""

from __future__ import annotations

import sys

import typer


def full_app() -> typer.Typer:
    """Every command: app.cli's tree (its root options, e.g. --version) plus bench."""
    from app import cli
    from bench.cli import bench

    app = typer.Typer(no_args_is_help=True, add_completion=False)
    app.info = cli.app.info
    app.registered_callback = cli.app.registered_callback
    app.registered_commands = [*cli.app.registered_commands]
    app.registered_groups = [*cli.app.registered_groups]
    app.command()(bench)
    return app


def main() -> None:
    if sys.argv[1:2] == ["probe"]:
        from clients.probes.cli import probe_app

        probe_app()(prog_name="dualread")
        return
    try:
        app = full_app()
    except SystemExit as e:   # app.cli's message when the server stack is missing
        if isinstance(e.code, str):
            e.code += '\n(`dualread probe` needs only pip install "dualread[probes]")'
        raise
    app(prog_name="dualread")


if __name__ == "__main__":  # pragma: no cover
    main()
