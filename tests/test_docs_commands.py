"""Every `rlvr` command in the README and docs/ (in code blocks) still parses: the command exists and its
options and arguments are accepted by the CLI as it is now. Nothing is run. A `--set key=value` must also
name a config key that exists (checked against the run config with the default stages)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer import _click as click  # typer 0.29 carries its own click: its exceptions are these
from typer._click.exceptions import UsageError

from rlvr.errors import UserError
from rlvr.flows.cli import app
from rlvr.flows.config import load_config

REPO = Path(__file__).resolve().parent.parent
# docs/index.md is the README copied by `make docs`, which runs beside the suite (it may be half written)
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "index.md")]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def commands(text: str) -> list[str]:
    """The `rlvr ...` command lines of the page's code blocks (continuation lines joined, comments dropped)."""
    found = []
    for block in FENCE.findall(text):
        lines = block.replace("\\\n", " ").splitlines()
        while lines:
            line = lines.pop(0).strip().removeprefix("$ ")
            while lines and not _quotes_closed(line):  # a quoted query spread over several lines
                line += " " + lines.pop(0).strip()
            for prefix in (".venv/bin/rlvr ", "rlvr "):
                if line.startswith(prefix):
                    found.append("rlvr " + line.removeprefix(prefix))
    return found


def _quotes_closed(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return False
    return True


def words(line: str) -> list[str]:
    """The command's words, up to a pipe, a redirection or a comment."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|><;&")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out = []
    for word in lexer:
        if word and set(word) <= set("|><;&"):
            break
        out.append(word)
    return out[1:]


def parse(args: list[str]) -> click.Context:
    """Parse `rlvr ARGS` as the CLI would, without running anything (click raises UsageError when it fails)."""
    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="rlvr")  # the group has no options of its own
    if not args:
        raise UsageError("no command")
    name, command, rest = group.resolve_command(ctx, list(args))  # type: ignore[attr-defined]
    assert command is not None, f"no command {name!r}"
    return command.make_context(name or "", rest, parent=ctx)


CASES = [(page.relative_to(REPO).as_posix(), line) for page in PAGES for line in commands(page.read_text())]


def test_the_docs_have_commands_to_check():
    assert len(CASES) > 60
    assert {page for page, _ in CASES} >= {"README.md", "docs/audit.md", "docs/runs-and-stores.md"}


@pytest.mark.parametrize(("page", "line"), CASES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CASES)])
def test_a_command_in_the_docs_parses(page: str, line: str, monkeypatch: pytest.MonkeyPatch):
    args = words(line)
    if "--help" in args:
        return
    try:
        ctx = parse(args)
    except UsageError as error:
        pytest.fail(f"{page}: `{line}` no longer parses: {error.format_message()}")
    overrides = [value for value in ctx.params.get("set_", []) or []]
    if overrides and "--config" not in args:  # with a config file, keys of its sources' types may be needed
        for name in re.findall(r"api_key_env:\s*(\w+)", " ".join(overrides)):  # the page exports it first
            monkeypatch.setenv(name, "a key the docs tell the reader to export")
        try:
            load_config(None, overrides)
        except UserError as error:
            pytest.fail(f"{page}: `{line}`: {error}")


def test_a_wrong_command_fails_the_check():
    with pytest.raises(UsageError):
        parse(words("rlvr run --stor ./x"))
    with pytest.raises(UsageError):
        parse(words("rlvr no-such-command"))
    assert parse(words('rlvr query "SELECT 1" --store ./s # a comment')).params["store"] == "./s"
