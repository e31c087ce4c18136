"""Studies and sweeps: one-off measurements behind the reports in docs/ (`python -m studies.X`).

Nothing here serves: the runtime packages (`app`, `heads`, `models`, `clients`) never import
it, and it may import any of them (docs/architecture.md, the import rules).
"""

import shlex
import sys


def command_line(module: str, argv: list[str] | None) -> str:
    """The command a report records: `python -m MODULE` and its arguments, quoted."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m " + module, *(shlex.quote(a) for a in args)])
