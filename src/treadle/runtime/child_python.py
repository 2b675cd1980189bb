"""The command line of a Python child process that runs Treadle's own code, isolated.

`python -m treadle.x` puts the current directory first on `sys.path` (and honours `PYTHONPATH`,
`PYTHONSTARTUP`-style variables and the user's site directory), so a `treadle/` package in the
parent's working directory would run in its place, with the parent's rights. The working
directory can be one a sandbox wrote into (an exported workspace), and the parent can be root.
So Treadle starts its helpers with `python -I -c`: no current directory, no `PYTHON*`
variables, no user site, and the directory holding *this* installed `treadle` package put first
on `sys.path` by its absolute path. The entry point is named as a function, not run as a module,
so a module the package already imported is not executed a second time (which `-m` warns about).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["package_parent", "python_child_argv"]


def package_parent() -> str:
    """The absolute directory holding the `treadle` package this process imported."""
    return str(Path(__file__).resolve().parents[2])


def python_child_argv(module: str, function: str, *args: str) -> list[str]:
    """argv running `module.function(list_of_args)` in a fresh isolated interpreter (`-I`),
    importing `module` from this installed Treadle only; the child exits with the function's
    return value (an int, or None for 0)."""
    code = (
        "import sys; "
        f"sys.path.insert(0, {package_parent()!r}); "
        f"from {module} import {function} as entry; "
        "sys.exit(entry(sys.argv[1:]))"
    )
    return [sys.executable, "-I", "-c", code, *args]
