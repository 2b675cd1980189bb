"""What kind of failure ended a sample, and whether trying it again could help.

Infrastructure failures (the endpoint rate-limited, timed out, dropped the connection, answered
garbage or a 5xx; the sample ran past its timeout; its worker died) say nothing about the agent,
so a sample that hits one runs again, up to the run's retry limit. Every other failure is the
agent's (or the scorer's) and is scored as a failure, never retried. Pure classification.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

from treadle.errors import (
    AuthenticationError,
    ContextLengthError,
    MalformedResponse,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
    RateLimitError,
)

__all__ = ["ERROR_KINDS", "classify", "classify_scorer", "classify_text", "retryable"]

# Frames of Treadle, the standard library and installed packages are not the user's: a scorer's
# file:line is the last other frame (where their code called json.loads, not inside it).
_NOT_USER = tuple(
    {str(Path(__file__).resolve().parent.parent)}
    | {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)

#: Every error kind a log may hold, and whether it is an infrastructure failure (retried).
ERROR_KINDS: dict[str, bool] = {
    "rate_limit": True,
    "provider_timeout": True,
    "connection": True,
    "malformed_response": True,
    "server_error": True,
    "timeout": True,  # the sample ran past the run's per-sample timeout
    "lost": True,  # every worker it ran on died (process / Ray backends)
    "auth": False,
    "context_length": False,
    "bad_request": False,
    "structured_output": False,
    "agent_error": False,  # any other exception from the agent
    "scorer_error": False,
}

# Exception class names as remote workers report them ("Name: message"), most specific first.
_BY_NAME = {
    "RateLimitError": "rate_limit",
    "ProviderTimeout": "provider_timeout",
    "ProviderConnectionError": "connection",
    "MalformedResponse": "malformed_response",
    "AuthenticationError": "auth",
    "ContextLengthError": "context_length",
    "StructuredOutputError": "structured_output",
    "ScorerError": "scorer_error",
    "TimeoutError": "timeout",
}


def classify(err: BaseException) -> str:
    """The error kind of an exception raised by an agent's pass or a scorer."""
    for cls, kind in (
        (RateLimitError, "rate_limit"),
        (ProviderTimeout, "provider_timeout"),
        (ProviderConnectionError, "connection"),
        (MalformedResponse, "malformed_response"),
        (AuthenticationError, "auth"),
        (ContextLengthError, "context_length"),
    ):
        if isinstance(err, cls):
            return kind
    if isinstance(err, ProviderError):
        status = err.status_code
        if status is None or status >= 500 or status in (408, 409):
            return "server_error"
        return "bad_request"
    if isinstance(err, TimeoutError):
        return "timeout"
    return _BY_NAME.get(type(err).__name__, "agent_error")


def classify_scorer(err: BaseException) -> tuple[str, str]:
    """The error kind and logged text of an exception raised while scoring a sample.

    Anything but an infrastructure or provider failure (a judge's endpoint) is the scorer's
    fault, never the agent's: `scorer_error`, with the file:line in the user's code it was
    raised at, so the log and the CLI say where to look."""
    kind = classify(err)
    text = f"{type(err).__name__}: {err}"
    if kind == "agent_error":
        kind = "scorer_error"
        frames = [
            f for f in traceback.extract_tb(err.__traceback__)
            if not f.filename.startswith(_NOT_USER)
        ]  # fmt: skip
        if frames:
            text = f"{type(err).__name__} at {frames[-1].filename}:{frames[-1].lineno}: {err}"
    return kind, text[:2000]


def classify_text(status: str, error: str | None) -> str:
    """The error kind of a remote outcome: its status and its `"Name: message"` error text."""
    if status in ("timeout", "lost"):
        return status
    name = (error or "").split(":", 1)[0].strip()
    if name == "ProviderError":
        return "server_error"
    return _BY_NAME.get(name, "agent_error")


def retryable(kind: str | None) -> bool:
    """Whether a sample that failed with `kind` may run again."""
    return kind is not None and ERROR_KINDS.get(kind, False)
