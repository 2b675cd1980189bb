"""The `treadle` command line: `run`, `demo`, `show` and `sessions`.

The entry point is `main()` (declared in pyproject as `treadle = "treadle.cli:main"`). Styled
output uses rich when the optional `treadle[cli]` extra is installed; without it the CLI prints
plain text. Nothing outside this package imports it.
"""

from __future__ import annotations

import sys

from treadle.cli.app import build_parser, main
from treadle.cli.failures import EXIT_CODES

__all__ = ["EXIT_CODES", "build_parser", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
