"""Every `Settings` field as a command-line flag and a DUALREAD_* environment variable,
derived from the model (never listed by hand), and the table of them that
docs/configuration.md holds (`dualread settings --markdown`)."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from app.settings import Settings

# Flags spelt otherwise than --<name>: a switch's "off" side says what it leaves open.
FLAGS = {"metrics_require_key": "--metrics-require-key/--metrics-open",
         "docs_require_key": "--docs-require-key/--docs-open"}

HEADER = """# Configuration

Every setting is a flag of `dualread serve` and an environment variable; a flag wins over
the variable, the variable over the default. `dualread answer` takes the flags of the
settings that shape one answer (actor, heads, device, dtype, limits) and reads the others'
variables, so it answers as the server would.

Generated from `app/settings.py` by `dualread settings --markdown > docs/configuration.md`;
a test keeps this file equal to it.

"""


def env_var(name: str) -> str:
    return (str(Settings.model_config.get("env_prefix", "")) + name).upper()


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def _base(annotation: Any) -> Any:
    """The type without None (`int | None` → int)."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def _default(field: FieldInfo) -> str:
    d = field.default
    return "unset" if d is None else str(d).lower() if isinstance(d, bool) else str(d)


def option(name: str, field: FieldInfo) -> inspect.Parameter:
    """The typer option of one setting. Its default is None, so that an unset flag leaves
    the environment variable, then the field's default, to decide."""
    import typer

    base = _base(field.annotation)
    # the variable is DUALREAD_<NAME> for every flag (the command's help says so), and
    # choices are listed in the help: either one in its own column would squeeze the
    # flags' column of a narrow terminal
    default, extra = f"default: {_default(field)}", {}
    if get_origin(base) is Literal:      # choices as an Enum, which every typer reads
        choices = [str(v) for v in get_args(base)]
        base = Enum(name, {c: c for c in choices}, type=str)
        default, extra = f"{' or '.join(choices)}; {default}", {"metavar": "<choice>"}
    info = typer.Option(flag(name), help=f"{field.description} ({default})", **extra)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[base | None, info])


def with_settings(names: Iterable[str] | None = None) -> Callable[[Callable], Callable]:
    """A command decorator: adds one option per setting (all, or `names`) and passes the
    ones given on the command line to the command as `given` (a dict by field name)."""
    chosen = list(Settings.model_fields) if names is None else list(names)

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in sig.parameters.values() if p.name != "given"]
        params = [option(n, Settings.model_fields[n]) for n in chosen] + own

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in chosen}
            given = {k: v.value if isinstance(v, Enum) else v for k, v in given.items()
                     if v is not None}
            return fn(given=given, **kwargs)

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def settings_from(given: dict[str, Any]) -> Settings:
    """Settings from the flags given and the environment; a bad value is a usage error
    that names the flag and the variable, not a traceback."""
    import typer

    try:
        return Settings(**given)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else ""
        where = f"{flag(name).split('/')[0]} / {env_var(name)}" if name else "settings"
        raise typer.BadParameter(err.get("msg", "invalid"), param_hint=where) from None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table() -> str:
    """docs/configuration.md: one row per setting (name, variable, flag, default, meaning)."""
    rows = ["| setting | environment variable | flag | default | description |",
            "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        rows.append(f"| `{name}` | `{env_var(name)}` | `{flag(name)}` | "
                    f"`{_default(field)}` | {_cell(field.description or '')} |")
    return HEADER + "\n".join(rows) + "\n"
