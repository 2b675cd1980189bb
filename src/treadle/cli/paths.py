"""Checks of the files and directories `show`, `sessions` and `eval` name, before their imports.

`treadle.evals` pulls in the agents and the loop (most of a second on a busy machine), so a
missing file or a transcript of the wrong kind is reported from here first, with only the
standard library loaded: one line of cause, one of fix, exit 2. Like `treadle.cli.preflight`
for `run`, this module imports nothing heavier than `treadle.cli.failures`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from treadle.cli.failures import EXIT_CODES, CliFailure

__all__ = [
    "EVAL_LOG_DIR",
    "SCORER_WORDS",
    "check_eval_dataset",
    "check_eval_log",
    "check_object_spec",
    "check_session_dir",
    "check_session_file",
    "is_eval_log",
    "is_other_jsonl",
]

#: Where `treadle eval` writes its logs by default (kept equal to `treadle.cli.eval`'s).
EVAL_LOG_DIR = Path(".treadle") / "evals"
#: The scorers `--scorer` takes by name.
SCORER_WORDS = ("exact", "contains")
# A header line is short; reading a bounded prefix keeps a huge or binary file cheap to test.
_HEADER_BYTES = 1 << 20


def is_eval_log(path: Path) -> bool:
    """True when the first line of `path` is an eval log's header (it has a `config_hash`)."""
    try:
        with path.open("rb") as f:
            first = f.readline(_HEADER_BYTES)
    except OSError:
        return False
    try:
        header = json.loads(first)
    except ValueError:
        return False
    return isinstance(header, dict) and header.get("type") == "header" and "config_hash" in header


def _first_line_kind(path: Path) -> str | None:
    """`"eval"`, `"session"` or `"other"` by the first line's JSON; None when it does not
    parse (empty, damaged, not JSONL): the reader reports those, with the line."""
    try:
        with path.open("rb") as f:
            first = f.readline(_HEADER_BYTES)
        header = json.loads(first)
    except (OSError, ValueError):
        return None
    if isinstance(header, dict) and header.get("type") == "header":
        if "config_hash" in header:
            return "eval"
        if "session_id" in header:
            return "session"
    return "other"


def is_other_jsonl(path: Path) -> bool:
    """True when the first line of `path` is JSON but not a session transcript's header: an
    eval log, a dataset, any other JSONL. `treadle sessions` leaves those out; a file whose first
    line does not parse (empty, damaged) is kept, so a broken transcript still shows up."""
    try:
        with path.open("rb") as f:
            first = f.readline(_HEADER_BYTES)
    except OSError:
        return False
    if not first.strip():
        return False
    try:
        header = json.loads(first)
    except ValueError:
        return False
    return not (
        isinstance(header, dict)
        and header.get("type") == "header"
        and "session_id" in header
        and "config_hash" not in header
    )


def check_session_file(path: Path) -> None:
    """Refuse a `treadle show` path that is missing or is an eval log, naming what to type."""
    if not path.is_file():
        raise CliFailure(
            f"No session file at {path}.", "list them with `treadle sessions`.", EXIT_CODES["usage"]
        )
    if is_eval_log(path):
        raise CliFailure(
            f"{path} is an eval log, not a session transcript.",
            f"this is an eval log: `treadle eval report {path}` writes its HTML report.",
            EXIT_CODES["usage"],
        )


def check_session_dir(directory: Path | None) -> None:
    """Refuse a `treadle sessions DIR` that is not a directory."""
    if directory is not None and not directory.is_dir():
        raise CliFailure(
            f"No directory {directory}.",
            "pass an existing directory, or none for .treadle/sessions.",
            EXIT_CODES["usage"],
        )


def check_eval_log(path: Path) -> None:
    """Refuse an eval log path (of `eval report` / `eval compare`) that is not a file."""
    if not path.is_file():
        raise CliFailure(
            f"no evaluation log at {path}.",
            f"pass the log `treadle eval` wrote (by default in {EVAL_LOG_DIR}/; "
            f"`ls {EVAL_LOG_DIR}` lists them).",
            EXIT_CODES["usage"],
        )
    kind = _first_line_kind(path)
    if kind == "session":
        raise CliFailure(
            f"{path} is a session transcript, not an evaluation log.",
            f"render it with `treadle show {path}`; eval logs are in `{EVAL_LOG_DIR}/` by default.",
            EXIT_CODES["usage"],
        )
    if kind == "other":
        raise CliFailure(
            f"{path} is not an evaluation log (its first line is no eval log header).",
            f"pass the log `treadle eval` wrote (`ls {EVAL_LOG_DIR}` lists them); a dataset runs "
            f"with `treadle eval {path} --agent module:attribute`.",
            EXIT_CODES["usage"],
        )


def check_eval_dataset(dataset: Path, agent: str, scorer: str = "exact") -> None:
    """Refuse a missing dataset, an `--agent` that is not `module:attribute` and a `--scorer`
    that is neither a built-in name nor `module:attribute`."""
    if not dataset.is_file():
        raise CliFailure(
            f"no dataset file at {dataset}.",
            "pass a JSONL file with one {id, input, expected} object per line.",
            EXIT_CODES["usage"],
        )
    kind = _first_line_kind(dataset)
    if kind == "eval":
        raise CliFailure(
            f"{dataset} is an eval log, not a dataset.",
            f"`treadle eval report {dataset}` writes its report; a dataset has one "
            "{id, input, expected} object per line.",
            EXIT_CODES["usage"],
        )
    if kind == "session":
        raise CliFailure(
            f"{dataset} is a session transcript, not a dataset.",
            f"render it with `treadle show {dataset}`; a dataset has one {{id, input, expected}} "
            "object per line.",
            EXIT_CODES["usage"],
        )
    check_object_spec(agent, "agent")
    if scorer not in SCORER_WORDS and ":" not in scorer:
        import difflib

        close = difflib.get_close_matches(scorer, SCORER_WORDS, n=1, cutoff=0.5)
        guess = f"did you mean --scorer {close[0]}? " if close else ""
        raise CliFailure(
            f"--scorer {scorer!r} is neither a built-in scorer (exact, contains) nor "
            "module:attribute.",
            f"{guess}pass --scorer exact (the default: the answer equals the expected value), "
            "--scorer contains (the answer contains it), or --scorer mymodule:myscorer.",
            EXIT_CODES["usage"],
        )
    if scorer not in SCORER_WORDS:
        check_object_spec(scorer, "scorer")


def check_object_spec(spec: str, what: str) -> None:
    """Refuse an `--agent` / `--scorer` that is not `module:attribute`; a file path
    (`./myagent.py:agent`) is answered with the module name to type instead."""
    module_name, sep, attr = spec.partition(":")
    if module_name and sep and attr and not _looks_like_a_file(module_name):
        _check_module_found(spec, what, module_name)
        return
    if sep and attr and _looks_like_a_file(module_name):
        path = Path(module_name)
        parts = [p for p in path.with_suffix("").parts if p not in (".", "")]
        if path.is_absolute() or ".." in parts:
            where = f"run treadle from the directory that holds {path.name} and pass"
            module = path.stem
        else:
            where = "pass"
            module = ".".join(parts)
        raise CliFailure(
            f"--{what} {spec!r} is a file path; --{what} takes a module name, like python -m.",
            f"{where} --{what} {shlex.quote(f'{module}:{attr}')} (no ./ and no .py; the module "
            "is imported from the current directory).",
            EXIT_CODES["usage"],
        )
    raise CliFailure(
        f"{what} {spec!r} is not module:attribute.",
        f"name it like mypkg.agents:solver (a module importable from {Path.cwd()}).",
        EXIT_CODES["usage"],
    )


def _check_module_found(spec: str, what: str, module_name: str) -> None:
    """Refuse a module whose top-level package is nowhere on the path, before `treadle.evals`
    loads (most of a second); a found one is imported later, its errors reported there."""
    import importlib.util
    import sys

    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `treadle.cli.user_code.load_object` imports
    top = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return  # let the import say what is wrong
    if not found:
        raise CliFailure(
            f"cannot load {what} {spec!r}: no module named {top!r} under {Path.cwd()}",
            f"run treadle from the directory that holds {top}(.py), or add that directory to "
            "PYTHONPATH.",
            EXIT_CODES["usage"],
        )


def _looks_like_a_file(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name or "\\" in module_name
