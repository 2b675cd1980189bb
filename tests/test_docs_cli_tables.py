"""The docs cannot drift from the command line, and every page is reachable from the home page.

Commands and flags are read from the parser that `--help` prints (every subcommand's, the
`eval report` / `eval compare` ones included), not from a list kept here: a flag added to the
CLI fails this test until docs/getting-started.md's table for its command names it. A table is
the one after the line ``Flags of `treadle COMMAND`...``. Pages are reached from docs/index.md by
following the links between pages.
"""

from __future__ import annotations

import argparse
import re
from collections import deque
from pathlib import Path

from treadle.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "getting-started.md"
TABLE_TITLE = re.compile(r"^Flags of `(?P<command>treadle[^`]*)`")
LINK = re.compile(r"\]\((?P<target>[^)#\s]+\.md)(?:#[^)]*)?\)")


def _commands() -> dict[str, list[str]]:
    """`treadle ...` command -> the long and short flags its `--help` lists (not -h/--help)."""
    parser = build_parser()
    found: dict[str, list[str]] = {}

    def visit(p: argparse.ArgumentParser) -> None:
        flags = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in dict.fromkeys(action.choices.values()):
                    visit(sub)
            elif action.option_strings and action.help != argparse.SUPPRESS:
                flags += [s for s in action.option_strings if s not in ("-h", "--help")]
        found[p.prog] = flags

    visit(parser)
    return found


def _tables(page: Path) -> dict[str, str]:
    """Each `Flags of `treadle X`` table of `page`, by command, as its raw text."""
    tables: dict[str, str] = {}
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        title = TABLE_TITLE.match(line)
        if title is None:
            continue
        body = []
        for following in lines[i + 1 :]:
            if following.startswith("|"):
                body.append(following)
            elif body or following.strip():
                break
        tables[title["command"]] = "\n".join(body)
    return tables


def _command_table(page: Path) -> str:
    text = page.read_text()
    start = text.index("| command | what it does |")
    end = text.find("\n\n", start)
    return text[start : end if end != -1 else None]


def test_every_command_is_in_the_command_table() -> None:
    table = _command_table(CLI_PAGE)
    missing = [
        f"`{command}` is missing from the command table of {CLI_PAGE.relative_to(ROOT)} "
        f"(add a row | `{command} ...` | what it does |)"
        for command in _commands()
        if command != "treadle" and not re.search(rf"`{re.escape(command)}(?![\w-])", table)
    ]
    assert not missing, "\n".join(missing)


def test_every_flag_in_help_is_in_its_commands_table() -> None:
    tables = _tables(CLI_PAGE)
    missing = []
    for command, flags in _commands().items():
        table = tables.get(command)
        if table is None:
            if flags:
                missing.append(
                    f"{CLI_PAGE.relative_to(ROOT)} has no table 'Flags of `{command}`:' for "
                    f"{', '.join(flags)} (shown by `{command} --help`)"
                )
            continue
        missing += [
            f"`{flag}` (shown by `{command} --help`) is missing from the table 'Flags of "
            f"`{command}`' in {CLI_PAGE.relative_to(ROOT)}"
            for flag in flags
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", table)
        ]
    assert not missing, "\n".join(missing)


def test_every_table_names_a_real_command() -> None:
    commands = _commands()
    stale = [command for command in _tables(CLI_PAGE) if command not in commands]
    assert not stale, f"tables for commands the CLI does not have: {stale}"


def _links(page: Path) -> set[Path]:
    return {
        (page.parent / match["target"]).resolve()
        for match in LINK.finditer(page.read_text())
        if "://" not in match["target"]
    }


def test_every_page_is_reachable_from_the_home_page() -> None:
    home = (DOCS / "index.md").resolve()
    seen = {home}
    queue = deque([home])
    while queue:
        for target in _links(queue.popleft()):
            if target.is_relative_to(DOCS.resolve()) and target.is_file() and target not in seen:
                seen.add(target)
                queue.append(target)
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    unreachable = sorted(str(p.relative_to(DOCS.resolve())) for p in pages - seen)
    assert not unreachable, (
        f"pages no link path from docs/index.md reaches: {unreachable} (link them from "
        "docs/index.md, or from a page it links)"
    )


def test_the_home_page_links_every_top_level_page() -> None:
    linked = _links(DOCS / "index.md")
    pages = sorted(p for p in DOCS.glob("*.md") if p.name != "index.md")
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link {missing}: add a line for each"


def _exit_code_table(page: Path) -> dict[int, str]:
    """The `| exit code | meaning | example |` table of `page`: code -> its row."""
    text = page.read_text()
    start = text.index("| exit code | meaning |")
    end = text.find("\n\n", start)
    rows = text[start : end if end != -1 else None].splitlines()[2:]
    return {int(row.split("|")[1]): row for row in rows}


def test_the_exit_code_table_matches_the_cli() -> None:
    from treadle.cli.failures import EXIT_CODES

    table = _exit_code_table(CLI_PAGE)
    assert sorted(table) == sorted(EXIT_CODES.values())
    # An MCP server that cannot be reached or does not answer is 4, one that cannot start is 2
    # (treadle/cli/mcp_tools.py): every page that gives an MCP exit code says the same.
    assert "MCP server" in table[EXIT_CODES["connection"]]
    mcp_lines = [
        (page.name, line)
        for page in sorted(DOCS.glob("*.md"))
        for line in page.read_text().split("\n\n")
        if "MCP" in line and re.search(r"(exit|exits with) code", line)
    ]
    checked = 0
    for name, paragraph in mcp_lines:
        flat = " ".join(paragraph.split())
        for said in re.finditer(
            r"(cannot start|not answer|cannot be reached)[^.|]*?code (\d)", flat
        ):
            wanted = EXIT_CODES["usage"] if said[1] == "cannot start" else EXIT_CODES["connection"]
            assert int(said[2]) == wanted, f"{name}: {said[0]!r}"
            checked += 1
    assert checked >= 4  # both pages, both cases
