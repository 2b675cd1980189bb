"""The `treadle` command line: `run`, `demo`, `show` and `sessions`.

The entry point is `main()` (declared in pyproject as `treadle = "treadle.cli:main"`). Styled
output uses rich when the optional `treadle[cli]` extra is installed; without it the CLI prints
plain text. Nothing outside this package imports it.

This module stays tiny and imports the command's code only inside `main`'s try: a Ctrl-C in
the first tenths of a second of start-up (while `treadle.cli.app` loads) ends with exit code 130
and one line, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.cli.app import build_parser
    from treadle.cli.failures import EXIT_CODES

__all__ = ["EXIT_CODES", "build_parser", "main"]

# Exit code of an interrupted command (`EXIT_CODES["interrupted"]`, without importing it first).
_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `treadle` command with `argv` (default: `sys.argv[1:]`); returns the exit code."""
    try:
        from treadle.cli.app import main as run_main

        return run_main(argv)
    except KeyboardInterrupt:
        print("treadle: interrupted.", file=sys.stderr)
        return _INTERRUPTED


def __getattr__(name: str) -> Any:
    if name == "build_parser":
        from treadle.cli.app import build_parser

        return build_parser
    if name == "EXIT_CODES":
        from treadle.cli.failures import EXIT_CODES

        return EXIT_CODES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
