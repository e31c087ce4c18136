"""The README and docs/ stay true to the repository: every relative link points at a file
(and heading) that exists; every `dualread ...`, `make ...` and `python -m ...` line in a
fenced code block, and every `dualread ...` in inline code (tables), names a real command,
options, target and module. Nothing is executed: `dualread` lines are parsed by the CLI's
own click tree."""

from __future__ import annotations

import importlib.util
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# docs/pending/ holds notes from other branches waiting to be folded into the pages
DOCS = sorted(p for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/**/*.md")]
              if p.exists() and "pending" not in p.relative_to(ROOT).parts)

FENCE = re.compile(r"^(```|~~~)(.*?)^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code, where links are live."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped,
    spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for _, heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return frozenset(found)


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    return bad


# ------------------------------------------------------------------ command lines

SEPARATORS = {";", "&", "&&", "|", "||", "(", ")"}


def command_lines(text: str) -> list[list[str]]:
    """Every simple command in the fenced blocks of `text`, as tokens (continuations
    joined, comments and shell operators split off)."""
    commands = []
    for _, body in FENCE.findall(text):
        lines = body.split("\n")[1:]          # the first line is the fence's info string
        joined = "\n".join(lines).replace("\\\n", " ")
        for line in joined.split("\n"):
            line = re.sub(r"^\s*\$\s+", "", line)      # a "$ " prompt
            try:
                lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
                lex.whitespace_split = True
                tokens = list(lex)
            except ValueError:                 # not shell (JSON, Python, output)
                continue
            current: list[str] = []
            for tok in tokens:
                if tok in SEPARATORS:
                    commands.append(current)
                    current = []
                else:
                    current.append(tok)
            commands.append(current)
    out = []
    for cmd in commands:
        while cmd and (cmd[0] in {"time", "nohup", "sudo"} or re.match(r"^\w+=", cmd[0])):
            cmd = cmd[1:]                      # `time`, `VAR=value` before the program
        cmd = _before_redirect(cmd)
        if cmd:
            out.append(cmd)
    return out


def _concrete(args: list[str]) -> list[str]:
    """Shell expansions and `...` have no value here: one standing for an option's value
    becomes a placeholder, one standing alone (e.g. `$S` holding several options) is
    dropped."""
    out: list[str] = []
    for tok in args:
        if "$" in tok or tok in {"...", "…"}:
            if out and out[-1].startswith("-") and "=" not in out[-1]:
                out.append("X")
            continue
        out.append(tok)
    return out


@cache
def dualread_command():
    typer_main = pytest.importorskip("typer.main")
    from dualread.cli import full_app  # the tree the `dualread` script runs

    return typer_main.get_command(full_app())


def _is(error: BaseException, *names: str) -> bool:
    # typer carries its own copy of click, so its exceptions are matched by class name
    return any(cls.__name__ in names for cls in type(error).__mro__)


def dualread_error(args: list[str]) -> str | None:
    """Why `dualread ARGS` would be refused by its parser, or None. A missing required
    option and a value the parser rejects (a file that is not here, a placeholder for a
    shell variable) do not count; an unknown command or option, an option without its
    value and a stray argument do."""
    group = dualread_command()
    root = group.context_class(group, info_name="dualread")
    leading = []
    while args and args[0].startswith("-"):
        leading.append(args.pop(0))
    group_opts = {o for p in group.get_params(root) for o in p.opts + p.secondary_opts}
    for opt in leading:
        if opt.split("=")[0] not in group_opts:
            return f"no such option {opt}"
    if not args:
        return None if leading else "no command"
    sub = group.get_command(root, args[0])
    if sub is None:
        return f"no such command {args[0]!r}"
    if "--help" in args:                       # parsing it would print the help
        return None
    try:
        sub.make_context(args[0], list(args[1:]), parent=root)
    except Exception as e:
        if _is(e, "Exit", "BadParameter"):     # --help; MissingParameter is a BadParameter
            return None
        if _is(e, "UsageError"):
            return e.format_message()
        raise
    return None


def _before_redirect(tokens: list[str]) -> list[str]:
    """The command's own words: a shell redirection (`> file`, `2>&1`) ends them."""
    for i, tok in enumerate(tokens):
        if re.match(r"^\d*(>>?|<)", tok):
            return tokens[:i]
    return tokens


def inline_commands(text: str) -> list[list[str]]:
    """`dualread ...` in inline code outside fenced blocks (tables, prose), written with
    usage notation: `[--opt X]` optional, `a\\|b` alternatives (the first is checked)."""
    commands = []
    for span in re.findall(r"`(dualread\s[^`]+)`", FENCE.sub("", text)):
        span = re.sub(r"(\S+?)(?:\\\|[^\s\]]+)+", r"\1", span)
        try:
            tokens = _before_redirect(shlex.split(span.replace("[", " ").replace("]", " ")))
        except ValueError:
            continue
        if len(_concrete(tokens[1:])) > 0:      # `dualread ...` alone names no command
            commands.append(tokens)
    return commands


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def command_errors(path: Path) -> list[str]:
    bad = []
    for cmd in command_lines(path.read_text(encoding="utf-8")):
        program, args = Path(cmd[0]).name, _concrete(cmd[1:])
        line = " ".join(cmd)
        if program == "dualread":
            err = dualread_error(list(args))
            if err:
                bad.append(f"{line}: {err}")
        elif program == "make":
            for target in (a for a in args if not a.startswith("-") and "=" not in a):
                if target not in make_targets():
                    bad.append(f"{line}: no Makefile target {target!r}")
        elif program.startswith("python") and args[:1] == ["-m"] and len(args) > 1:
            module = args[1]
            if module not in {"pytest", "pip", "venv"} and importlib.util.find_spec(module) is None:
                bad.append(f"{line}: no module {module}")
    return bad


def inline_command_errors(path: Path) -> list[str]:
    bad = []
    for cmd in inline_commands(path.read_text(encoding="utf-8")):
        err = dualread_error(_concrete(cmd[1:]))
        if err:
            bad.append(f"{' '.join(cmd)}: {err}")
    return bad


# ------------------------------------------------------------------ the tests

@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_command_lines_parse(path: Path) -> None:
    assert command_errors(path) == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_inline_command_lines_parse(path: Path) -> None:
    assert inline_command_errors(path) == []


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "make test" in quick and "make serve" in quick
    assert re.search(r"^make test\s*$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert {"test", "serve"} <= make_targets()


def test_readme_is_a_short_guide() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    assert "docs/method.md §" not in readme                 # the contract is docs/method.md
    for marker in ("<!-- settings:start -->", "<!-- settings:end -->"):
        assert readme.count(marker) == 1


# ------------------------------------------------------------------ the checkers themselves

def test_checkers_catch_what_they_should(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, twice!\n")
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#a-code-heading-twice) [ok](#page)\n"
        "[bad](missing.md) [bad](other.md#nowhere) [web](https://example.org/x)\n"
        "`[not a link](missing-too.md)`\n")
    assert broken_links(page) == ["missing.md: no such file",
                                  "other.md#nowhere: no heading with anchor #nowhere"]

    good = ["fit-heads", "--out", "x", "--data", "easyvqa:test~blur:3"]
    assert dualread_error(list(good)) is None
    assert dualread_error(["--help"]) is None
    assert dualread_error(["serve", "--help"]) is None
    assert "--bogus" in dualread_error(["fit-heads", "--out", "x", "--bogus"])
    assert "no such command" in dualread_error(["fit-head", "--out", "x"])
    assert "unexpected" in dualread_error(["serve", "stray"])

    text = ("```bash\ndualread serve --port 1 &\ntime dualread bench --quick \\\n"
            "  --no-such-flag   # comment\nS=1 dualread evaluate $S --data $D\n```\n")
    cmds = command_lines(text)
    assert cmds == [["dualread", "serve", "--port", "1"],
                    ["dualread", "bench", "--quick", "--no-such-flag"],
                    ["dualread", "evaluate", "$S", "--data", "$D"]]
    assert _concrete(cmds[2][1:]) == ["evaluate", "--data", "X"]
    bad_page = tmp_path / "cmds.md"
    bad_page.write_text(text + "```\nmake no-such-target\npython -m no_such_module_x\n```\n")
    errors = command_errors(bad_page)
    assert len(errors) == 3 and "--no-such-flag" in errors[0]
    assert "no-such-target" in errors[1] and "no_such_module_x" in errors[2]

    table = ("| `dualread probe ccg\\|tgs --url URL [--limit N] --data ...` | ok |\n"
             "| `dualread fit-heads --out DIR [--no-such-flag]` | bad |\n"
             "every `dualread ...` line\n")
    assert inline_commands(table)[0] == ["dualread", "probe", "ccg", "--url", "URL",
                                         "--limit", "N", "--data", "..."]
    table_page = tmp_path / "table.md"
    table_page.write_text(table)
    assert [e.split(": ", 1)[1] for e in inline_command_errors(table_page)] == [
        "No such option: --no-such-flag"]
