"""The `treadle` command: argument parsing and dispatch to the subcommands.

`main()` turns every failure into one line of cause and one of fix on stderr and a documented
exit code (see `treadle.cli.failures.EXIT_CODES`); it never lets a traceback reach the user unless
`TREADLE_DEBUG=1` is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from treadle import __version__
from treadle.cli.arg_types import count as _count
from treadle.cli.arg_types import json_object as _json_object
from treadle.cli.arg_types import milliseconds as _milliseconds
from treadle.cli.arg_types import positive_int as _positive_int
from treadle.cli.console import make_console
from treadle.cli.failures import EXIT_CODES, explain, print_failure
from treadle.cli.flag_hints import unknown_flag_fix
from treadle.cli.status import StatusLine

__all__ = ["build_parser", "main"]

# The error paths (a bad flag, a missing key, a URL without a scheme) print before the pass's
# imports: asyncio, httpx and pydantic load only once a pass is about to run
# (tests/test_cli_startup.py keeps them out).


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors name the command, suggest a flag and say where the
    flags are listed (`treadle run --help`), in the CLI's `error:` / `fix:` form. Abbreviated
    flags are not taken (`--base-ur` is an error with `did you mean --base-url?`): a prefix that
    works today would silently change meaning when a longer flag is added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        known = [s for a in self._actions for s in a.option_strings]
        fix = unknown_flag_fix(self.prog, message, known)
        self.exit(EXIT_CODES["usage"], f"{self.prog}: error: {message}\n{self.prog}: fix: {fix}\n")


class _McpServerAction(argparse.Action):
    """`--mcp` / `--mcp-url`: appended to its list, and remembered as the server that a
    following `--mcp-prefix` names."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        items = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, items)
        namespace.mcp_last = (self.dest, len(items) - 1)


class _McpPrefixAction(argparse.Action):
    """`--mcp-prefix NAME`: the prefix of the tools of the `--mcp` / `--mcp-url` just before."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        last = getattr(namespace, "mcp_last", None)
        if last is None:
            parser.error(
                "--mcp-prefix names the tools of the --mcp or --mcp-url before it; put it after "
                'one, e.g. --mcp "mcp-server-git" --mcp-prefix git'
            )
        if not values or not isinstance(values, str):
            parser.error("--mcp-prefix needs a non-empty name, e.g. --mcp-prefix git")
        prefixes = dict(getattr(namespace, self.dest, None) or {})
        prefixes[last] = values
        setattr(namespace, self.dest, prefixes)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `treadle` and its subcommands."""
    parser = _Parser(
        prog="treadle",
        description="Run LLM agent passes from the shell, and read their transcripts.",
        epilog="Configuration: OPENAI_API_KEY, OPENAI_BASE_URL, TREADLE_MODEL (or the flags).",
    )
    parser.add_argument("--version", action="version", version=f"treadle {__version__}")
    parser.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="styled output with rich: auto (when a terminal), always or never",
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        help="print model and tool text byte for byte (by default control characters are "
        "shown as ^[ and the like, so a reply cannot drive your terminal)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run one pass against the configured endpoint")
    run.add_argument("prompt", help="the user message")
    run.add_argument("--system", help="the agent's system prompt")
    run.add_argument("--model", help="model name (default: $TREADLE_MODEL)")
    run.add_argument("--base-url", help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL)")
    run.add_argument(
        "--api-key",
        metavar="KEY",
        help="API key (default: $OPENAI_API_KEY; prefer the variable: a flag shows in `ps`)",
    )
    run.add_argument(
        "--sandbox",
        metavar="local|isolated|DIR",
        help="give the model a workspace: a temporary one (local), one whose commands run in a "
        "bubblewrap box (isolated), or a directory",
    )
    run.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the reply as it is generated (default: on)",
    )
    run.add_argument(
        "--persist", action="store_true", help="write the transcript to .treadle/sessions/"
    )
    run.add_argument("--max-steps", type=_positive_int, help="tool rounds before stopping")
    run.add_argument("--retries", type=_count, help="retries of a failed request (default 3)")
    run.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="seconds to wait for the endpoint: to connect, and between two reads of a reply "
        "(default: 10 to connect, 600 between reads); also bounds an MCP server's start",
    )
    run.add_argument(
        "--extra-body",
        type=_json_object,
        metavar="JSON",
        help="fields merged into every request body, e.g. '{\"top_k\": 20}' (vLLM, llama.cpp)",
    )
    run.add_argument(
        "--json", action="store_true", help="print the output session as JSON, nothing else"
    )
    run.add_argument(
        "--mcp",
        action=_McpServerAction,
        default=[],
        metavar="COMMAND",
        help="give the model the tools of an MCP server run as COMMAND (stdio; repeatable), "
        'e.g. --mcp "mcp-server-time"',
    )
    run.add_argument(
        "--mcp-url",
        action=_McpServerAction,
        default=[],
        metavar="URL",
        help="give the model the tools of an MCP server at URL (streamable HTTP; repeatable)",
    )
    run.add_argument(
        "--mcp-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds an MCP server may take to start and list its tools (default: --timeout, "
        "else 30)",
    )
    run.add_argument(
        "--mcp-prefix",
        action=_McpPrefixAction,
        default={},
        metavar="NAME",
        help="name the tools of the --mcp or --mcp-url just before as NAME_tool (keeps two "
        "servers' tools apart)",
    )

    demo = sub.add_parser("demo", help="run the offline demo (fake server, real sandbox)")
    demo.add_argument(
        "--fanout", type=_count, default=100, help="passes in the fan-out part (default 100)"
    )
    demo.add_argument(
        "--latency-ms", type=_milliseconds, default=50.0, help="fake model latency (default 50)"
    )
    demo.add_argument(
        "--no-persist", action="store_true", help="do not write the first pass's transcript"
    )
    demo.add_argument(
        "--local-model", action="store_true", help="run the demo on a small local model instead"
    )

    show = sub.add_parser("show", help="render a persisted transcript (.jsonl or store:KEY)")
    show.add_argument("file", type=Path)
    show.add_argument("--store", help="the store of a store:KEY (default: $TREADLE_STORE)")
    show.add_argument(
        "--follow", "-f", action="store_true", help="tail a live file until it closes"
    )

    _add_eval_parsers(sub)

    sessions = sub.add_parser("sessions", help="list persisted sessions")
    sessions.add_argument("directory", nargs="?", type=Path, help="default: .treadle/sessions")
    sessions.add_argument("--json", action="store_true", help="print the list as JSON")
    sessions.add_argument(
        "--store", help="list a conversation store (sqlite:///x.db, postgresql://)"
    )
    sessions.add_argument(
        "--import", dest="imports", action="append", type=Path, default=[],
        help="with --store: import a .jsonl file (or a directory of them)",
    )  # fmt: skip
    sessions.add_argument(
        "--skip-existing", action="store_true",
        help="with --import: leave files whose key the store already has (re-run an import)",
    )  # fmt: skip
    sessions.add_argument("--export", type=Path, help="with --store: write each conversation here")
    return parser


# `treadle eval report LOG` and `treadle eval compare A B` share the `eval` word with
# `treadle eval DATASET`; main() rewrites them to these commands before parsing.
_EVAL_SUBCOMMANDS = {"report": "eval-report", "compare": "eval-compare"}


def _add_eval_parsers(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="run an agent over a dataset, scored and logged (also: eval report, eval compare)",
        description="Run an agent over a JSONL dataset; resumes --log when it exists. "
        "`treadle eval report LOG` writes an HTML report; `treadle eval compare A B` diffs logs.",
    )
    ev.add_argument("dataset", type=Path, help="JSONL file: one {id, input, expected} per line")
    ev.add_argument("--agent", required=True, help="module:attribute of a treadle Agent")
    ev.add_argument(
        "--scorer", default="exact", help="exact, contains, or module:attribute of a scorer"
    )
    ev.add_argument("--samples", type=_positive_int, default=1, help="samples per item (k)")
    ev.add_argument("--concurrency", type=_positive_int, default=64, help="passes in flight")
    ev.add_argument("--backend", choices=["local", "process", "ray"], default="local")
    ev.add_argument("--workers", type=_positive_int, help="worker processes (process/ray)")
    ev.add_argument("--log", type=Path, help="results log (default .treadle/evals/NAME.jsonl)")
    ev.add_argument("--sandbox", action="store_true", help="a workspace per sample")
    ev.add_argument(
        "--retries", type=_count, default=3, help="reruns after infrastructure failures"
    )
    ev.add_argument("--timeout", type=float, help="seconds one sample may run")
    # No `help=`: `treadle --help` lists these under `eval` (as `eval report`, `eval compare`).
    report = sub.add_parser(
        "eval-report",
        prog="treadle eval report",
        description="Write the HTML report of an eval log.",
    )
    report.add_argument("log", type=Path)
    report.add_argument("--out", type=Path, help="default: the log's path with .html")
    comp = sub.add_parser(
        "eval-compare",
        prog="treadle eval compare",
        description="Compare two eval logs item by item.",
    )
    comp.add_argument("before", type=Path)
    comp.add_argument("after", type=Path)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from treadle.cli import preflight
        from treadle.cli.failures import CliFailure

        if not args.prompt.strip():
            raise CliFailure(
                "The prompt is empty.",
                'pass the message to send, e.g. treadle run "Say hello".',
                EXIT_CODES["usage"],
            )

        # Configuration errors print before the pass's imports and before rich loads (on a
        # terminal): see the comment at the top of this module.
        preflight.check_endpoint(model=args.model, base_url=args.base_url, api_key=args.api_key)
        preflight.check_limits(
            timeout=args.timeout,
            retries=args.retries,
            max_steps=args.max_steps,
            mcp_timeout=args.mcp_timeout,
        )
        preflight.check_mcp_urls(args.mcp_url)
        preflight.check_sandbox(args.sandbox)
    _check_paths(args)
    console = make_console(args.color, raw=args.raw)
    if args.command == "run":
        # Say so before the runtime's imports (most of a second on a busy machine): the screen
        # is never blank while treadle works. asyncio, httpx and pydantic load after this line.
        status = None if args.json else StatusLine(console.out)
        if status is not None:
            status.set("starting")
        from treadle.cli.run import RunOptions, run_command

        prefixes = args.mcp_prefix
        opts = RunOptions(
            prompt=args.prompt,
            system=args.system,
            model=args.model,
            base_url=args.base_url,
            api_key=args.api_key,
            sandbox=args.sandbox,
            stream=args.stream,
            persist=args.persist,
            max_steps=args.max_steps,
            json=args.json,
            retries=args.retries,
            timeout=args.timeout,
            extra_body=args.extra_body,
            mcp=tuple(args.mcp),
            mcp_urls=tuple(args.mcp_url),
            mcp_timeout=args.mcp_timeout,
            mcp_prefixes=(
                *(prefixes.get(("mcp", i)) for i in range(len(args.mcp))),
                *(prefixes.get(("mcp_url", i)) for i in range(len(args.mcp_url))),
            ),
        )
        return run_command(opts, console, status=status)
    if args.command == "demo":
        import asyncio

        from treadle.cli.demo import demo_command, local_model_command

        if args.local_model:
            return local_model_command(console)
        return asyncio.run(
            demo_command(
                console,
                fanout=args.fanout,
                latency_ms=args.latency_ms,
                persist=not args.no_persist,
            )
        )
    if args.command == "show" and str(args.file).startswith("store:"):
        from treadle.cli.stores import show_stored

        return show_stored(str(args.file), args.store, console)
    if args.command == "show":
        from treadle.cli.show import show_command

        return show_command(args.file, console, follow=args.follow)
    if args.command == "eval":
        from treadle.cli.eval import EvalOptions, eval_command

        return eval_command(
            EvalOptions(
                dataset=args.dataset,
                agent=args.agent,
                scorer=args.scorer,
                samples=args.samples,
                concurrency=args.concurrency,
                backend=args.backend,
                log=args.log,
                sandbox=args.sandbox,
                retries=args.retries,
                timeout=args.timeout,
                workers=args.workers,
            ),
            console,
        )
    if args.command == "eval-report":
        from treadle.cli.eval import report_command

        return report_command(args.log, args.out, console)
    if args.command == "eval-compare":
        from treadle.cli.eval import compare_command

        return compare_command(args.before, args.after, console)
    if args.command == "sessions" and (args.store or args.imports or args.export):
        from treadle.cli.stores import store_sessions_command

        return store_sessions_command(
            args.store, console, as_json=args.json, imports=args.imports, export=args.export,
            skip_existing=args.skip_existing,
        )  # fmt: skip
    if args.command == "sessions":
        from treadle.cli.show import sessions_command

        return sessions_command(args.directory, console, as_json=args.json)
    raise AssertionError(f"unhandled command {args.command!r}")  # pragma: no cover


def _check_paths(args: argparse.Namespace) -> None:
    """The files and directories a command names, checked before `treadle.evals` (agents and
    the loop) or the transcript reader load: a missing path prints its line at once."""
    from treadle.cli import paths

    if args.command == "show" and not str(args.file).startswith("store:"):
        paths.check_session_file(args.file)
    elif args.command == "sessions" and not (args.store or args.imports or args.export):
        paths.check_session_dir(args.directory)
    elif args.command == "eval":
        paths.check_eval_dataset(args.dataset, args.agent, args.scorer)
    elif args.command == "eval-report":
        paths.check_eval_log(args.log)
    elif args.command == "eval-compare":
        paths.check_eval_log(args.before)
        paths.check_eval_log(args.after)


def _rewrite_eval(argv: list[str]) -> list[str]:
    """`eval report ...` / `eval compare ...` as their own commands (a dataset file named
    `report` is still reachable as `./report`)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--color" else 1  # the one global option with a separate value
    if argv[i : i + 1] == ["eval"] and i + 1 < len(argv) and argv[i + 1] in _EVAL_SUBCOMMANDS:
        return [*argv[:i], _EVAL_SUBCOMMANDS[argv[i + 1]], *argv[i + 2 :]]
    return argv


# `--color` and `--raw` belong to `treadle` itself: after the command they are unknown there.
_GLOBAL_FLAGS = ("--color", "--raw")


def _rewrite_back(command: str) -> str:
    """`eval-report` as the user typed it (`eval report`)."""
    for word, internal in _EVAL_SUBCOMMANDS.items():
        if command == internal:
            return f"eval {word}"
    return command


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of `command` (the top-level one when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            found: argparse.ArgumentParser = action.choices[command]
            return found
    return parser


def _before_command(words: list[str], flag: str, command: str | None) -> bool:
    """Whether the unknown `flag` was typed before the command word (or with none)."""
    if command is None or command not in words:
        return True
    return flag in words[: words.index(command)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `treadle` command with `argv` (default: `sys.argv[1:]`); returns the exit code."""
    parser = build_parser()
    words = _rewrite_eval(list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(words)
    misplaced = [w.split("=", 1)[0] for w in extra if w.split("=", 1)[0] in _GLOBAL_FLAGS]
    if misplaced and args.command is not None:
        flag = misplaced[0]
        sub = _subparser(parser, args.command)
        sub.print_usage(sys.stderr)
        shown = _rewrite_back(args.command)
        print(
            f"treadle: error: {flag} is an option of treadle itself, not of {shown}.\n"
            f"treadle: fix: put it before the command: treadle {flag}"
            f"{' never' if flag == '--color' else ''} {shown} ...",
            file=sys.stderr,
        )
        return EXIT_CODES["usage"]
    if extra:  # reported by the subcommand's parser, with its usage, not treadle's
        if _before_command(words, extra[0], args.command):  # `treadle --bogus run`: treadle's
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return EXIT_CODES["usage"]
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("treadle: interrupted.", file=sys.stderr)
        return EXIT_CODES["interrupted"]
    except BrokenPipeError:
        # The reader went away (`show F | head`): not an error; /dev/null takes the last flush.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_CODES["ok"]
    except Exception as err:
        if os.environ.get("TREADLE_DEBUG"):
            import traceback

            traceback.print_exc()
        failure = explain(err, args.command)
        print_failure(failure)  # control characters shown visibly
        return failure.code
