"""`python -m bench ...` is `dualread bench ...`."""

import sys

import typer

from bench.cli import bench

app = typer.Typer(add_completion=False)
app.command()(bench)
sys.argv = ["dualread", "bench", *sys.argv[1:]]   # the command line the report records
app(args=sys.argv[2:], prog_name="dualread bench")
