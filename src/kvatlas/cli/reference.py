"""The CLI reference of the documentation site, made from the parsers themselves.

`markdown()` is the page body: `kvatlas --help`, then every subcommand's `--help`, each exactly as
the command prints it at a terminal `WIDTH` columns wide (tests/test_docs_site.py runs the commands
and compares). The site's build hook (docs/hooks/cli_reference.py) puts it where the page
docs/reference/cli.md has its marker, so the reference cannot drift from the code.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from . import COMMANDS, build_parser, command_parser

WIDTH = 100
MARKER = "<!-- kvatlas-cli-reference -->"


@contextmanager
def _columns(width: int):
    """argparse wraps help to $COLUMNS (shutil.get_terminal_size): fix it while formatting."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def help_text(command: str | None = None, width: int = WIDTH) -> str:
    """What `kvatlas [COMMAND] --help` prints at a terminal `width` columns wide."""
    with _columns(width):
        parser = build_parser() if command is None else command_parser(command)[1]
        return parser.format_help()


def markdown(width: int = WIDTH) -> str:
    """Every command's help as one Markdown page body (a section per command)."""
    parts = ["## kvatlas", "", "```text", help_text(None, width).rstrip(), "```", ""]
    for name, (_, summary) in COMMANDS.items():
        parts += [f"## kvatlas {name}", "", summary[0].upper() + summary[1:] + ".", "",
                  "```text", help_text(name, width).rstrip(), "```", ""]
    return "\n".join(parts)
