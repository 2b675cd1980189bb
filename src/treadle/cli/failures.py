"""What the command line says, and which exit code it returns, when something goes wrong.

Every failure becomes one line of cause and one line of fix on stderr, never a traceback (set
`TREADLE_DEBUG=1` to see one). This module only classifies errors; it never prints.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from treadle.cli.shown_url import redact_urls
from treadle.cli.terminal_text import visible
from treadle.errors import (
    AuthenticationError,
    ConfigurationError,
    ContextLengthError,
    EvalLogBusyError,
    EvalLogDamagedError,
    InvalidRequestError,
    ModelNotFoundError,
    NotOpenAIEndpointError,
    PersistenceError,
    ProtocolMismatchError,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
    RateLimitError,
    SandboxError,
    SandboxUnavailable,
    TreadleError,
)

__all__ = ["EXIT_CODES", "CliFailure", "explain", "print_failure"]

#: Exit codes of the `treadle` command (documented in docs/getting-started.md).
EXIT_CODES: dict[str, int] = {
    "ok": 0,
    "error": 1,  # anything else that went wrong during a pass
    "usage": 2,  # bad flags or configuration (missing key or model), bad files
    "auth": 3,  # the endpoint rejected the API key
    "connection": 4,  # the endpoint could not be reached or timed out
    "endpoint": 5,  # the endpoint answered with another error (unknown model, rate limit...)
    "interrupted": 130,  # Ctrl-C
}


@dataclass(frozen=True, slots=True)
class CliFailure(Exception):
    """A failure the CLI reports as `cause` and `fix`, exiting with `code`."""

    cause: str
    fix: str = ""
    code: int = EXIT_CODES["error"]

    def __str__(self) -> str:
        return self.cause


def explain(err: BaseException, command: str | None = None) -> CliFailure:
    """The cause, fix and exit code for an error raised while running `command` (`run`,
    `eval`, ...: named in a fix that can only point at the command's `--help`).

    Every URL in the cause is cut to `scheme://host[:port]`, and one with user-info or a query
    in the fix too: a base URL can carry a key (`treadle.cli.shown_url`)."""
    failure = _explain(err, command)
    return CliFailure(
        redact_urls(failure.cause), redact_urls(failure.fix, keep_safe_paths=True), failure.code
    )


def print_failure(failure: CliFailure) -> None:
    """The `treadle: error:` (and `fix:`) lines on stderr. A cause can quote a server's or a
    model's text (an error body, a tool's name): control characters are shown, as model text
    is, never reaching the terminal raw."""
    print(f"treadle: error: {visible(failure.cause)}", file=sys.stderr)
    if failure.fix:
        print(f"treadle: fix: {visible(failure.fix)}", file=sys.stderr)


def _explain(err: BaseException, command: str | None) -> CliFailure:
    if isinstance(err, CliFailure):
        return err
    message = str(err) or type(err).__name__
    if isinstance(err, ProviderError):
        return _explain_provider(err, _provider_cause(err))
    if isinstance(err, ConfigurationError):
        fix = _configuration_fix(message, command)
        return CliFailure(_without_library_advice(message), fix, EXIT_CODES["usage"])
    if isinstance(err, EvalLogBusyError):
        pid = re.search(r"pid (\d+)", message)
        other = f"the other run (pid {pid[1]})" if pid else "the other run"
        stop = f" or stop it (`kill {pid[1]}`)" if pid else " or stop it"
        return CliFailure(
            message, f"wait for {other} to end,{stop}, or pass --log NEW.jsonl for this run.",
            EXIT_CODES["usage"],
        )  # fmt: skip
    if isinstance(err, EvalLogDamagedError):
        where = f"line {err.line} of {err.path}" if err.line and err.path else "the damaged line"
        return CliFailure(
            message, f"repair or move {where} (a copy of the log without it resumes), or pass "
            "--log NEW.jsonl to start a new log.",
            EXIT_CODES["usage"],
        )  # fmt: skip
    if (
        isinstance(err, PersistenceError)
        and "is a session transcript, not an evaluation" in message
    ):
        shown = re.search(r"see it with `(treadle show .+)`\.$", message)
        return CliFailure(
            message.split("; see it with", 1)[0] + ".",
            f"render it with `{shown[1] if shown else 'treadle show FILE'}`; eval logs are in "
            "`.treadle/evals/` by default.",
            EXIT_CODES["usage"],
        )
    if isinstance(err, PersistenceError):
        return CliFailure(
            message, "check the path; `treadle sessions DIR` lists readable sessions.",
            EXIT_CODES["usage"],
        )  # fmt: skip
    if isinstance(err, SandboxUnavailable):
        return CliFailure(
            message,
            "install bubblewrap for --sandbox isolated, or pass --sandbox local (no isolation).",
            EXIT_CODES["usage"],
        )
    if isinstance(err, SandboxError):
        return CliFailure(
            message,
            "check that the --sandbox directory exists and is writable (ls -ld DIR), or pass "
            "--sandbox local for a temporary one.",
            EXIT_CODES["error"],
        )
    if isinstance(err, TreadleError):
        return CliFailure(
            message, "rerun with TREADLE_DEBUG=1 to see where it was raised.", EXIT_CODES["error"]
        )
    return CliFailure(
        f"{type(err).__name__}: {message}",
        "this looks like a bug in Treadle; rerun with TREADLE_DEBUG=1 and report the traceback.",
        EXIT_CODES["error"],
    )


# The library's messages end with advice in Python terms ("; check OPENAI_API_KEY or
# Provider(api_key=...)." or, after a server's own sentence, ". Check ..."). The CLI prints its own
# fix line in flags, so that last part is dropped from the cause when it names something a
# command-line user cannot type.
# "e.g. " and "i.e. " end in a full stop but do not end a sentence: cutting there would leave
# "give one of the servers a prefix, e.g." with nothing after it.
_SEPARATOR = re.compile(r"; |(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.) ")
_PYTHON_ADVICE = re.compile(
    r"Provider[.(]|MCPServer|base_url|max_retries|requests_per_minute|@tool\(|prefix="
)


def _without_library_advice(message: str) -> str:
    separators = list(_SEPARATOR.finditer(message))
    if not separators or not _PYTHON_ADVICE.search(message[separators[-1].end() :]):
        return message
    return message[: separators[-1].start()].rstrip(" .:") + "."


def _provider_cause(err: ProviderError) -> str:
    """`str(err)` with the library's advice cut, the HTTP status and request id kept."""
    parts = [_without_library_advice(err.message)]
    if err.status_code is not None:
        parts.append(f"(HTTP {err.status_code})")
    if err.request_id:
        parts.append(f"[request id {err.request_id}]")
    return " ".join(parts)


_URL_FIX = (
    "point --base-url / OPENAI_BASE_URL at an OpenAI-compatible API, for example "
    "http://127.0.0.1:8080/v1 (the URL usually ends in /v1)."
)


def _explain_provider(err: ProviderError, message: str) -> CliFailure:
    """One fix per kind of endpoint failure: what the user should do, not what went wrong."""
    endpoint = EXIT_CODES["endpoint"]
    if isinstance(err, AuthenticationError):
        return CliFailure(
            message,
            "set OPENAI_API_KEY (or pass --api-key KEY) to a key this endpoint accepts, or "
            "pass --base-url for another endpoint.",
            EXIT_CODES["auth"],
        )
    if isinstance(err, ProtocolMismatchError):
        suggested = re.search(r"base_url=(https?://\S+?)\.?(?:\s|$)", err.message)
        if suggested:
            fix = f"pass --base-url {suggested.group(1)} (the scheme the server speaks)."
        else:
            fix = (
                "give --base-url / OPENAI_BASE_URL the scheme the server speaks (http:// for a "
                "plain-HTTP server such as a local llama.cpp, https:// for a TLS one)."
            )
        return CliFailure(message, fix, EXIT_CODES["connection"])
    if isinstance(err, ProviderTimeout):
        return CliFailure(
            message,
            "pass --timeout SECONDS to wait longer (default: 10 s to connect, 600 s between "
            "reads), and check that the server at --base-url / OPENAI_BASE_URL is running.",
            EXIT_CODES["connection"],
        )
    if isinstance(err, ProviderConnectionError):
        return CliFailure(
            message,
            "check --base-url / OPENAI_BASE_URL (it ends in /v1) and that the server is running; "
            "`treadle demo` needs no server.",
            EXIT_CODES["connection"],
        )
    if isinstance(err, NotOpenAIEndpointError):
        return CliFailure(message, _URL_FIX, endpoint)
    if isinstance(err, ModelNotFoundError):
        return CliFailure(
            message,
            "check --model / TREADLE_MODEL: use a model this endpoint serves (see /v1/models).",
            endpoint,
        )
    if isinstance(err, InvalidRequestError):
        return CliFailure(
            message,
            "the model or server cannot handle this request: try another --model or a simpler "
            "prompt; retrying the same request will not help.",
            endpoint,
        )
    if isinstance(err, RateLimitError):
        fix = "wait and retry, or pass a higher --retries N."
    elif isinstance(err, ContextLengthError):
        fix = "shorten the prompt, or pass --model with a larger context window."
    elif err.status_code is not None and 400 <= err.status_code < 500:
        fix = "the endpoint refused the request: check --model and the server's documentation."
    else:
        fix = (
            "the endpoint is failing: retry later (or pass a higher --retries N), or check the "
            "endpoint's logs."
        )
    return CliFailure(message, fix, endpoint)


def _configuration_fix(message: str, command: str | None) -> str:
    if "tool" in message and ("prefix" in message or "@tool(name=" in message):
        # In the CLI every tool beyond the built-in ones comes from an MCP server.
        return (
            "add --mcp-prefix NAME right after the --mcp or --mcp-url whose tools clash, e.g. "
            '--mcp "mcp-server-git" --mcp-prefix git.'
        )
    if "base_url" in message:
        return _URL_FIX
    if "api_key" in message or "API key" in message:
        return (
            "set OPENAI_API_KEY (or pass --api-key KEY), or point --base-url at a local "
            "OpenAI-compatible server."
        )
    words = (command or "COMMAND").replace("-", " ")  # `eval-report` is typed `eval report`
    return f"check the flags and environment variables (`treadle {words} --help` lists them)."
