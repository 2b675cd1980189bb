"""The user's own code named on the command line (`--agent`, `--scorer` as `module:attribute`).

An exception raised while importing that module or calling its factory is an error in the
user's file, not in Treadle: it is reported with the file and line it was raised at and the
user's part of the traceback, and exits as a usage error (2), never as "a bug in Treadle".
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.cli.failures import EXIT_CODES, CliFailure

__all__ = ["call_user_code", "load_object"]

# Frames of the import machinery and of Treadle itself are not the user's: left out of the
# traceback shown, so it starts at their module.
_NOT_USER = (
    "<frozen importlib",
    os.path.dirname(importlib.__file__ or ""),
    str(Path(__file__).resolve().parent.parent),
)


def load_object(spec: str, what: str) -> Any:
    """The object named by `module:attribute` (dots allowed in both parts)."""
    module_name, sep, attr = spec.partition(":")
    if not (module_name and sep and attr):
        raise CliFailure(
            f"{what} {spec!r} is not module:attribute",
            f"name it like mypkg.agents:solver (a module importable from {Path.cwd()}).",
            EXIT_CODES["usage"],
        )
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (
            module_name == err.name or module_name.startswith(err.name + ".")
        ):
            raise _user_error(err, f"{what} module {module_name!r}") from None
        raise CliFailure(
            f"cannot load {what} {spec!r}: no module named {err.name!r} under {Path.cwd()}",
            f"run treadle from the directory that holds {module_name.split('.')[0]}(.py), or "
            "add that directory to PYTHONPATH.",
            EXIT_CODES["usage"],
        ) from None
    except Exception as err:  # the user's module failed while it ran
        raise _user_error(err, f"{what} module {module_name!r}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliFailure(
                f"cannot load {what} {spec!r}: {module_name} has no attribute {part!r}",
                f"check the name after the colon (defined in {_file_of(module_name)}).",
                EXIT_CODES["usage"],
            ) from None
    return obj


def call_user_code(function: Callable[[], Any], what: str) -> Any:
    """`function()`, the user's own factory: an exception in it is reported in their terms."""
    try:
        return function()
    except Exception as err:
        raise _user_error(err, what) from None


def _file_of(module_name: str) -> str:
    module = sys.modules.get(module_name)
    return str(getattr(module, "__file__", None) or module_name)


def _user_error(err: Exception, what: str) -> CliFailure:
    """Print the user's part of the traceback; the failure names the file and line it ends at."""
    frames = [
        f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_NOT_USER)
    ]
    if frames:
        print("Traceback (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_list(frames)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(err)), end="", file=sys.stderr)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if isinstance(err, SyntaxError) and err.filename:
        where = f" at {err.filename}:{err.lineno}"
    message = str(err) or type(err).__name__
    return CliFailure(
        f"{what} raised {type(err).__name__}{where}: {message}",
        "this is an error in your code, not in Treadle: fix it where the traceback above ends, "
        "then rerun the same command.",
        EXIT_CODES["usage"],
    )
