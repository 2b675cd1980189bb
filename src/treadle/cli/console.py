"""Terminal output of the command line: rich when it is installed and stdout is a terminal.

Everything the CLI prints goes through a `Console`, which writes styled text with `rich` (the
optional `treadle[cli]` dependency) or plain text otherwise. Model, tool and transcript text is
printed here too, so every string is passed through `treadle.cli.terminal_text.visible` (control
characters shown, never obeyed) unless the console is `raw` (`treadle --raw`). This module must
never import rich at module level: the CLI has to work, in plain text, where rich is not
installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import IO, Any, Literal

from treadle.cli.terminal_text import visible

__all__ = ["ColorMode", "Console", "ConsoleProgress", "make_console"]

ColorMode = Literal["auto", "always", "never"]

#: Style names used by the CLI, mapped to rich styles (plain output ignores them).
STYLES: dict[str, str] = {
    "dim": "dim",
    "tool": "bold cyan",
    "ok": "green",
    "error": "bold red",
    "warn": "yellow",
    "user": "bold",
    "assistant": "",
    "heading": "bold magenta",
    "summary": "bold",
}


def _rich_available() -> bool:
    try:
        return importlib.util.find_spec("rich") is not None
    except (ImportError, ValueError):  # a stubbed-out `rich` in sys.modules
        return False


def _markup_escaped(text: str) -> str:
    """`text` for a rich markup template (the progress label), read as plain text."""
    from rich.markup import escape

    return escape(text)


class ConsoleProgress:
    """A progress display over `total` steps: a rich bar, or a few plain lines."""

    def __init__(self, console: Console, total: int, label: str) -> None:
        self._console = console
        self._total = max(total, 1)
        self._label = visible(label)
        self._done = 0
        self._last_tenth = -1
        self._rich: Any = None
        self._task: Any = None
        if console.rich is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console.rich,
                transient=False,
            )
            self._task = self._rich.add_task(_markup_escaped(self._label), total=total)

    def __enter__(self) -> ConsoleProgress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._rich is not None:
            self._rich.stop()

    def describe(self, label: str) -> None:
        """Change the label shown before the bar (e.g. a running pass rate)."""
        self._label = visible(label)
        if self._rich is not None:
            self._rich.update(self._task, description=_markup_escaped(self._label))

    def advance(self, steps: int = 1) -> None:
        """Record `steps` more finished steps."""
        self._done += steps
        if self._rich is not None:
            self._rich.update(self._task, completed=self._done)
            return
        # Plain output (logs, pipes): one line per tenth, not one per step.
        tenth = self._done * 10 // self._total
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self._console.line(f"{self._label}: {self._done}/{self._total}", "dim")


class Console:
    """Writes the CLI's output; `rich` is a rich console, or None for plain text."""

    def __init__(self, out: IO[str], rich_console: Any = None, *, raw: bool = False) -> None:
        self.out = out
        self.rich: Any = rich_console
        self.raw = raw
        """True to print text byte for byte (control characters reach the terminal)."""

    def _safe(self, text: str) -> str:
        return text if self.raw else visible(text)

    @property
    def styled(self) -> bool:
        """True when output is styled (rich on a terminal, or forced with --color always)."""
        return self.rich is not None

    def write(self, text: str, style: str = "") -> None:
        """Write `text` without a newline (streamed model text)."""
        if not text:
            return
        text = self._safe(text)
        if self.rich is not None:
            self.rich.print(text, style=STYLES.get(style, style), end="", markup=False,
                            highlight=False, soft_wrap=True)  # fmt: skip
        else:
            self.out.write(text)
        self.out.flush()

    def line(self, text: str = "", style: str = "") -> None:
        """Write one line."""
        text = self._safe(text)
        if self.rich is not None:
            self.rich.print(text, style=STYLES.get(style, style), markup=False, highlight=False,
                            soft_wrap=True)  # fmt: skip
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def table(self, headers: list[str], rows: list[list[str]]) -> None:
        """A table: rich's, or aligned plain columns."""
        headers = [self._safe(h) for h in headers]
        rows = [[self._safe(c) for c in row] for row in rows]
        if self.rich is not None:
            from rich.table import Table
            from rich.text import Text

            # Text cells are plain text: rich parses a str cell as markup, so a session id like
            # "[link=https://...]" would print an OSC 8 link and "[conceal]" hidden text.
            table = Table(box=None, header_style="bold")
            for header in headers:
                no_wrap = header in ("id", "path")
                table.add_column(Text(header), no_wrap=no_wrap, overflow="fold")
            for row in rows:
                table.add_row(*(Text(cell) for cell in row))
            self.rich.print(table)
            return
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        for cells in [headers, *rows]:
            text = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
            self.out.write(text.rstrip())
            self.out.write("\n")
        self.out.flush()

    def progress(self, total: int, label: str) -> ConsoleProgress:
        """A progress display for `total` steps (use as a context manager)."""
        return ConsoleProgress(self, total, label)


def make_console(
    color: ColorMode = "auto", out: IO[str] | None = None, *, raw: bool = False
) -> Console:
    """A console for `out` (stdout): styled with rich when `color` and the terminal allow;
    `raw` prints text with its control characters (see `Console.raw`)."""
    stream = out if out is not None else sys.stdout
    if color == "never" or not _rich_available():
        return Console(stream, raw=raw)
    if color == "auto" and (os.environ.get("NO_COLOR") or not stream.isatty()):
        return Console(stream, raw=raw)
    from rich.console import Console as RichConsole

    rich_console = RichConsole(file=stream, force_terminal=color == "always" or None)
    return Console(stream, rich_console, raw=raw)
