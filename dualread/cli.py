"""The `dualread` script. `dualread probe ...` runs from clients.probes.cli alone, so a
`pip install "dualread[probes]"` (no torch, no server) can probe a remote deployment, and
`dualread --version` reads the installed metadata only, so it answers on every install;
every other command comes from app.cli, plus `dualread bench` (bench sits above app, so
app.cli cannot import it: the tree is assembled here, the one module above both)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # typer comes with the probes and server extras, not the client one
    import typer


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, once installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dualread")
    except PackageNotFoundError:     # run from a source tree that was never installed
        return "unknown (not installed)"


def full_app() -> typer.Typer:
    """Every command: app.cli's tree (its root options, e.g. --version) plus bench."""
    import typer

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
    # The root's eager --version, answered before the server stack is imported (app.cli's
    # callback prints the same line when the full tree parses it, e.g. after --help).
    if sys.argv[1:2] == ["--version"]:
        print(f"dualread {package_version()}")
        return
    if sys.argv[1:2] == ["probe"]:
        from clients.probes.cli import probe_app

        probe_app()(prog_name="dualread")
        return
    hint = '\n(`dualread probe` needs only pip install "dualread[probes]")'
    try:
        app = full_app()
    except ModuleNotFoundError as e:   # the client extra: not even typer
        raise SystemExit(f"dualread: the command line needs the server stack ({e.name} is "
                         'missing): pip install "dualread[server]"' + hint) from e
    except SystemExit as e:   # app.cli's message when the server stack is missing
        if isinstance(e.code, str):
            e.code += hint
        raise
    app(prog_name="dualread")


if __name__ == "__main__":  # pragma: no cover
    main()
